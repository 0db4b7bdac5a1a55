"""Values of a path that Python may read without waiting for the graph.

A co-executed path is concrete: every feed's shape and dtype is checked against the path's before
it is put, and the path's constants are part of its signature. So a `Shape` / `Size` / `Rank` of a
fully defined recorded shape, and small integer or boolean arithmetic over such values and
constants (the `n = tf.shape(x)[1]; pos[:n]` of a model that reads its sequence length), have the
same value in every iteration that takes the path. `StaticValues.get(ref)` computes that value
once (eagerly, on the recorded constants) and caches it; the PythonRunner then answers the read
at once instead of making it a sync point that waits for the graph. Anything else returns None.

Not so the shape of a value whose shape depends on data (a `tf.where`'s length, and what is
computed from it): the path's record holds the length of the traced iteration only, and another
iteration on the same path may keep another count. Those are the outputs TF's inference cannot
fix with every feed of its recorded shape (`compiler.shapes.unknown_shapes`), found once per
path, on the first shape read of a produced value. Their shapes count as known only where the
caller has checked them this iteration (`get(ref, checked)`: a coarse unit whose guard compared
them with the traced ones before its own shape reads are answered).
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from terra.compiler.shapes import unknown_shapes
from terra.ir.records import ConstRef, FeedRef, OutputRef, Trace
from terra.runtime.fallback import EagerReplay

__all__ = ["StaticValues", "STATIC_OPS", "SHAPE_OPS"]

SHAPE_OPS = {
    "Shape": lambda shape: list(shape),
    "Size": lambda shape: math.prod(shape),
    "Rank": lambda shape: len(shape),
}
# Pure, deterministic ops that are cheap on the small integer tensors they see here.
STATIC_OPS = frozenset({
    "StridedSlice", "Slice", "Pack", "Unpack", "ConcatV2", "Reshape", "ExpandDims", "Squeeze",
    "Identity", "Cast", "AddV2", "Add", "Sub", "Mul", "FloorDiv", "FloorMod", "Maximum",
    "Minimum", "Neg", "Range", "Prod", "Sum", "Max", "Min", "Equal", "NotEqual", "Less",
    "LessEqual", "Greater", "GreaterEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "GatherV2",
    "BroadcastArgs", "BroadcastGradientArgs"})
_DTYPES = frozenset({"int32", "int64", "bool"})
_MAX_ELEMENTS = 1024


class StaticValues:
    """Per path: (record, output) -> its iteration-invariant value, or None."""

    def __init__(self, trace: Trace, shape_of=None, rewrite=None, unknown=None):
        """`shape_of(ref)`: the shapes to compute with, where not the recorded ones, and
        `rewrite(rec)`: the record as this iteration runs it (an iteration of a shape group's
        member fed another length: `PythonRunner.static_now`)."""
        self.trace = trace
        self.shape_of = shape_of
        self.rewrite = rewrite
        # () -> the outputs whose shape depends on data, as the path's graph found them (None:
        # no graph yet; they are then found from the trace)
        self.unknown_of = unknown
        self._replay = EagerReplay(trace, {})
        self._known: dict = {}
        self._unknown = None   # outputs whose shape depends on data (`unknown_shapes`)

    def unknown_pending(self) -> bool:
        """Whether the data-dependent shapes have not been found yet."""
        return self._unknown is None

    def assume_unknown(self, unknown) -> None:
        """Take `unknown` as the outputs whose shape depends on data (what a graph's inference
        found), forgetting the values computed under another assumption."""
        self._unknown = frozenset(unknown)
        self._known.clear()

    def get(self, ref: OutputRef, checked=frozenset()):
        """The value of `ref` in every iteration on the path whose data-dependent shapes in
        `checked` are the traced ones; None if it is not static."""
        value, needs = self._get(ref)
        return value if needs <= checked else None

    def shape_function(self, ref: OutputRef) -> bool:
        """Whether `ref`'s value is a function of shapes alone (static given the traced
        shapes of the data-dependent values it reads)."""
        return self._get(ref)[0] is not None

    def _get(self, ref: OutputRef):
        """(value or None, the data-dependent shapes it assumed to be the traced ones)."""
        key = (ref.record, ref.index)
        if key in self._known:
            return self._known[key]
        self._known[key] = (None, frozenset())  # (a trace has no cycle; this caches misses too)
        self._needs = set()
        try:
            value = self._compute(ref)
        except (tf.errors.OpError, ValueError, TypeError, KeyError):
            value = None
        out = self._known[key] = (value, frozenset(self._needs) if value is not None
                                  else frozenset())
        return out

    def _spec_shape(self, ref):
        if self.shape_of is not None and isinstance(ref, (OutputRef, FeedRef)):
            return self.shape_of(ref)
        if isinstance(ref, OutputRef):
            return self.trace.records[ref.record].outputs[ref.index].shape
        if isinstance(ref, FeedRef):
            return self.trace.feeds[ref.slot].spec.shape
        if isinstance(ref, ConstRef):
            return tuple(np.shape(ref.value))
        return None

    def _compute(self, ref):
        rec = self.trace.records[ref.record]
        if self.rewrite is not None:
            rec = self.rewrite(rec)
        if rec.route == "function" or any(o.dtype not in _DTYPES for o in rec.outputs):
            return None
        want = rec.outputs[ref.index]
        want_shape = self._spec_shape(ref)  # (None: not known yet, `shape_of`: the value's)
        if want_shape is None and self.shape_of is None or want_shape is not None and (
                None in want_shape or math.prod(want_shape) > _MAX_ELEMENTS):
            return None
        if rec.op_type in SHAPE_OPS:
            shape = self._spec_shape(rec.inputs[0])
            if shape is None or None in shape:
                return None
            if isinstance(rec.inputs[0], OutputRef):
                if self._unknown is None:
                    known = self.unknown_of() if self.unknown_of is not None else None
                    self._unknown = known if known is not None else unknown_shapes(self.trace)
                if rec.inputs[0] in self._unknown:
                    self._needs.add(rec.inputs[0])
            value = tf.constant(SHAPE_OPS[rec.op_type](shape), dtype=want.dtype)
        elif rec.op_type in STATIC_OPS:
            for r in rec.input_refs():
                if isinstance(r, OutputRef):
                    needs = self._needs
                    v, more = self._get(r)
                    self._needs = needs | more
                    if v is None:
                        return None
                    self._replay.env[(r.record, r.index)] = v
                elif not isinstance(r, ConstRef):
                    return None
            self._replay.step(rec)
            value = self._replay.env[(rec.index, ref.index)]
        else:
            return None
        if value.dtype.name != want.dtype or want_shape is not None and \
                tuple(value.shape.as_list()) != tuple(want_shape) or \
                value.shape.num_elements() > _MAX_ELEMENTS:
            return None
        return value

