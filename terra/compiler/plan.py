"""What the Python side of one iteration does on a lowered graph, in Python's order.

    events = plan(lowered, trace)

`trace` is the trace of one iteration. `Planner` finds it in the graph (by merging it: a covered
trace maps every record to a node), then walks it the way the PythonRunner does: at each record,
first the fetches Python reads before issuing it, then the choices it now knows (Case-Select of
every switch-case up to the record's node, Loop-Cond True when an iteration starts), then the
record's feeds. Choices that only become known when something after them happens (a default
branch once a path has ended, Loop-Cond False after the last iteration) are put at the next record,
or at the end. Python never puts a value before it could know it, and reads a fetch exactly when
the program did. The site graph (terra/runtime/site_graph.py) runs on these plans; the test
driver (tests/compiler/driver.py) plays them against a running graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from terra.compiler.case_assignment import path_choices
from terra.compiler.lower import TOP, Lowered
from terra.ir.records import FeedRef, Trace
from terra.ir.trace_graph import LOOP

__all__ = ["Event", "Planner", "plan"]

_PENDING = None


@dataclass(slots=True)
class Event:
    """One Python-side action. kind: "select" (key (level, k), value case index), "cond" (key
    loop node, value bool), "feed" (key (node, position), value: feed slot), "get" (key
    (node, output index), value: visit number; `ref` = (record, index) read), "record" (no-op
    marker: Python issued record `at`). `at`: the record index when Python knows / does it."""
    kind: str
    key: object
    value: object
    at: Optional[int]
    ref: object = None

    def __repr__(self) -> str:
        return f"{self.kind}({self.key!r}={self.value!r} @{self.at})"


# ---------------------------------------------------------------------------------------- plan
class Planner:
    """Walks one trace through a lowered graph (see the module docstring); `run()` returns
    the Events."""

    def __init__(self, lowered: Lowered, trace: Trace, merged=None, tid=None):
        """`tid`: `trace` is the graph's own trace `tid` (its records' nodes are known: no
        merge); else it is merged in as a new trace (`merged`, if already done)."""
        if tid is not None:
            g = lowered.graph
        else:
            g = merged if merged is not None else lowered.match(trace)
        if g is None:
            raise ValueError(f"drive: trace {trace.site!r} ({len(trace)} ops) is not covered by "
                             f"the lowered graph")
        self.lw, self.trace = lowered, trace
        self.tid = lowered.graph.num_traces if tid is None else tid
        self.node, self.level_of, self.levels = {}, {}, {TOP: g}
        self.rec_node, self.visit_starts = {}, {}
        self._index(TOP, g)
        self.events = []

    def _index(self, lid, g):
        for n in g.op_nodes:
            self.node[n.id], self.level_of[n.id] = n, lid
            idxs = n.seen.get(self.tid, ())
            if n.kind == LOOP:
                self.levels[n.id] = n.loop.body
                self.visit_starts[n.id] = list(idxs)
                self._index(n.id, n.loop.body)
            else:
                for r in idxs:
                    self.rec_node[r] = n.id

    def owner(self, r, lid):
        n = self.rec_node[r]
        while self.level_of[n] != lid:
            n = self.level_of[n]
        return n

    def add(self, kind, key, value, at, ref=None):
        self.events.append(Event(kind, key, value, at, ref))

    # ---- walk
    def level(self, lid, recs):
        items, i = [], 0
        while i < len(recs):
            n = self.owner(recs[i], lid)
            j = i + 1
            if self.node[n].kind == LOOP:
                starts = self.visit_starts[n]
                while j < len(recs) and self.owner(recs[j], lid) == n and recs[j] not in starts:
                    j += 1
            items.append((n, recs[i:j]))
            i = j
        g = self.levels[lid]
        lp = self.lw.levels[lid]
        choices = path_choices(lp.switch_cases, (g.start,) + tuple(n for n, _ in items) + (g.end,))
        nxt = 0
        for n, rs in items:
            self.add("record", None, None, rs[0])
            k = lp.switch_case_of[n]
            self.decide(lid, lp, choices, nxt, k + 1, rs[0])
            nxt = k + 1
            if self.node[n].kind == LOOP:
                self.loop(n, rs)
            else:
                self.feeds(n, rs[0])
        self.decide(lid, lp, choices, nxt, len(lp.switch_cases), _PENDING)

    def decide(self, lid, lp, choices, a, b, at):
        derived = self.lw.derived_selects
        for k in range(a, b):
            if lp.has_op[k] and (lid, k) not in derived:  # (a derived one follows in the graph)
                self.add("select", (lid, k), choices[k], at)

    def feeds(self, n, r):
        rec = self.trace.records[r]
        for fp in self.lw.feed_points.get(n, ()):
            ref = rec.inputs[fp.position[0]]
            if len(fp.position) == 2:
                ref = ref[fp.position[1]]
            if not isinstance(ref, FeedRef):
                raise ValueError(f"drive: record %{r} input {fp.position} is {ref!r}, not a feed")
            self.add("feed", (n, fp.position), ref.slot, r)

    def loop(self, n, rs):
        node = self.node[n]
        visit = self.visit_starts[n].index(rs[0])
        trips = node.loop.trip_counts[self.tid][visit]
        for fp in self.lw.feed_points.get(n, ()):  # Carried inits fed at the loop
            _, consumer, pos = fp.position  # (the slot its first read records: the trace's own)
            first = next(r for r in rs if self.rec_node.get(r) == consumer)
            ref = self.trace.records[first].inputs[pos[0]]
            ref = ref[pos[1]] if len(pos) == 2 else ref
            if not isinstance(ref, FeedRef):
                raise ValueError(f"drive: record %{first} input {pos} is {ref!r}, not a feed")
            self.add("feed", (n, fp.position), ref.slot, rs[0])
        depth, loop_id = len(node.loop.key[1]), node.loop.key[0]
        groups = {}
        for r in rs:
            it = self.trace.records[r].location.loops[depth]
            if it.loop != loop_id:
                raise ValueError(f"drive: record %{r} is not in loop {loop_id}")
            groups.setdefault(it.iteration, []).append(r)
        unrolled = n in self.lw.unrolled
        for k in range(trips):
            its = groups.get(k, [])
            if not unrolled:
                self.add("cond", n, True, its[0] if its else _PENDING)
            self.level(n, its)
        if not unrolled:
            self.add("cond", n, False, _PENDING)

    def run(self):
        n_rec = len(self.trace.records)
        self.level(TOP, list(range(n_rec)))
        nxt = n_rec
        for ev in reversed(self.events):  # pending choices: known at the next record (or end)
            if ev.at is _PENDING:
                ev.at = nxt
            nxt = ev.at
        ats = [ev.at for ev in self.events]
        if ats != sorted(ats):
            raise AssertionError(f"drive: events out of Python order: {self.events}")
        visits = {}
        gets = []
        for f in self.trace.fetches:
            node = self.rec_node[f.ref.record]
            order = sorted(self.node[node].seen[self.tid])
            gets.append(Event("get", (node, f.ref.index), order.index(f.ref.record),
                              f.after_record, (f.ref.record, f.ref.index)))
        merged = sorted([(ev.at, 1, i, ev) for i, ev in enumerate(self.events)]
                        + [(ev.at, 0, i, ev) for i, ev in enumerate(gets)], key=lambda x: x[:3])
        del visits
        return [ev for *_, ev in merged if ev.kind != "record"]


def plan(lowered: Lowered, trace: Trace, merged=None, tid=None) -> list:
    """The Python side of one iteration as a list of Events, in the order Python performs them.
    `merged`: `lowered.match(trace)` if already computed (saves a merge); `tid`: `trace` is the
    lowered graph's trace `tid`."""
    return Planner(lowered, trace, merged, tid).run()


