"""Skipping a coarse unit whole (a `tape.gradient`, an `apply_gradients`, a Keras layer or a
`tf.function` call): the unit at the runner's position must have the same guard; the values its
Python read while traced (shapes the graph cannot know before it runs, tensor values) must be
the same now, or the iteration switches to a path traced with the values read now. Then the
unit's recorded ops are passed over without looking at them, and its results are placeholders.

A mixin of `PythonRunner` (python_runner.py), which holds the matching of single ops.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.ir.records import ConstRef, FeedRef, OutputRef
from terra.runtime.divergence import Diverged, Divergence, user_line
from terra.runtime.fallback import EagerReplay

__all__ = ["UnitSkipping", "UNSET"]


class UnitSkipping:
    def gradient_unit(self, guard, what: str = "") -> Any:
        """Skip a recorded coarse unit (`tape.gradient`, or `what`: e.g. a tf.function call)
        whose guard is `guard`; returns flat results."""
        unit = self.view.units.get(self.pos)
        if unit is None or unit.guard != guard:
            try:
                if unit is None:
                    if what:
                        self._diverge(f"{what} where the path has none", "an op", what)
                    self._diverge("gradient call where the path has none", "an op", "tape.gradient")
                if what:
                    self._diverge(f"{what} with another guard", _guard_text(unit.guard),
                                  _guard_text(guard))
                self._diverge("gradient of different tensors", unit.guard, guard)
            except Diverged as d:
                tried = {id(self.iteration.path)}
                pos = self.pos

                def accepts(q):
                    u = q.view.units.get(pos)
                    return u is not None and u.guard == guard
                while self.iteration.switch(d.divergence, tried=tried, accepts=accepts):
                    u = self.view.units.get(self.pos)
                    if u is not None and u.guard == guard:
                        break
                else:
                    raise
            unit = self.view.units.get(self.pos)
            if unit is None or unit.guard != guard:
                self._diverge(f"{what or 'gradient call'} where the path has none", "an op",
                              what or "tape.gradient")
        tried = {id(self.iteration.path)}
        while True:
            mark = len(self.fed_order)
            for slot in unit.feeds:
                obj = self.view.trace.feed_values[slot]
                self.feed(slot, obj, obj)
            changed = self._changed_shape(unit) or self._changed_read(unit)  # (after the
            # unit's feeds: a read may need them)
            if not self.skipping:  # a read waited for a run that failed: it fell back there
                raise Diverged(changed or Divergence(
                    user_line(), "a value", "a graph error", self.pos,
                    "the graph failed while the unit's reads were checked"))
            if changed is None:
                break
            self.rollback(mark)
            while True:  # another compiled path, traced with the values read now?
                if not self.iteration.switch(changed, tried=tried):
                    raise Diverged(changed)
                u = self.view.units.get(self.pos)
                if u is not None and u.guard == guard:
                    unit = u
                    break
        if self.shape_from is not None and unit.start >= self.shape_from:
            self.unit_result_shapes(unit)  # (past a feed of a new shape: this iteration's)
        elif unit.start in self.generic_units:
            self._generic_result_shapes(unit)
        self.last_unit = unit
        self.iteration.open_gate(unit.start)
        self.pos = unit.end
        if self.advance is not None:
            self.advance(unit.end)
        out = []
        for r in unit.result:
            if r is None:
                out.append(None)
            elif isinstance(r, ConstRef):  # a shape TF's gradient code made (units._shape_constant)
                value = np.asarray(r.value, dtype=r.dtype)
                t = tf.constant(value)
                self.born[id(t)] = (t, value)  # a constant where an op takes it, as traced
                out.append(t)
            else:
                out.append(self.placeholder(self.view.records[r.record], r.index, r))
        for i, name, r in unit.tags:  # (units.py `_result_tags`)
            setattr(out[i], name, self.placeholder(self.view.records[r.record], r.index, r))
        if self.pos == self.view.n and self.view.end_sync:
            self.iteration.wait_run()
        return out

    def twin_unit(self, unit, guard) -> list:
        """Skip a TF API call made only of eager twins (`PathView.twin_units`: the next batch
        sliced in the iteration's tail) whose guard holds: its records run eagerly straight
        from the trace (eager's kernels on the values eager's Python would hand them: the same
        results), and its result placeholders hold them, as `_run_twin` makes them op by op."""
        if unit.guard != guard:
            self._diverge("call of an eager twin with another guard", unit.guard, guard)
        values = self._twin_values(unit)
        if values is None:
            self._diverge("eager twin of a value Python does not hold", "a tensor", "another")
        if self.shape_from is not None:  # (past a feed of a new shape: the values' own shapes)
            for i in range(unit.start, unit.end):
                self.new_shapes[i] = tuple(tuple(values[(i, j)].shape.as_list())
                                           for j in range(len(self.view.records[i].outputs)))
        self.iteration.session.counters.twin_units += 1
        self.last_unit = unit
        self.pos = unit.end
        if self.advance is not None:
            self.advance(unit.end)
        out = []
        for r in unit.result:
            ph = self.placeholder(self.view.records[r.record], r.index, r)
            self.hold_twin(ph, values[(r.record, r.index)])
            out.append(ph)
        if self.pos == self.view.n and self.view.end_sync:
            self.iteration.wait_run()
        return out

    def _twin_values(self, unit) -> Optional[dict]:
        """`{(record, output): tensor}` of `unit`'s records run eagerly on the values fed; None
        if a feed they read was not given a tensor now."""
        view = self.view
        for i in range(unit.start, unit.end):
            for r in view.flat_inputs[i]:
                if isinstance(r, FeedRef) and not isinstance(self.fed.get(r.slot),
                                                             tfp.EagerTensorBase):
                    return None
        replay = view.twin_replay
        if replay is None:  # (one per view: its constants are made once)
            replay = view.twin_replay = EagerReplay(view.trace, {})
        replay.feeds = self.fed
        try:
            for rec in view.records[unit.start:unit.end]:
                replay.step(rec)
            return replay.env
        finally:  # (the view outlives the iteration: it keeps neither its batch nor its values)
            replay.env, replay.feeds = {}, {}

    def _changed_shape(self, unit) -> Optional[Divergence]:
        """Why `unit` cannot be skipped as recorded: a value whose shape the graph does not know
        before it runs (the output of `tf.where`, `tf.unique`, NMS, a computed `tf.range`) has
        another shape now than when the unit was traced, and the unit's Python may have built
        its ops from that shape (a gradient's reduction axes, a layer's reshape): the values
        of `PathView.shapes_read_by`. Reading one waits for it. Values the graph does not fetch
        are all logged at once (one fallback, and the next graph fetches them)."""
        unknown = self.iteration.exe.unknown_shapes()
        if not unknown:
            return None
        read, inside = _unknown_of(self.view, unit, unknown)
        missing, changed, generic = [], None, False
        for ref in read:
            value = self.iteration.unit_read(ref)
            if value is None:
                missing.append(ref)
                continue
            traced = tuple(self.view.records[ref.record].outputs[ref.index].shape)
            if np.shape(value) == traced:
                self.shapes_checked.add(ref)  # (static values may take its traced shape now)
            elif changed is None and self._runs_with_new_shape(unit, ref, traced,
                                                               np.shape(value)):
                generic = True
            elif changed is None:
                changed = Divergence(user_line(), f"{ref!r} of shape {list(traced)}",
                                     f"shape {list(np.shape(value))}", self.pos,
                                     "a unit's input has another shape than when it was traced")
        if missing:
            for ref in missing:
                self.log_fetch(ref)
            return Divergence(user_line(), f"fetch of {missing[0]!r}", "no fetch", self.pos,
                              "shape read by a unit that the graph does not fetch")
        if generic and changed is None:
            self.generic_units.add(unit.start)
        elif changed is None:
            # its inputs have the traced shapes, so its own ops have theirs: the shape reads of
            # its Python are answered as traced, not fetched (its ops wait for this check)
            self.shapes_checked.update(inside)
        return changed

    def _generic_result_shapes(self, unit) -> None:
        """The results of `unit`, skipped with an input of another length set by the data than
        traced (`generic_units`), claim the group graph's shapes where those leave a dimension
        open: the member's recorded ones hold for its traced length only (a gradient's values
        tiled by a `tf.where`'s length, by multiples the graph computes from it)."""
        shapes = self.iteration.path.group.graph.shapes
        for r in unit.result:
            if not isinstance(r, OutputRef) or r.record in self.new_shapes:
                continue
            outs = self.view.records[r.record].outputs
            claimed = []
            for j, spec in enumerate(outs):
                graph = shapes.get(OutputRef(r.record, j))
                open_dims = graph is not None and graph.rank is not None and \
                    not graph.is_fully_defined()
                claimed.append(tuple(graph.as_list()) if open_dims else spec.shape)
            self.new_shapes[r.record] = tuple(claimed)

    def _runs_with_new_shape(self, unit, ref, traced, shape) -> bool:
        """Whether `unit` may be skipped although its input `ref` has `shape`, not the traced
        one: the path runs its shape group's graph, which computes every shape constant of
        the unit from the shapes it holds (`ShapeGroup.computes_constants_of`), the group's
        members differ in those dimensions (`ShapeGroup.takes_shape`), and whatever the unit's
        Python read inside itself is a function of shapes (its constants carry it)."""
        path = self.iteration.path
        group = path.group
        if group is None or group.graph is None or path.graph is not group.graph or \
                not self.iteration.exe.takes_other_shapes or \
                self.view is not path.view or not group.takes_shape(ref, traced, shape) or \
                not group.computes_constants_of(unit):
            return False
        return all(r.record < unit.start or path.static.shape_function(r)
                   for r, _ in unit.reads if hasattr(r, "record"))

    def _changed_read(self, unit) -> Optional[Divergence]:
        """Why `unit` cannot be skipped as recorded: a value its Python read then is different
        now, or cannot be known without a fetch the graph lacks (logged, so the next graph has
        it). None if every read is the same."""
        generic = unit.start in self.generic_units
        late = self.shape_from is not None and unit.start >= self.shape_from
        for ref, value in unit.reads:
            if generic and getattr(ref, "record", -1) >= unit.start:
                continue  # a shape read inside the unit: its constants, the graph computes
            if late and getattr(ref, "record", -1) >= self.shape_from and \
                    self.iteration.path.static.shape_function(ref):
                continue  # a shape read past a feed of a new shape: the same
            current = self.iteration.unit_read(ref)
            if current is None:
                self.log_fetch(ref)
                return Divergence(user_line(), f"fetch of {ref!r}", "no fetch", self.pos,
                                  "value read by a unit that the graph does not fetch")
            if current is not UNSET and not _same_array(current, value):
                return Divergence(user_line(), _short(value), _short(current), self.pos,
                                  "a value the unit's Python read has changed")
        return None


UNSET = object()  # Iteration.unit_read: a feed the unit itself supplies (as recorded)


def _unknown_of(view, unit, unknown) -> tuple:
    """(the refs of `view.shapes_read_by(unit)` in `unknown`, the refs of `unknown` that
    `unit`'s records output), kept on the view per unit and graph's `unknown`: a gradient
    unit reads the shapes of hundreds of forward outputs, and a step on the same path and graph
    asks the same question again."""
    cache = view.__dict__.setdefault("_unknown_of", {})
    hit = cache.get(unit.start)
    if hit is not None and hit[0] is unknown and hit[1] is unit:
        return hit[2]
    out = (tuple(r for r in view.shapes_read_by(unit) if r in unknown),
           tuple(r for r in unknown if unit.start <= r.record < unit.end))
    cache[unit.start] = (unknown, unit, out)
    return out


def _same_array(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind in "biu":  # (integers, as shapes and indices are: equal values are equal
        return a.tobytes() == b.tobytes()  # bytes, without `array_equal`'s checks)
    return bool(np.array_equal(a, b))


def _short(value) -> str:
    return np.array2string(np.asarray(value), threshold=8)[:80]


def _guard_text(guard) -> str:
    """A unit guard for messages: objects by their name, not their repr."""
    return "(" + ", ".join(getattr(g, "__name__", None) or getattr(g, "name", None) or repr(g)
                           if not isinstance(g, (tuple, bool, type(None))) else repr(g)
                           for g in guard) + ")"
