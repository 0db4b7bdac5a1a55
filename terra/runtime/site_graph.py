"""One lowered graph for every compiled path of a site, driven by skip mode.

A `PathGraph` runs one straight-line trace: when Python takes another branch the session must
cancel the run, restore the variables and restart another graph. A `SiteGraph` merges the
representative traces of all compiled paths of the site into one TraceGraph and lowers it
(terra/compiler/lower.py: `switch_case` on Case-Select feeds, `while_loop` on Loop-Cond feeds),
so a branch Python takes costs a Case-Select put instead of a restart.

The Python side follows `terra.compiler.plan.plan` (docs/lowering.md, "The Python side"): per
path, the events (selects, loop conds, feeds) are precomputed with the record index `at` where
Python knows them. Skip mode matches ops against the predicted path as with a PathGraph; after
each matched record a `SiteRun` performs the events with `at` below the runner's position; the
events at the end are performed when the iteration finishes. Two paths whose records and events
agree before op k have put the same values into the graph: at a divergence at op k the session
swaps the plan and goes on without touching the run (`Session.case_switches`).

A shape group (shape_groups.py) is one path here: its relaxed trace is lowered once
(`lowered_as`, `site_paths`), each shape constant a feed; a member runs the group's plan and puts
its own constants (`member_constants`), which skip mode checked against its records, so the
member's shapes hold on every value. It runs only its traced lengths here: the constants a
group's own graph computes from shapes are put as the member traced them
(`Executable.takes_other_shapes`).

Live-outs (values the program keeps past the iteration) are fetch points at the end of the trace
(the lowered function returns nothing). A fetch channel receives one element per visit of its
node; a `SiteRun` counts what it took per channel, keeps the values of skipped elements (a later
read of an earlier visit finds them), and leaves the rest to the next reader (`SiteGraph.stale`,
as `PathGraph.stale`).
"""
from __future__ import annotations

import bisect
import time

import numpy as np
import tensorflow as tf

from tensorflow.core.protobuf import rewriter_config_pb2

from terra.compiler.plan import Planner
from terra.compiler.lower import FUSE_MAX_SHARED, lower
from terra.compiler.merge import merge
from terra.compiler.site_constants import feed_constants, varying_places
from terra.compiler.shapes import unknown_shapes
from terra.ir.records import Fetch, Trace
from terra.compiler.channels import Unread
from terra.config import CONFIG
from terra.runtime.executable import Executable, PathRun, token
from terra.runtime.fallback import Snapshot, written_variables
from terra.runtime.placeholders import Placeholder

__all__ = ["SiteGraph", "SitePlan", "SiteRun", "joined_order", "lowered_as", "site_paths",
           "site_trace"]


def lowered_as(path):
    """What a site graph lowers for compiled path `path`: the path itself, or, for a member of
    a shape group that runs the group's graph (shape_groups.py), the group's own path over its
    relaxed trace, shared by every member (each puts its own shape constants)."""
    g = path.group
    if g is not None and g.graph is not None and path.graph is g.graph and \
            g.path.view is not None:
        return g.path
    return path


def site_paths(site) -> list:
    """The paths a site graph of `site` lowers, in the site's order: each compiled path once,
    a shape group's members as their group's path (`lowered_as`)."""
    out, seen = [], set()
    for p in site.paths.values():
        if p.graph is None or p.stale or p.view is None:
            continue
        q = lowered_as(p)
        if id(q) not in seen:
            seen.add(id(q))
            out.append(q)
    return out


def site_trace(path) -> Trace:
    """The path's trace with its fetch points and live-outs as `Fetch` entries (what the site
    graph is lowered from; taken on the program's thread for a build on the builder's)."""
    t = path.trace
    n = len(t.records)
    fetches = {}
    for ref, after in path.fetch_points.items():
        fetches[ref] = Fetch(ref, max(after, ref.record + 1), "numpy")
    for ref in path.liveouts:
        if ref not in fetches:
            fetches[ref] = Fetch(ref, n, "liveout")
    ordered = sorted(fetches.values(), key=lambda f: (f.after_record, f.ref.record, f.ref.index))
    return Trace(t.site, list(t.records), list(t.feeds), list(t.feed_values), ordered,
                 dict(t.variables), list(t.unsupported), dict(t.functions),
                 list(t.unseeded_random), list(t.fast_fallbacks))


def joined_order(paths, previous: "SiteGraph | None") -> list:
    """`paths` with those of the site's last SiteGraph first, in its order, then the others as
    given: that graph's TraceGraph is then a prefix of the next one's, which extends it by the
    new paths' traces instead of merging every trace again (a path first seen early but
    compiled late came first in the site's order: on sdpoint 3 of 9 rebuilds merged all)."""
    if previous is None:
        return list(paths)
    rank = {id(p): k for k, p in enumerate(previous.paths)}
    return sorted(paths, key=lambda p: rank.get(id(p), len(rank)))


class SitePlan:
    """What skip mode does on one path of a SiteGraph.

    actions   (at, kind, channel, value) in Python's order; kind "put" puts `value`, kind "feed"
              puts the value Python supplied for feed slot `value`.
    sig       the events as comparable tuples (kind, key, value, at), same order.
    where     (record, output) -> (fetch key, visit) for every output whose node is fetched.
    visits    fetch key -> elements one run on this path enqueues (visits of the node).
    nodes     node id per record (two paths agree on a prefix only if it maps to the same nodes).

    `constants` ({slot: ConstRef}, compiler/site_constants.py): slots of `trace` that hold a
    constant of the path, which the plan puts itself ("put" actions; in `sig` by value, so two
    paths agree only where they put the same constants).
    """

    def __init__(self, lowered, trace: Trace, path, tid=None, constants=None):
        p = Planner(lowered, trace, tid=tid)  # (`tid`: the lowered graph's own trace `tid`)
        events = [ev for ev in p.run() if ev.kind != "get"]
        self.path = path
        self.source = path.graph  # (a shape group's path gets another when its group rebuilds)
        self.n = len(trace.records)
        self.liveouts = frozenset(path.liveouts)
        constants = constants or {}
        tensors = {slot: tf.constant(np.asarray(
            c.value, dtype=tf.as_dtype(c.dtype).as_numpy_dtype)) for slot, c in constants.items()}
        self.sig = [(ev.kind, ev.key, constants.get(ev.value, ev.value) if ev.kind == "feed"
                     else ev.value, ev.at) for ev in events]
        self.ats = [ev.at for ev in events]
        self.actions = []
        for ev in events:
            if ev.kind == "feed" and ev.value in tensors:
                self.actions.append((ev.at, "put", lowered.feeds[ev.key], tensors[ev.value]))
            elif ev.kind == "select":
                self.actions.append((ev.at, "put", lowered.case_selects[ev.key], ev.value))
            elif ev.kind == "cond":
                self.actions.append((ev.at, "put", lowered.loop_conds[ev.key], ev.value))
            else:
                self.actions.append((ev.at, "feed", lowered.feeds[ev.key], ev.value))
        self.nodes = [p.rec_node.get(r) for r in range(self.n)]
        self.where, self.visits = {}, {}
        for key in lowered.fetches:
            node = p.node.get(key[0])
            recs = sorted(node.seen.get(p.tid, ())) if node is not None else []
            self.visits[key] = len(recs)
            for visit, r in enumerate(recs):
                if key[1] < len(trace.records[r].outputs):
                    self.where[(r, key[1])] = (key, visit)
        self.first_record = {}
        for r, node in enumerate(self.nodes):
            self.first_record.setdefault(node, r)

    def count_before(self, pos: int) -> int:
        """How many events Python performs before matching record `pos`."""
        return bisect.bisect_left(self.ats, pos)

    def agrees(self, other: "SitePlan", pos: int) -> bool:
        """Both paths map records [0, pos) to the same nodes and put the same values so far."""
        k = self.count_before(pos)
        return k == other.count_before(pos) and self.sig[:k] == other.sig[:k] and \
            self.nodes[:pos] == other.nodes[:pos]


def _no_remapper(config) -> None:
    """Run a site graph without Grappler's remapper (mutates a ConfigProto).

    With it, TF aborted the process while instantiating the site graph of a residual CNN whose
    paths give a feature map different spatial sizes (benchmarks/programs/sdpoint.py, bench
    size): oneDNN's layout pass fails a CHECK (`d < dims()`) in `CalculateNodeMFlops`, called
    from `FusedConv2DRewrite`, reading a 4-D shape out of a rank-0 one. The `_FusedConv2D` nodes
    it rewrites are the remapper's (Conv2D + BiasAdd + activation), and so are the input-shape
    hints it reads; through the lowered `switch_case` those hints can lack the rank. Path graphs
    keep the remapper (tests/runtime/test_site_graph.py has the program, as a slow test)."""
    config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF


def _shapes_known(paths) -> bool:
    """Whether TF's shape inference fixes every shape of every path given its feeds' recorded
    shapes (skip mode checks those), so each value of the site graph has the shape recorded on
    the path that runs: the graph's unknown dimensions only relax shapes across paths and make
    no op fallible (compiler/commit.py)."""
    for p in paths:
        own = p.graph if p.graph is not None and p.graph.path is p else None
        if (own.unknown_shapes if own is not None else unknown_shapes(p.trace)):
            return False
    return True


class ReadAhead(Exception):
    """A path reads a value before it has matched the value's op (a coarse unit's Python
    reads a value the unit computes, at the unit's start), but the plan has an event due
    between the two (a Case-Select): the run would wait for that event, and Python for the
    value. Path graphs run it (their graphs need no event for it)."""


def _check_reads_ahead(path, plan) -> None:
    for ref, after in path.fetch_points.items():
        if after <= ref.record and plan.count_before(after) != plan.count_before(ref.record + 1):
            at = plan.ats[plan.count_before(after)]
            raise ReadAhead(f"path {_name(path)} reads %{ref.record} at op #{after}, inside a "
                            f"unit, before an event of the site graph due at op #{at}")


class SiteGraph:
    """The lowered graph of a site's compiled paths; `plans[id(path)]` drives one path."""

    run_config = staticmethod(_no_remapper)

    def __init__(self, paths, timed: bool = True, previous: "SiteGraph | None" = None,
                 traces=None, key=None, fuse: int = FUSE_MAX_SHARED):
        """`previous`: the site's last SiteGraph; when its paths (as they were) are the first of
        `paths`, its TraceGraph is extended with the new paths' traces instead of merging every
        trace again. `traces` and `key`: `site_trace` of each path and `key_of(paths)`, if
        taken already (a build on the builder thread takes them when it is submitted).
        `fuse`: `lower`'s switch-case fusion limit (0: none; benchmarks compare)."""
        t0 = time.perf_counter()
        self.paths = list(paths)
        self.built_for = key if key is not None else self.key_of(self.paths)
        if traces is None:
            traces = [site_trace(p) for p in self.paths]
        # the paths' traces, then with their constants that vary between paths fed
        self.source_traces, self.places = list(traces), varying_places(traces)
        old = previous.built_for if previous is not None else ()
        if old and self.built_for[:len(old)] == old and self.places == previous.places:
            fed, puts = feed_constants(traces[len(old):], self.places)
            traces, puts = previous.traces + fed, previous.puts + puts
            g, start = previous.lowered.graph, len(old)
        else:
            (traces, puts), g, start = feed_constants(traces, self.places), None, 0
        for t in traces[start:]:
            g = merge(g, t)
        self.traces, self.puts = traces, puts
        self.merged_traces = len(traces) - start  # (tests: what a rebuild merged)
        self.lowered = lower(g, traces, timed=timed, commit=CONFIG.commit_writes,
                             shapes_known=CONFIG.commit_writes and _shapes_known(self.paths),
                             fuse=fuse)
        self.concrete = self.lowered.function
        self.plans = {id(p): SitePlan(self.lowered, t, p, tid=k, constants=puts[k])
                      for k, (p, t) in enumerate(zip(self.paths, traces))}
        for p in self.paths:
            _check_reads_ahead(p, self.plans[id(p)])
        variables, seen = [], set()
        for p in self.paths:
            for v in written_variables(p.trace):
                if id(v) not in seen:
                    seen.add(id(v))
                    variables.append(v)
        self.snapshot = Snapshot.of(variables)
        # fetch key -> elements finished iterations left unread (the next reader skips them)
        self.stale = Unread(self.lowered.fetches)
        self.build_seconds = time.perf_counter() - t0

    @staticmethod
    def key_of(paths) -> tuple:
        """What the graph depends on: each path with its own graph (a shape group's path gets a
        new one when a member relaxes its trace beyond what the group's graph takes), live-outs
        and fetch points as they were. A member that joins a group's graph with no build
        (`ShapeGroup.speculative`, `covers_open`) needs no new site graph either: the site
        graph lowers the same records, and its inference leaves open every dimension the
        group's graph leaves open (its values' shapes are the records', merged across paths)."""
        return tuple((id(p), id(p.graph), frozenset(p.liveouts), frozenset(p.fetch_points))
                     for p in paths)

    def plan_of(self, path):
        """The plan that runs `path`: its own, or its shape group's (`lowered_as`) as lowered
        here (None if the group's graph was rebuilt since)."""
        q = lowered_as(path)
        plan = self.plans.get(id(q))
        return plan if plan is not None and plan.source is q.graph else None

    def drain(self, fetched=None) -> None:
        """Empty every channel (no run of this graph pending or running)."""
        self.lowered.drain()
        self.stale.clear()

    def drop_stale(self, now: bool = False, outputs=None) -> None:
        """As `PathGraph.drop_stale`."""
        if now:
            self.stale.drop()
        else:
            self.stale.collected()

    @property
    def stall_seconds(self) -> float:
        return sum(ch.stall_seconds for ch in self.lowered.feed_channels())

    def describe(self) -> str:
        s = self.lowered.stats
        return (f"{len(self.paths)} paths (" + ", ".join(_name(p) for p in self.paths) +
                f"), {s.get('tf_ops', '?')} TF ops, {s.get('switch_case_ops', 0)} switch_case, "
                f"{s.get('while_ops', 0)} while, {len(self.lowered.feeds)} feeds, "
                f"{len(self.lowered.case_selects)} case selects, "
                f"{len(self.lowered.loop_conds)} loop conds, {len(self.lowered.fetches)} fetches")


class SiteRun(Executable):
    """One iteration's Python side on a SiteGraph: events performed, elements taken (an
    `Executable`, terra/runtime/executable.py)."""

    def __init__(self, graph: SiteGraph, plan: SitePlan, runner, path=None):
        self.graph, self.plan, self.runner = graph, plan, runner
        # the path Python is on: a shape group's member runs its group's plan and puts its own
        # shape constants (slot -> tensor), which no op of Python feeds
        self.member = plan.path if path is None else path
        self.constants = member_constants(self.member) if self.member is not plan.path else {}
        self.done = 0          # events of `plan` performed
        self.taken: dict = {}  # fetch key -> elements taken this iteration
        self.values: dict = {}  # (fetch key, visit) -> value taken
        self.advance = self._advance
        self.put_any = False    # the commit token was put
        self.due = self._due()  # `at` of the next event: `advance` below it has nothing to do

    @property
    def commits(self) -> bool:
        return self.graph.lowered.commit_channel is not None

    def put_commit(self) -> None:
        self.put_any = True
        self.graph.lowered.commit_channel.put(token())

    def needs_commit(self, ref) -> bool:
        where = self.plan.where.get((ref.record, ref.index))
        return where is not None and where[0] in self.graph.lowered.commit_dependent

    @property
    def snapshot(self):
        return self.graph.snapshot

    @property
    def liveouts(self):
        return self.plan.liveouts

    def put_feed(self, slot, value) -> bool:
        return False  # put by the plan's events (`advance`)

    def queued(self, runner) -> bool:
        # lazy mode: nothing ran, but what Python put is queued (the next path would dequeue it)
        return bool(runner.fed) or bool(self.done) or self.put_any

    def starts_early(self) -> bool:
        return True

    def early_liveout(self, ref, fetched, outputs, fetch, timeout):
        """This iteration's elements precede those of later runs in the channel, and what it
        takes now is counted for its collection."""
        if ref not in self.plan.liveouts or not self.fetchable(ref):
            return None
        return self.fetch(fetch, ref, timeout)

    def seamless_switch(self, path, pos) -> bool:
        plan = self.graph.plan_of(path)
        if plan is not None and self.done == self.plan.count_before(pos) and \
                self.plan.agrees(plan, pos):
            constants = member_constants(path) if path is not plan.path else {}
            if not self._same_constants_put(constants):
                return False
            self.plan, self.member, self.constants = plan, path, constants
            self.due = self._due()
            return True
        return False

    def _same_constants_put(self, constants) -> bool:
        """Whether the shape constants put so far are those `constants` (another member's)
        would have put: two members of a group agree on their records up to a divergence, so
        up to it on the constants they consumed, but a constant is put where Python knows it,
        which the plan may place before its consumer."""
        for _, kind, _, slot in self.plan.actions[:self.done]:
            if kind == "feed" and slot in self.constants:
                other = constants.get(slot)
                if other is None or not np.array_equal(other.numpy(),
                                                       self.constants[slot].numpy()):
                    return False
        return True

    def on_path(self, path, runner) -> Executable:
        plan = self.graph.plan_of(path)
        return SiteRun(self.graph, plan, runner, path) if plan is not None else PathRun(path)

    def replay_puts(self, runner, pos, put_feed) -> None:
        self.advance(pos)

    def outputs(self, result, fetch) -> dict:
        """Live-out values of a finished run (taken from their fetch channels)."""
        out = {}
        for ref in self.plan.liveouts:
            if self.fetchable(ref):
                out[ref] = self.fetch(fetch, ref, CONFIG.timeout_s)
        self.leave_unread_plan()
        return out

    def record_of(self, index):
        return self.plan.first_record.get(index)  # site-graph ops are named by node id

    def _due(self) -> int:
        actions = self.plan.actions
        return actions[self.done][0] if self.done < len(actions) else 1 << 62

    def _advance(self, pos: int) -> bool:
        """Perform the events Python knows once records [0, pos) are matched. False if a feed
        slot's value is not known yet (the event waits for the next call). Called after every
        matched op: most calls find no event due."""
        if pos <= self.due:
            return True
        actions, i, fed = self.plan.actions, self.done, self.runner.fed
        n = len(actions)
        while i < n:
            at, kind, ch, value = actions[i]
            if at >= pos:
                break
            if kind == "feed":
                constant = self.constants.get(value)
                if constant is not None:
                    ch.put(constant)
                    i += 1
                    continue
                if value not in fed:
                    self.done = i
                    self.due = at
                    return False
                value = fed[value]
                if isinstance(value, Placeholder):
                    value = value._terra_materialize()
            ch.put(value)
            i += 1
        self.done = i
        self.due = actions[i][0] if i < n else 1 << 62
        return True

    def finish(self) -> bool:
        """Perform the events at the end of the iteration; False if some could not be."""
        return self._advance(self.plan.n + 1) and self.done == len(self.plan.actions)

    def fetchable(self, ref) -> bool:
        return (ref.record, ref.index) in self.plan.where

    def static_shape(self, ref):
        # the path's own graph (every path of a site graph has one) infers its shapes from the
        # path's feed signature, which skip mode checks; a shape group's member claims its own
        # recorded shapes (the group's graph relaxes them)
        if self.member is not self.plan.path:
            return self.member.group.static_shape(self.member, ref)
        graph = self.plan.path.graph
        return None if graph is None else graph.shapes.get(ref)

    def unknown_shapes(self) -> frozenset:
        graph = self.plan.path.graph
        return frozenset() if graph is None else graph.unknown_shapes

    def fetch(self, fetch, ref, timeout):
        """Value of output `ref` of this iteration; `fetch(channel, timeout)` takes an element."""
        key, visit = self.plan.where[(ref.record, ref.index)]
        v = self.values.get((key, visit))
        if v is not None:
            return v
        ch = self.graph.lowered.fetches[key]
        for _ in range(self.graph.stale.pop(key, 0)):  # earlier iterations' unread elements
            fetch(ch, timeout)
        taken = self.taken.get(key, 0)
        while taken <= visit:
            v = fetch(ch, timeout)
            self.values[(key, taken)] = v
            taken += 1
            self.taken[key] = taken
        return self.values[(key, visit)]

    def leave_unread_plan(self) -> None:
        """The run enqueues one element per visit: what this iteration did not take is skipped
        by the next reader of the channel."""
        stale = self.graph.stale
        for key, n in self.plan.visits.items():
            left = n - self.taken.get(key, 0)
            if left > 0:
                stale[key] = stale.get(key, 0) + left
        self.taken = {key: n for key, n in self.plan.visits.items()}


def _name(path) -> str:
    """A lowered path for explain(): `p3`, or a shape group's path as `g1 (p2+p5)`."""
    group = path.__dict__.get("group_of")
    if group is None:
        return f"p{path.id}"
    return f"g{group.id} (" + "+".join(f"p{m.id}" for m in group.members) + ")"


def member_constants(path) -> dict:
    """`{slot: tensor}` of the shape constants shape-group member `path` puts on a site graph
    (its `group_values`, made tensors once per set of values)."""
    cached = path.__dict__.get("_site_constants")
    if cached is None or cached[0] is not path.group_values:
        cached = path.__dict__["_site_constants"] = (
            path.group_values, {slot: tf.constant(v) for slot, v in path.group_values.items()})
    return cached[1]
