"""Replay one recorded `Trace` as one TF graph (a concrete function).

    fn = compile_trace(trace, outputs=[rec.ref_of(loss)])
    (loss,) = fn(substitute_feeds(trace, [(x1, x2), (y1, y2)]))

The function's arguments are the trace's feeds, in slot order; its variables are the recorded
variables themselves (their resource handles are captured), so updates land in the real
variables. Ops are created straight from their recorded inputs and every recorded attr (as
AttrValue protos, cached per op type and attrs: about half the Python of `_apply_op_helper`,
which is kept for an op whose attrs or inputs only it can convert) inside
`tf.function(autograph=False)`, whose automatic control dependencies keep variable reads and
writes in recorded order. Function-call records call the recorded function object.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.compiler.fold import FOLDABLE, fold, graph_constant, identity_input
from terra.compiler.interpret import Interpreter, attrs_flat
from terra.ir.op_kinds import HOST_OPS
from terra.ir.records import ConstRef, FeedRef, OutputRef, Trace, VariableRef


def _thaw_shape(v):
    return tf.TensorShape(None if v is None else list(v))


_THAW = {
    "type": tf.as_dtype,
    "list(type)": lambda v: [tf.as_dtype(x) for x in v],
    "shape": _thaw_shape,
    "list(shape)": lambda v: [_thaw_shape(x) for x in v],
    "list(int)": list, "list(float)": list, "list(bool)": list, "list(string)": list,
}


def _thaw(attr_type: str, value):
    f = _THAW.get(attr_type)
    return value if f is None else f(value)


class ReplayFunction:
    """A compiled trace. `fn(feed_values)` runs it: `feed_values` has one value per feed slot
    (anything convertible to the slot's dtype); returns the requested outputs as eager tensors.
    `concrete` is the underlying ConcreteFunction."""

    def __init__(self, trace: Trace, outputs: tuple, concrete, grappler: bool):
        self.trace = trace
        self.outputs = outputs
        self.concrete = concrete
        self.grappler = grappler

    def __call__(self, feed_values: Sequence) -> list:
        feeds = self.trace.feeds
        if len(feed_values) != len(feeds):
            raise ValueError(f"compiled trace {self.trace.site!r} takes {len(feeds)} feed values, "
                             f"got {len(feed_values)}")
        args = [tf.convert_to_tensor(v, dtype=f.spec.dtype) for v, f in zip(feed_values, feeds)]
        if self.grappler:
            return list(self.concrete(*args))
        with tfp.function_call_config(tfp.disable_grappler):
            return list(self.concrete(*args))

    def __repr__(self) -> str:
        return f"ReplayFunction({self.trace!r} -> {list(self.outputs)!r})"


def substitute_feeds(trace: Trace, replacements: Sequence = ()) -> list:
    """The recorded feed values with each `(old, new)` pair applied by identity (`value is old`)."""
    values = list(trace.feed_values)
    for old, new in replacements:
        hits = [i for i, v in enumerate(values) if v is old]
        if not hits:
            raise ValueError(f"substitute_feeds: {type(old).__name__} object is not a feed of "
                             f"trace {trace.site!r}")
        for i in hits:
            values[i] = new
    return values


class GraphReplay(Interpreter):
    """The graph emitter of the trace interpreter: rebuilds records in the current (function)
    graph."""

    def make_constant(self, ref: ConstRef):
        if ref.dtype == "string":
            return super().make_constant(ref)
        return graph_constant(np.array(ref.value, dtype=tf.as_dtype(ref.dtype).as_numpy_dtype),
                              ref.dtype)

    def variable(self, ref: VariableRef, dtype):
        var = self.trace.variables[ref.key]
        if dtype is None or dtype == "resource":
            return var.handle if isinstance(var, tfp.BaseResourceVariable) else var
        # C++ reads a raw variable passed to a non-resource input; in a graph we read explicitly,
        # with the dtype the op expects (a bare handle kept by the recorder has dtype `resource`).
        if isinstance(var, tfp.BaseResourceVariable):
            return tfp.read_variable_op(var.handle, var.dtype)
        return tfp.read_variable_op(var, dtype)

    def op(self, rec):
        if rec.op_type in HOST_OPS:  # runs on the program's thread (op_kinds.HOST_OPS)
            for r in rec.input_refs():
                if isinstance(r, FeedRef):
                    self.value(r)  # dequeued all the same: the channels stay in step
            return []
        op_def = tfp.get_op_def(rec.op_type)
        args = self.arg_values(rec, op_def)
        flat = []
        for v in args:
            if isinstance(v, list):
                flat.extend(v)
            else:
                flat.append(v)
        if rec.op_type in FOLDABLE:  # shape arithmetic the graph knows: a constant (fold.py)
            same = identity_input(rec.op_type, flat)
            if same is not None:
                return [flat[same]]
            values = fold(rec.op_type, flat, dict(rec.attrs), attrs_flat(rec),
                          [o.dtype for o in rec.outputs])
            if values is not None:
                return [graph_constant(v, o.dtype) for v, o in zip(values, rec.outputs)]
        protos = _protos_of(rec, op_def)
        if protos is not None:
            try:
                # straight from the recorded attrs (all of them are recorded): about half the
                # Python of `_apply_op_helper`, which converts inputs and infers attrs again
                return tfp.create_op(rec.op_type, flat, protos, op_def)
            except (TypeError, ValueError):  # an input TF would have converted: its own way
                pass
        return self._apply(rec, op_def, args)

    def _apply(self, rec, op_def, args):
        kwargs, inferred = {}, set()
        for arg, v in zip(op_def.input_arg, args):
            inferred.update((arg.type_attr, arg.number_attr, arg.type_list_attr))
            kwargs[arg.name] = v
        types = {a.name: a.type for a in op_def.attr}
        for name, value in rec.attrs:
            if name not in inferred:
                kwargs[name] = _thaw(types[name], value)
        _, _, op, _ = tfp.apply_op_helper(rec.op_type, **kwargs)
        return op.outputs

    def function(self, rec):
        fn = self.trace.functions[rec.function]
        return fn.call_flat(*self.flat_inputs(rec))


# (op_type, recorded attrs) -> AttrValue protos of every attr (None: some attr is not recorded)
_PROTOS: dict = {}
_PROTOS_MAX = 50000


def _protos_of(rec, op_def):
    key = (rec.op_type, rec.attrs)
    protos = _PROTOS.get(key, False)
    if protos is False:
        types = {a.name: a.type for a in op_def.attr}
        try:
            values = {name: _thaw(types[name], v) for name, v in rec.attrs if name in types}
            protos = tfp.attr_protos(rec.op_type, op_def, values)
        except (TypeError, ValueError):  # an attr kept in a form only `_apply` converts
            protos = None
        if len(_PROTOS) >= _PROTOS_MAX:
            _PROTOS.clear()
        _PROTOS[key] = protos
    return protos


def compile_trace(trace: Trace, outputs: Sequence[OutputRef] = (), *,
                  grappler: bool = False, jit_compile: bool = False) -> ReplayFunction:
    """One concrete function that replays `trace` and returns the values of `outputs`.

    `grappler=False` (default) runs the graph without Grappler rewrites, so results are
    bit-identical to eager; its arithmetic optimizer and constant folding reassociate float math
    (differences of about one ulp after a step). `jit_compile` compiles it with XLA.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"compile_trace: expected a Trace, got {type(trace).__name__}")
    if trace.unsupported:
        raise ValueError(f"compile_trace: trace {trace.site!r} has ops Terra cannot replay: "
                         f"{trace.unsupported}")
    outputs = tuple(outputs)
    for ref in outputs:
        if not isinstance(ref, OutputRef) or not (0 <= ref.record < len(trace.records)) or \
                ref.index >= len(trace.records[ref.record].outputs):
            raise ValueError(f"compile_trace: {ref!r} is not an output of trace {trace.site!r}")

    def body(*feeds):
        env = GraphReplay(trace, feeds).run()
        return [env[(r.record, r.index)] for r in outputs]

    specs = [tf.TensorSpec(f.spec.shape, f.spec.dtype) for f in trace.feeds]
    fn = tf.function(body, autograph=False, jit_compile=jit_compile)
    return ReplayFunction(trace, outputs, fn.get_concrete_function(*specs), grappler)
