"""Whether a record's output shapes hold for every value of its fed inputs, by TF's own shape
inference: a placeholder reports its record's shape without waiting for the graph, so a path
may turn a constant into a feed only where the shape does not depend on the value (`x[a]` with
a changing `a` keeps its shape; `x[a:a + n]` with a changing `n` does not)."""
from __future__ import annotations

import tensorflow as tf

from terra.compiler.replay import Builder
from terra.ir.records import ConstRef, FeedRef, OutputRef, Trace, VariableRef

_cache: dict = {}


class _Probe(Builder):
    """Builds one record in a scratch graph: fed and produced inputs are graph placeholders of
    their recorded specs (values unknown), constants are constants, variables unknown handles."""

    def __init__(self, spec_of):
        super().__init__(Trace("shape-probe"), None)
        self.spec_of = spec_of

    def value(self, ref, dtype=None):
        if isinstance(ref, (FeedRef, OutputRef)):
            spec = self.spec_of(ref)
            return tf.compat.v1.placeholder(spec.dtype, spec.shape)
        if isinstance(ref, VariableRef):
            if dtype is None or dtype == "resource":
                return tf.compat.v1.placeholder(tf.resource, [])
            return tf.compat.v1.placeholder(dtype, None)
        return super().value(ref, dtype)


def _key(rec, spec_of):
    def one(r):
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
