"""The one trace interpreter: walk a trace's records in order, read each input from an
environment, write each output back (JAX's `eval_jaxpr`).

What a read and an op become is the emitter's, a subclass:
- `GraphReplay` (compiler/replay.py) creates graph ops: `compile_trace`, the lowering of a
  TraceGraph (compiler/lower.py), the channel graph of one path (compiler/path_lowering.py) and
  shape probes (compiler/shapes.py) all emit through it;
- `EagerReplay` (runtime/fallback.py) executes ops eagerly and records them on the active
  gradient tapes, for the fallback's prefix and for static values.

So the rules for resolving an input (an earlier output, a feed slot, a variable, a constant) and
for the dtype an op expects at each input live here once, not once per emitter.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.ir.records import ConstRef, FeedRef, OutputRef, Trace, VariableRef


def arg_dtypes(rec, op_def) -> list:
    """Per input argument of `op_def`: the dtype name op record `rec` expects there, or a list
    of them for a list argument (`N * T` or a type list)."""
    attrs = dict(rec.attrs)
    out = []
    for arg, ref in zip(op_def.input_arg, rec.inputs):
        if arg.type_list_attr:
            out.append(list(attrs[arg.type_list_attr]))
            continue
        dtype = attrs.get(arg.type_attr) if arg.type_attr else tf.as_dtype(arg.type).name
        out.append([dtype] * len(ref) if arg.number_attr else dtype)
    return out


def input_dtypes(rec) -> dict:
    """Input position ((arg,) or (arg, k)) -> the dtype name op record `rec` expects there
    (empty for a function call: it takes each value's own)."""
    if rec.route == "function":
        return {}
    out = {}
    for a, d in enumerate(arg_dtypes(rec, tfp.get_op_def(rec.op_type))):
        if isinstance(d, list):
            out.update(((a, k), x) for k, x in enumerate(d))
        else:
            out[(a,)] = d
    return out


def constant(ref: ConstRef):
    """The tensor of a recorded constant, made in the current graph (or eagerly)."""
    np_dtype = object if ref.dtype == "string" else tf.as_dtype(ref.dtype).as_numpy_dtype
    return tf.constant(np.array(ref.value, dtype=np_dtype), dtype=ref.dtype)


def _thaw_attr(attr_type, value):
    if attr_type == "type":
        return tf.as_dtype(value).as_datatype_enum
    if attr_type == "list(type)":
        return [tf.as_dtype(x).as_datatype_enum for x in value]
    if attr_type == "shape":
        return None if value is None else list(value)
    if attr_type == "list(shape)":
        return [None if s is None else list(s) for s in value]
    if attr_type.startswith("list("):
        return list(value)
    return value


_thawed: dict = {}


def attrs_flat(rec) -> tuple:
    """Op record `rec`'s attrs as eager execution takes them (`execute.execute`'s flat
    name, value, ... tuple), cached per op type and attrs."""
    key = (rec.op_type, rec.attrs)
    out = _thawed.get(key)
    if out is None:
        op_def = tfp.get_op_def(rec.op_type)
        types = {a.name: a.type for a in op_def.attr}
        flat = []
        for name, value in rec.attrs:
            flat += [name, _thaw_attr(types[name], value)]
        out = _thawed[key] = tuple(flat)
    return out


class Interpreter:
    """Runs `trace.records` into `env` ((record, output index) -> value); `feeds[slot]` is a
    feed's value. Subclasses emit: `variable`, `op` and `function` (and may widen `feed` or
    `value` for refs of their own)."""

    def __init__(self, trace: Trace, feeds):
        self.trace = trace
        self.feeds = feeds
        self.env: dict = {}
        self.consts: dict = {}
        self.at = None   # the record being run (the failing one on an error)

    # ---- reading
    def value(self, ref, dtype=None):
        """The value of input `ref`, where the op expects `dtype` (a dtype name, "resource", or
        None for the value's own)."""
        if isinstance(ref, OutputRef):
            return self.env[(ref.record, ref.index)]
        if isinstance(ref, FeedRef):
            return self.feed(ref.slot)
        if isinstance(ref, VariableRef):
            return self.variable(ref, dtype)
        if isinstance(ref, ConstRef):
            c = self.consts.get(ref)
            if c is None:
                c = self.consts[ref] = self.make_constant(ref)
            return c
        raise TypeError(f"{type(self).__name__}: unknown input ref {ref!r}")

    def feed(self, slot):
        return self.feeds[slot]

    def make_constant(self, ref: ConstRef):
        return constant(ref)

    def variable(self, ref: VariableRef, dtype):
        raise NotImplementedError

    def arg_values(self, rec, op_def) -> list:
        """Per input argument of `op_def`, the value (a list for a list argument)."""
        return [[self.value(r, d) for r, d in zip(ref, dtype)] if isinstance(dtype, list)
                else self.value(ref, dtype)
                for ref, dtype in zip(rec.inputs, arg_dtypes(rec, op_def))]

    def flat_inputs(self, rec) -> list:
        """The values of `rec`'s inputs, flat, in the order the op (or function) takes them."""
        if rec.route == "function":
            return [self.value(r, None) for r in rec.inputs]
        flat = []
        for v in self.arg_values(rec, tfp.get_op_def(rec.op_type)):
            if isinstance(v, list):
                flat.extend(v)
            else:
                flat.append(v)
        return flat

    # ---- emitting
    def op(self, rec):
        raise NotImplementedError

    def function(self, rec):
        raise NotImplementedError

    def emit(self, rec):
        """The outputs of one record (None or a sequence)."""
        return self.function(rec) if rec.route == "function" else self.op(rec)

    def write(self, rec, outs) -> None:
        for j, t in enumerate(outs or ()):
            self.env[(rec.index, j)] = t

    def step(self, rec) -> None:
        """Run one record (its inputs already in `env`)."""
        self.at = rec.index
        self.write(rec, self.emit(rec))

    def run(self, upto: int | None = None) -> dict:
        """Run the records before `upto` (all by default); returns `env`."""
        for rec in self.trace.records[:upto]:
            self.step(rec)
        return self.env


__all__ = ["Interpreter", "arg_dtypes", "input_dtypes", "constant", "attrs_flat"]
