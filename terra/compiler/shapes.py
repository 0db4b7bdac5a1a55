"""Whether a record's output shapes hold for every value of its fed inputs, by TF's own shape
inference: a placeholder reports its record's shape without waiting for the graph, so a path
may turn a constant into a feed only where the shape does not depend on the value (`x[a]` with
a changing `a` keeps its shape; `x[a:a + n]` with a changing `n` does not)."""
from __future__ import annotations

import tensorflow as tf

from terra import _tf_private as tfp
from terra.compiler.replay import GraphReplay
from terra.ir.records import ConstRef, FeedRef, OutputRef, Trace, VariableRef

_cache: dict = {}


class _Probe(GraphReplay):
    """Builds one record in a scratch graph: fed and produced inputs are graph placeholders of
    their recorded specs (values unknown), constants are constants, variables unknown handles."""

    def __init__(self, spec_of, value_of=None):
        super().__init__(Trace("shape-probe"), None)
        self.spec_of = spec_of
        self.value_of = value_of

    def value(self, ref, dtype=None):
        if self.value_of is not None and isinstance(ref, OutputRef):
            v = self.value_of(ref)
            if v is not None:
                return tf.constant(v)
        if isinstance(ref, (FeedRef, OutputRef)):
            spec = self.spec_of(ref)
            return tf.compat.v1.placeholder(spec.dtype, spec.shape)
        if isinstance(ref, VariableRef):
            if dtype is None or dtype == "resource":
                return tf.compat.v1.placeholder(tf.resource, [])
            return tf.compat.v1.placeholder(dtype, None)
        return super().value(ref, dtype)


def _key(rec, spec_of, value_of=None):
    def one(r):
        if value_of is not None and isinstance(r, OutputRef):
            v = value_of(r)
            if v is not None:
                return ("value", str(v.dtype), v.shape, v.tobytes())
        if isinstance(r, (FeedRef, OutputRef)):
            return ("spec", spec_of(r))
        return r if isinstance(r, ConstRef) else ("var",)
    return (rec.op_type, rec.attrs, tuple(tuple(one(x) for x in a) if isinstance(a, tuple)
                                          else one(a) for a in rec.inputs))


def shapes_fixed(rec, spec_of) -> bool:
    """True if TF infers every output shape of op record `rec` (its inputs as they will be:
    feeds and produced values of unknown value, `spec_of(ref)` giving their specs) fully, and
    equal to the recorded ones. Function calls and ops TF cannot build here count as not fixed."""
    if rec.route == "function":
        return False
    key = _key(rec, spec_of)
    fixed = _cache.get(key)
    if fixed is None:
        try:
            with tf.Graph().as_default():
                outs = _Probe(spec_of).op(rec)
                fixed = all(t.shape.is_fully_defined() and
                            tuple(t.shape.as_list()) == tuple(spec.shape)
                            for t, spec in zip(outs, rec.outputs))
        except Exception:  # noqa: BLE001 - an op the probe cannot build: assume the worst
            fixed = False
        _cache[key] = fixed
    return fixed


_outputs_cache: dict = {}


def output_shapes(rec, spec_of, value_of=None):
    """The output shapes TF infers for op record `rec` with inputs of the specs `spec_of(ref)`
    gives (constants as recorded; a produced input whose value `value_of(ref)` knows, a NumPy
    array, as that constant): a tuple with a shape tuple per output, None for one TF cannot
    fix; None if the op cannot be built here (function calls included). Cached per op, attrs,
    input specs and constants."""
    if rec.route == "function":
        return None
    key = _key(rec, spec_of, value_of)
    out = _outputs_cache.get(key, False)
    if out is False:
        try:
            with tf.Graph().as_default():
                outs = _Probe(spec_of, value_of).op(rec)
                out = tuple(tuple(t.shape.as_list()) if t.shape.is_fully_defined() else None
                            for t in outs)
        except Exception:  # noqa: BLE001 - an op the probe cannot build
            out = None
        if len(_outputs_cache) > 20000:
            _outputs_cache.clear()
        _outputs_cache[key] = out
    return out


def unknown_shapes(trace: Trace) -> frozenset:
    """Outputs of `trace` whose shapes TF's inference cannot give before the graph runs, with
    every feed of its recorded shape and every constant as recorded (a `tf.where`'s length, a
    `tf.range` over a computed limit): one op-creation pass, no function is traced. Host ops
    produce nothing in a graph and count as known."""
    graph = tfp.FuncGraph("terra_shapes")
    with graph.as_default(), tfp.without_op_tracebacks():
        feeds = [tf.compat.v1.placeholder(f.spec.dtype, f.spec.shape) for f in trace.feeds]
        env = GraphReplay(trace, feeds).run()
    return frozenset(OutputRef(i, j) for (i, j), t in env.items()
                     if not t.shape.is_fully_defined())
