"""Skip mode past a feed of a shape the path was not traced with (a shape group's member fed
another length: shape_groups.py). The group's graph takes any shape the group relaxes to and
computes the shape constants it derives from the shapes it holds; what Python sees must be
this iteration's: each matched op's output shapes come from TF's inference on this
iteration's shapes (cached per op and input shapes), each skipped unit's results get the shapes
every member shares or TF's inference over its records, and shape reads are answered from this
iteration's shapes (`static_now`), never from the traced length's.

A mixin of `PythonRunner` (python_runner.py): `shape_from` is the record of that feed,
`new_shapes` the shapes found since.
"""
from __future__ import annotations

import numpy as np

from terra.compiler.shapes import output_shapes
from terra.ir.op_kinds import HOST_OPS
from terra.ir.records import FeedRef, OutputRef, TensorSpec
from terra.runtime.shape_groups import current_record
from terra.runtime.static_values import StaticValues

__all__ = ["NewShapes"]


class NewShapes:
    def _takes_new_shape(self, slot, dtype, shape) -> bool:
        """Whether a feed of a shape the path was not traced with can still be put: the path
        runs a shape group's graph (shape_groups.py), which takes any shape the group relaxes
        to, and what follows has its output shapes from TF's inference on this iteration's
        shapes. Plain ops do (the typical case: the next batch, of another length, sliced
        after the tape's block and before the next step's). So does a coarse unit whose every
        shape constant the group's graph computes from the shapes it holds (`derive`): its
        results get the shapes every member's share, or TF's inference over its records. A
        shape constant the member puts as traced, outside such a unit, does not; nor does a
        length of 0 or 1 before a unit, or a member traced with one (TF's Python may build
        other ops for it)."""
        path = self.iteration.path
        group = path.group
        if group is None or self.view is not path.view or \
                not self.iteration.exe.takes_other_shapes:
            return False
        want = group.relaxed.trace.feeds[slot].spec
        if want.dtype != dtype or want.shape is None or len(want.shape) != len(shape) or \
                any(a is not None and a != b for a, b in zip(want.shape, shape)):
            return False
        pos = self.pos
        units = [u for u in self.view.units.values() if u.end > pos]
        if units and any(m is not path and m.graph is path.graph and m.view is not None and
                         m.view.feed_specs[slot].shape == tuple(shape) for m in group.members):
            return False  # a member traced with this shape: the switch goes there (its units'
            # shapes are known; a unit's results need no inference)
        if any(u.start < pos or not group.computes_constants_of(u) for u in units):
            return False
        if any(r >= pos and not any(u.start <= r < u.end for u in units)
               for r, _ in group.relaxed.const_sites.values()):
            return False
        traced = self.view.feed_specs[slot].shape
        if units and any(a != b and min(a, b) < 2 for a, b in zip(shape, traced or shape)):
            return False
        if self.shape_from is None:
            self.shape_from = pos
        self.new_shapes[("feed", slot)] = tuple(shape)
        self._use_table(path, (pos, slot, tuple(shape)))
        return True

    def _use_table(self, path, feed) -> None:
        """The shapes found past the feeds of new shapes accepted so far (`feed` the latest),
        kept on the member: the next iteration fed the same shapes finds them there (TF's
        inference once per feed signature, not per op and iteration)."""
        tables = path.__dict__.setdefault("_new_shape_tables", {})
        key = self.__dict__.get("_shape_key", ()) + (feed,)
        self._shape_key = key
        table = tables.get(key)
        if table is None:
            if len(tables) >= _TABLES:
                tables.clear()
            table = tables[key] = {}
        self._shape_table = table
        self.__dict__.pop("_static_now", None)

    def unit_result_shapes(self, unit) -> None:
        """This iteration's shapes of the results of `unit`, skipped whole past `shape_from`:
        a result's shape every member shares (fixed in the relaxed trace: a gradient's, by its
        variable), else TF's inference over the unit's records, each shape constant the value
        the group's graph computes (`_current`); diverges where it cannot fix them. The unit's
        shapes are kept per feed signature (`_use_table`): an iteration fed the same shapes
        takes them whole."""
        group = self.iteration.path.group
        relaxed = group.relaxed.trace.records
        refs = [r for r in unit.result if isinstance(r, OutputRef)]
        if all(None not in (relaxed[r.record].outputs[r.index].shape or (None,)) and
               r not in group.unknown for r in refs):
            for r in refs:
                outs = self.new_shapes.get(r.record)
                outs = list(outs) if outs is not None else \
                    [o.shape for o in relaxed[r.record].outputs]
                outs[r.index] = relaxed[r.record].outputs[r.index].shape
                self.new_shapes[r.record] = tuple(outs)
            return
        table = self.__dict__.get("_shape_table")
        key = ("unit", unit.start, unit.end)
        known = table.get(key) if table is not None else None
        if known is not None:  # (this feed signature's: found once, not per iteration)
            self.new_shapes.update(known)
            return
        records = self.view.records
        for i in range(unit.start, unit.end):
            self._infer_shapes(records[i])
        if table is not None:
            table[key] = {i: self.new_shapes[i] for i in range(unit.start, unit.end)
                          if i in self.new_shapes}  # (not a host op's, nor one the graph
            # leaves open)

    def _current(self, rec, group):
        """Record `rec` with each shape constant the group's graph computes from shapes replaced
        by its value this iteration (the shapes so far: `new_shapes`, then the path's)."""
        out = current_record(group, rec, self._shape_now)
        if out is None:
            self._diverge("op of a new shape TF cannot infer", rec.op_type, "a shape")
        return out

    def static_now(self) -> StaticValues:
        """This iteration's static values past a feed of a new shape (`Path.static` holds the
        traced length's): shape reads, and integer arithmetic on them, by its shapes."""
        s = self.__dict__.get("_static_now")
        if s is None:
            group = self.iteration.path.group

            def rewrite(rec):
                if group is None or rec.index < self.shape_from:
                    return rec
                return current_record(group, rec, self._shape_now) or rec
            table = self.__dict__.get("_shape_table")
            s = table.get("static") if table is not None else None
            if s is None:  # (values of one feed signature: the same in every iteration fed it)
                s = StaticValues(self.view.trace, self._shape_now, rewrite)
                if table is not None:
                    table["static"] = s
            s.shape_of, s.rewrite = self._shape_now, rewrite  # this iteration's shapes
            self._static_now = s
        return s

    def _shape_now(self, ref):
        if isinstance(ref, FeedRef):
            return self.new_shapes.get(("feed", ref.slot), self.view.feed_specs[ref.slot].shape)
        mine = self.new_shapes.get(ref.record)
        if mine is not None:
            return mine[ref.index]
        if self.shape_from is not None and ref.record >= self.shape_from:
            return None  # (not known this iteration: inside a unit skipped whole)
        shape = self.iteration.exe.static_shape(ref)
        return None if shape is None or not shape.is_fully_defined() else \
            tuple(shape.as_list())

    def _infer_shapes(self, rec) -> None:
        """This iteration's output shapes of record `rec` (past `shape_from`), by TF's
        inference on its inputs' shapes now; diverges where it cannot fix them. (A host op
        runs for real: its values carry their own shapes.)"""
        if rec.op_type in HOST_OPS:
            return
        table = self.__dict__.get("_shape_table")
        known = table.get(rec.index) if table is not None else None
        if known is not None:
            self.new_shapes[rec.index] = known
            return
        group = self.iteration.path.group
        if group is not None and any(OutputRef(rec.index, j) in group.unknown
                                     for j in range(len(rec.outputs))):
            # a shape no run of the graph knows before it runs (data sets it: a ragged row's
            # length), whatever the members showed: the graph's, a sync point where it is read
            # (`ShapeGroup.static_shape`)
            return
        if group is not None:  # shapes every member shares need no inference
            relaxed = group.relaxed.trace.records[rec.index].outputs
            if all(o.shape is not None and None not in o.shape for o in relaxed):
                self.new_shapes[rec.index] = tuple(o.shape for o in relaxed)
                return
            rec = self._current(rec, group)

        def spec_of(ref):
            if isinstance(ref, FeedRef):
                shape = self.new_shapes.get(("feed", ref.slot), self.view.feed_specs[ref.slot].shape)
                return TensorSpec(self.view.feed_specs[ref.slot].dtype, shape)
            mine = self.new_shapes.get(ref.record)
            spec = self.view.records[ref.record].outputs[ref.index]
            if mine is not None:
                return TensorSpec(spec.dtype, mine[ref.index])
            shape = self.iteration.exe.static_shape(ref)
            return TensorSpec(spec.dtype, None if shape is None or shape.rank is None
                              else tuple(shape.as_list()))
        static = self.static_now()
        outs = output_shapes(rec, spec_of, lambda ref: _small_array(static.get(ref)))
        if outs is not None and any(s is None for s in outs):
            # a shape TF's inference leaves open but the op's value fixes
            # (`BroadcastGradientArgs`' reduction axes): the value's
            values = [static.get(OutputRef(rec.index, j)) for j in range(len(outs))]
            outs = tuple(s if s is not None or v is None else tuple(v.shape.as_list())
                         for s, v in zip(outs, values))
        if outs is None or any(s is None for s in outs):
            self._diverge("op of a new shape TF cannot infer", rec.op_type, "another shape")
        self.new_shapes[rec.index] = outs
        if table is not None:
            table[rec.index] = outs


_TABLES = 32  # feed signatures a member keeps the shapes of


def _small_array(value):
    return None if value is None else np.asarray(value)
