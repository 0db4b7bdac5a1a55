"""Sites and paths: what a trace is filed under (its path signature), paths over new
variable objects, and what keeps a trace from being compiled. Generalizing changed constants
into feeds is generalize.py's job; when a path is built and when a site gives up, policy.py's."""
from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass, field
import functools
from typing import TYPE_CHECKING

from terra import _tf_private as tfp
from terra.ir.op_kinds import DATA_DEPENDENT_SHAPE_OPS, HOST_OPS, makes_data_pipeline
from terra.ir.records import FeedRef, OutputRef, TensorSpec, Trace, VariableRef, replace
from terra.runtime.fallback import Snapshot, unsnapshotable
from terra.runtime.python_runner import PythonRunner
from terra.runtime.site_graph import SiteGraph
from terra.runtime.static_values import StaticValues

if TYPE_CHECKING:
    from terra.runtime.path_graph import PathGraph


# ------------------------------------------------------------------------------------ data
def _rec_sig(rec):
    # (outputs last: `switch_signature` relaxes them)
    return (rec.op_type, rec.attrs, rec.inputs, rec.route == "function", rec.function,
            rec.recorded, rec.outputs)


def path_signature(trace: Trace, units: dict) -> tuple:
    """What two traces must share to run on one generated graph."""
    return (tuple(_rec_sig(r) for r in trace.records),
            tuple(f.spec for f in trace.feeds),
            tuple(sorted((u.start, u.end) for u in units.values())))


def variable_renaming(base: Trace, new: Trace) -> dict | None:
    """`{base key: new key}` if `new` is `base` over other variable objects of the same dtypes
    and shapes (a metric or a model made anew each epoch) and otherwise equal, record for record:
    `new` may then run `base`'s graph with its own variables' handles. Resources that only host
    ops take (a data iterator) may differ too and are left out. None otherwise, or when the
    traces are the same."""
    if len(base.records) != len(new.records) or \
            [f.spec for f in base.feeds] != [f.spec for f in new.feeds]:
        return None
    forward, backward = {}, {}

    def same(a, b) -> bool:
        if isinstance(a, VariableRef) and isinstance(b, VariableRef):
            return forward.setdefault(a.key, b.key) == b.key and \
                backward.setdefault(b.key, a.key) == a.key
        if isinstance(a, tuple) and isinstance(b, tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    for rb, rn in zip(base.records, new.records):
        if (rb.op_type, rb.attrs, rb.route, rb.function, rb.outputs) != \
                (rn.op_type, rn.attrs, rn.route, rn.function, rn.outputs) or \
                len(rb.inputs) != len(rn.inputs) or \
                not all(same(a, b) for a, b in zip(rb.inputs, rn.inputs)):
            return None
    renamed = {a: b for a, b in forward.items() if a != b}
    if not renamed:
        return None
    # a resource only host ops take (a new data iterator every epoch) is not in the graph
    in_graph = {r.key for rec in base.records if rec.op_type not in HOST_OPS
                for r in rec.input_refs() if isinstance(r, VariableRef)}
    renaming = {}
    for a, b in renamed.items():
        if a not in in_graph:
            continue
        va, vb = base.variables.get(a), new.variables.get(b)
        if not (isinstance(va, tfp.BaseResourceVariable) and isinstance(vb, tfp.BaseResourceVariable)
                and va.dtype == vb.dtype and va.shape == vb.shape):
            return None
        renaming[a] = b
    return renaming


def renamed_path(path: Path, new_variables: dict, id: int) -> Path:
    """`path` over other variable objects (`new_variables`: old key -> variable of the same dtype
    and shape, `VariableRoles.superseding`): the same records, units and fetches, with every
    reference to a renamed variable pointing at the new one. It has no graph of its own yet
    (`Builds.reuse` binds the old path's)."""
    keys = {k: id_of_handle(v) for k, v in new_variables.items()}

    def ren(x):
        if isinstance(x, VariableRef):
            return VariableRef(keys[x.key]) if x.key in keys else x
        if isinstance(x, tuple) and x:
            y = tuple(ren(e) for e in x)
            return x if all(a is b for a, b in zip(x, y)) else y
        return x

    t = path.trace
    records = [r if (i := ren(r.inputs)) is r.inputs else replace(r, inputs=i) for r in t.records]
    variables = {k: v for k, v in t.variables.items() if k not in keys}
    variables.update((keys[k], v) for k, v in new_variables.items())
    trace = Trace(t.site, records, list(t.feeds), list(t.feed_values), list(t.fetches), variables,
                  list(t.unsupported), dict(t.functions), list(t.unseeded_random),
                  list(t.fast_fallbacks))
    units = {s: replace(u, guard=ren(u.guard), result=ren(u.result), reads=ren(u.reads))
             for s, u in path.units.items() if not _names_old_object(u, t, keys)}
    return Path(path_signature(trace, units), trace, units, id=id, count=path.count,
                liveouts=set(path.liveouts), fetch_points=dict(path.fetch_points),
                outside_reads=set(path.outside_reads), verified=set(path.verified), by_role=True,
                first_seen=path.first_seen, last_seen=path.last_seen)


def _names_old_object(unit, trace: Trace, renamed) -> bool:
    """Whether `unit` is a call of an object (its guard starts with the object's id) whose
    records use a variable in `renamed` that its guard does not name: on the renamed path the
    new variables belong to another object, and a call of the old one would pass the guard and
    run the graph over the new variables (a layer made anew every epoch while the previous one
    is still trained). Such a unit is left out there: its ops are matched one by one."""
    if type(unit.guard[0]) is not int:
        return False
    named, stack = set(), list(unit.guard[2:])
    while stack:
        g = stack.pop()
        if isinstance(g, VariableRef):
            named.add(g.key)
        elif isinstance(g, tuple):
            stack.extend(g)
    return any(isinstance(r, VariableRef) and r.key in renamed and r.key not in named
               for i in range(unit.start, unit.end) for r in trace.records[i].input_refs())


def id_of_handle(variable) -> int:
    """A variable's key in `Trace.variables` (the identity of its resource handle)."""
    return id(variable.handle)


def _relaxed(spec, shape):
    if shape is None or shape.rank is None or shape.is_fully_defined():
        return spec
    return TensorSpec(spec.dtype, tuple(shape.as_list()))


@dataclass(eq=False)
class Path:
    signature: tuple
    trace: Trace
    units: dict
    liveouts: set = field(default_factory=set)
    fetch_points: dict = field(default_factory=dict)   # OutputRef -> earliest after_record
    outside_reads: set = field(default_factory=set)  # refs read outside coarse units
    # OutputRef -> earliest after_record of a `shape` read outside units: fetched where the
    # graph leaves that shape open (path_graph.py `_shape_reads`)
    shape_reads: dict = field(default_factory=dict)
    count: int = 0
    hits: int = 0
    graph: PathGraph | None = None
    built_for: tuple = ()
    view: PythonRunner | None = None
    snapshot: Snapshot | None = None
    id: int = 0
    verified: set = field(default_factory=set)   # units whose feeds were seen identical twice
    rebound: object = None   # the call of a shared graph over this path's variables (bind)
    group: object = None     # the ShapeGroup whose graph it runs (shape_groups.py)
    group_values: dict = field(default_factory=dict)  # its shape constants: slot -> value
    group_tensors: tuple = ()   # the same, as tensors in the order of its graph's bundle
    roles_seen: int = -1     # `VariableRoles.seq` when its variables were last checked for newer
    by_role: bool = False    # made by `renamed_path` (dropped once its variables are made anew)
    parent: "Path | None" = None  # the path by role it was renamed from
    late: bool = False       # first seen after the site had a graph (`policy.late_once`)
    first_seen: int = 0      # the iteration that first filed it (or the path it was made from)
    last_seen: int = 0       # the iteration that last filed it
    built_count: int = 0     # its sightings when its own graph was first installed (1: at first sight)
    first_hit: int | None = None  # the first iteration its graph served
    # eager twins' values a read found without their eager value: the graph fetches these after
    # all (`skip_fetch_points`)
    twin_misses: set = field(default_factory=set)

    @functools.cached_property
    def static(self) -> StaticValues:
        return StaticValues(self.trace, unknown=lambda: getattr(self.graph, "unknown_shapes",
                                                                None))

    @functools.cached_property
    def early_feed(self) -> bool:
        """The path's first feed comes within its first few ops (then its run starts there)."""
        return any(isinstance(r, FeedRef) for rec in self.trace.records[:16]
                   for r in rec.input_refs())

    def switch_signature(self) -> tuple:
        """The record signatures a path switch compares (`Iteration.switch`), with each output's
        shape as the path's graph infers it: two paths that differ only in the length of a
        data-dependent output (`tf.where` kept 2 values when one was traced, 3 for the other)
        agree up to the op whose recorded ops depend on that length."""
        graph = self.graph
        cached = self.__dict__.get("_switch_sig")
        if cached is not None and cached[0] is graph:
            return cached[1]
        shapes = graph.shapes if graph is not None else {}
        if self.group is not None:  # a member knows every relaxed shape: its own
            shapes = {r: shapes[r] for r in self.group.unknown if r in shapes}
        sig = []
        for i, s in enumerate(self.signature[0]):
            outs = tuple(_relaxed(o, shapes.get(OutputRef(i, j))) for j, o in enumerate(s[-1]))
            sig.append(s if outs == s[-1] else s[:-1] + (outs,))
        sig = tuple(sig)
        self.__dict__["_switch_sig"] = (graph, sig)
        return sig

    def why_uncompilable(self) -> str | None:
        """`uncompilable(self.trace, self.units)`, kept while both stay the same objects (a new
        trace is filed against every path of its site)."""
        key = (id(self.trace), id(self.units))
        cached = self.__dict__.get("_why")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_why"] = (key, uncompilable(self.trace, self.units))
        return cached[1]

    def usable_units(self) -> dict:
        return {s: u for s, u in self.units.items() if not u.feeds or s in self.verified}

    def absorb(self, trace: Trace, liveouts, fetches, seen_objects=None, shape_reads=None) -> None:
        for u in self.units.values():  # unit feeds must be the very same (cached) tensors
            if u.start not in self.verified and (self.count and all(
                    trace.feed_values[sl] is self.trace.feed_values[sl] for sl in u.feeds) or
                    seen_objects is not None and all(
                    seen_objects.get(id(trace.feed_values[sl])) is trace.feed_values[sl]
                    for sl in u.feeds)):
                self.verified.add(u.start)
                self.view = None
        self.count += 1
        self.liveouts |= set(liveouts)
        for f in fetches:
            if f.ref.record < len(self.trace.records):
                prev = self.fetch_points.get(f.ref)
                self.fetch_points[f.ref] = f.after_record if prev is None else min(prev, f.after_record)
                if not f.in_unit:
                    self.outside_reads.add(f.ref)
        for ref, after in (shape_reads or {}).items():
            if ref.record < len(self.trace.records):
                prev = self.shape_reads.get(ref)
                self.shape_reads[ref] = after if prev is None else min(prev, after)

    def absorb_fetch(self, ref, after_record: int) -> None:
        """A value Python read outside units, in an iteration that fell back at that read.

        The same output of every other op issued from the same place (equal `Location.site`:
        the other passes of a Python loop) is fetched too, right after its op: a loop that
        reads a value in one pass reads it in every pass, and learning those reads one fallback
        and one rebuild at a time would cost a fallback per pass. Tracing cannot see such reads
        beforehand when NumPy takes a tensor through the buffer protocol (`np.squeeze(t)` calls
        no Python method of the tensor); skip mode sees them on its placeholders."""
        self._add_fetch(ref, after_record)
        records = self.trace.records
        read = records[ref.record]
        where = read.location.site
        for rec in records:
            if rec.index != ref.record and rec.op_type == read.op_type and \
                    ref.index < len(rec.outputs) and rec.location.site == where:
                self._add_fetch(OutputRef(rec.index, ref.index), rec.index + 1)

    def _add_fetch(self, ref, after_record: int) -> None:
        prev = self.fetch_points.get(ref)
        self.fetch_points[ref] = after_record if prev is None else min(prev, after_record)
        self.outside_reads.add(ref)

    def wanted(self) -> frozenset:
        """Values of the path the program holds after its iterations or reads outside units."""
        return frozenset(self.liveouts) | frozenset(self.outside_reads)

    @property
    def stale(self) -> bool:
        return self.graph is None or self.built_for != self.build_key()

    def build_key(self) -> tuple:
        """What the path's graph depends on beyond its trace."""
        return (frozenset(self.liveouts), frozenset(self.fetch_points),
                frozenset(self.outside_reads), frozenset(self.twin_misses))


# A site whose compiled iterations started on a wrong path at least HOLD_MISSES times in the latest
# HOLD_WINDOW holds each run until its path is certain (`Site.holds_runs`).
HOLD_WINDOW = 8
# the longest run of latest paths whose successors predict the next one (Site.likely_next)
PREDICT_ORDER = 6
PREDICT_MARGIN = 2   # how many more right predictions a longer run needs to take over
HOLD_MISSES = 4


@dataclass(eq=False)
class Site:
    key: tuple
    label: str
    paths: dict = field(default_factory=dict)
    traces: int = 0
    fallbacks: int = 0
    builds: int = 0                       # graph builds of its paths (rebuilds included)
    known_fallbacks: int = 0              # rare ones onto a filed path: not held against the site
    last_fallback: int = 0                # iteration number of the latest fallback
    eager_reason: str | None = None
    last_path: Path | None = None
    prev_path: Path | None = None         # the path the previous iteration ended on
    # the ids of the paths the latest iterations ended on (oldest first), and for each run of
    # up to PREDICT_ORDER consecutive ones seen: {id of the path that came next: count}
    history: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=PREDICT_ORDER))
    successors: dict = field(default_factory=dict)
    order_hits: dict = field(default_factory=dict)   # run length -> next paths it predicted
    path_ids: int = 0                     # ids handed out (paths over old objects may be dropped)
    # what the filing of an iteration no next one was known to follow left for the site's next
    # iteration to do first (filing.Filing.file, `last`): its builds and decisions, each a
    # callable given the number of the iteration that performs it
    deferred: list = field(default_factory=list)

    def new_path_id(self) -> int:
        self.path_ids += 1
        return self.path_ids - 1

    def note_path(self, path) -> None:
        """The iteration that just ended ran `path`: score each run length's prediction of it
        (`order_hits`), and count it as the successor of each run of latest paths (the previous
        one, the previous two, ...)."""
        hist = tuple(self.history)
        for k in range(1, len(hist) + 1):
            nxt = self.successors.get(hist[-k:])
            if nxt and max(nxt, key=nxt.get) == path.id:
                self.order_hits[k] = self.order_hits.get(k, 0) + 1
            nxt = self.successors.setdefault(hist[-k:], {})
            nxt[path.id] = nxt.get(path.id, 0) + 1
        self.history.append(path.id)
        self.prev_path = path

    def likely_next(self) -> list:
        """Path ids, most likely next first: the successors of the run of latest paths whose
        length has predicted best so far, then those of shorter runs. The previous path alone
        is the default; a longer run takes over only once it has predicted more than
        PREDICT_MARGIN iterations more: a program whose paths repeat in a period (a GAN's
        critic steps, then one that goes on to the generator's: p1 p1 p3 p1 p1 p3), where the
        previous path alone always says p1. A random branch gives longer runs no such lead."""
        hist = tuple(self.history)
        best = 1
        for k in range(2, len(hist) + 1):
            if self.order_hits.get(k, 0) > self.order_hits.get(best, 0) + PREDICT_MARGIN:
                best = k
        out, seen = [], set()
        for k in range(min(best, len(hist)), 0, -1):
            nxt = self.successors.get(hist[-k:])
            for i in sorted(nxt or (), key=lambda i: -nxt[i]):
                if i not in seen:
                    seen.add(i)
                    out.append(i)
        return out

    def predict(self) -> Path | None:
        """The compiled path the next iteration most likely takes: the previous path's most
        frequent compiled successor (a read every tenth step, an epoch's end, a rare branch are
        followed by the common path again), else the last compiled path run, else the newest
        compiled path; None while no path is compiled."""
        by_id = None
        for i in self.likely_next():
            if by_id is None:
                by_id = {q.id: q for q in self.paths.values()}
            q = by_id.get(i)
            if q is not None and q.graph is not None and not q.stale:
                return q
        p = self.last_path
        if p is not None and p.graph is not None and not p.stale:
            return p
        for p in reversed(list(self.paths.values())):
            if p.graph is not None and not p.stale:
                return p
        return None
    phase: str = "tracing"
    seen_objects: dict = field(default_factory=dict)
    site_graph: SiteGraph | None = None   # one graph for all compiled paths (>= 2 of them)
    shape_groups: list = field(default_factory=list)  # paths that share a graph (shape_groups.py)
    site_graph_failed: tuple | None = None  # SiteGraph.key_of the paths whose lowering failed
    read_restarts: int = 0   # restarts that cancelled a run Python had read values of
    read_restart_s: float = 0.0  # the time Python had waited for those values
    wants_site_graph: bool = False  # site_graph="auto" chose a site graph (policy.py)
    # since the last site graph was put in place: restarts after a read that involved a path
    # outside it, and the graph time they threw away (policy.rebuilds_site_graph)
    outside_restarts: int = 0
    outside_restart_s: float = 0.0
    site_graph_kept: tuple | None = None  # SiteGraph.key_of the paths it was not rebuilt for
    caller_step_try: bool = False   # called inside a per-step try of the program (PathView)
    # whether each of the latest compiled iterations had to leave the path it started on
    misses: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HOLD_WINDOW))
    _hold_points: tuple = (None, None)   # (compiled paths, {path id: hold point})

    def holds_runs(self) -> bool:
        """Start runs only where the path is certain (`hold_point`): most recent compiled
        iterations started on a wrong path (a branch Python draws at random), and a restart
        (cancel, wait for the runs before, restore the variables) costs more than the overlap
        an early start gains."""
        return sum(self.misses) >= HOLD_MISSES

    def hold_point(self, path) -> int:
        """The first op at which Python has told `path` apart from every other compiled path
        of the site (one past their longest common prefix): a run started there is not
        restarted for a switch."""
        live = tuple((q.id, id(q.graph)) for q in self.paths.values()
                     if q.graph is not None and not q.stale and q.view is not None)
        key, points = self._hold_points
        if key != live:
            points = {}
            self._hold_points = (live, points)
        h = points.get(path.id)
        if h is None:
            sig = path.switch_signature()
            h = 0
            for q in self.paths.values():
                if q is path or q.graph is None or q.stale or q.view is None:
                    continue
                other = q.switch_signature()
                n = min(len(sig), len(other))
                k = 0
                while k < n and sig[k] == other[k]:
                    k += 1
                h = max(h, k + 1)
            points[path.id] = h
        return h


# A fallback onto a path already filed, after at least this many iterations without one, does
# not count towards `max_fallbacks` (a fit's or a loop's epoch end: new data iterator, new path).
KNOWN_FALLBACK_GAP = 8
# A fallback onto new variable objects whose path then runs a compiled path's graph (a metric
# made every epoch) costs one traced step and no build: after at least this many iterations
# without a fallback it does not count either (an 8-batch epoch has 7 between its fallbacks).
KNOWN_REUSE_GAP = 4


def borrowed_units(trace, units: dict, paths) -> dict:
    """Units of the site's other paths that `trace` lacks where it has their ops: `{start:
    unit}`, recorded units for `units_for`.

    A trace recorded after a fallback has no unit for the call the fallback came in (its
    recording began inside that call), nor for a call the path it fell from ran op by op; the
    same ops traced eagerly have them. A unit of a path whose records equal the trace's up to
    the unit's end is the same call: taken over, skip mode skips it whole on this path too,
    and two traces of one path file as one (a second path would cost a trace, a build, and a
    restart per switch, since runs switch only between paths that agree on the units so far).
    Units whose Python read tensor values are not taken (what they read is this trace's own)."""
    mine = [(u.start, u.end) for u in units.values()]
    sig = None
    out = {}
    for q in paths:
        extra = [u for u in q.units.values() if u.start not in units and u.start not in out
                 and not u.reads]
        if not extra:
            continue
        if sig is None:
            sig = [_rec_sig(r) for r in trace.records]
        theirs = q.signature[0]
        common = 0
        for a, b in zip(sig, theirs):
            if a != b:
                break
            common += 1
        slots = 0  # feed slots of equal spec, in order of first use: those the prefix shares
        for f, g in zip(trace.feeds, q.trace.feeds):
            if f.spec != g.spec:
                break
            slots += 1
        for u in sorted(extra, key=lambda u: u.start):
            spans = mine + [(v.start, v.end) for v in out.values()]
            if u.end > common or any(a < u.start < b < u.end or u.start < a < u.end < b
                                     for a, b in spans):
                continue  # (a unit nests in another or lies apart from it)
            if all(r.record < u.end if isinstance(r, OutputRef) else r.slot < slots
                   for r in _refs_in((u.guard, u.result))):
                out[u.start] = u
    return out


def _refs_in(value):
    """The OutputRefs and FeedRefs in a nested tuple (a unit's guard or result)."""
    if isinstance(value, (OutputRef, FeedRef)):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _refs_in(v)


def units_for(trace, units) -> dict:
    """Copies of the recorded units with the feeds first used inside each (for this trace);
    units that read a non-tensor feed first inside, or hold a host op or an op whose output
    length depends on values, are dropped; so is a TF API call (`GradUnit.api`) on a value of
    such a length (`tf.where(m)[:, 0]`): skipped whole it would wait for that length to check
    it, its ops matched one by one do not."""
    out = {}
    first = dependent = None
    for start, u in units.items():
        if any(r.op_type in HOST_OPS for r in trace.records[u.start:u.end]):
            continue  # skipping the unit whole would skip a host op Python must run
        if any(r.op_type in DATA_DEPENDENT_SHAPE_OPS and r.route != "function"
               for r in trace.records[u.start:u.end]):
            # its Python may have read that length (`.shape` is free in eager) and built later
            # ops from it, which no guard checks: its ops are matched one by one (their
            # constants are checked). A Keras optimizer's sparse update filters its rows so.
            continue
        if u.api:
            if dependent is None:
                dependent = _data_dependent_records(trace)
            if any(isinstance(r, OutputRef) and r.record in dependent
                   for rec in trace.records[u.start:u.end] for r in rec.input_refs()):
                continue
        if first is None:
            first = _first_uses(trace)
        feeds = _unit_feeds(trace, u, first)
        if feeds is not None:
            out[start] = replace(u, feeds=feeds)
    return out


def _data_dependent_records(trace) -> set:
    """Records whose outputs may have a length that depends on values: the ops of
    `DATA_DEPENDENT_SHAPE_OPS` and every record downstream of one (conservatively)."""
    out = set()
    for rec in trace.records:
        if rec.op_type in DATA_DEPENDENT_SHAPE_OPS and rec.route != "function" or any(
                isinstance(r, OutputRef) and r.record in out for r in rec.input_refs()):
            out.add(rec.index)
    return out


def reads_feed_values(units) -> bool:
    """A unit's Python read a feed's value: the path holds for that value only (it stays a
    feed, checked before the unit), so the trace is not generalized (generalizing renumbers
    feed slots and frees constants that were this value)."""
    return any(isinstance(r, FeedRef) for u in units.values() for r, _ in u.reads)


def _first_uses(trace) -> list:
    """((record, input position), slot) of each feed slot's first use, in trace order."""
    first = {}
    for i, rec in enumerate(trace.records):
        for k, r in enumerate(rec.input_refs()):
            if isinstance(r, FeedRef) and r.slot not in first:
                first[r.slot] = (i, k)
    return sorted((pos, slot) for slot, pos in first.items())


def _unit_feeds(trace, unit, first_uses):
    """Slots first used inside `unit` (skip mode puts their recorded objects), or None if one of
    them is not an EagerTensor (whose identity, hence value, is stable: TF's cached constants).
    `first_uses`: `_first_uses(trace)`."""
    # tensors the guard names as feeds (a tf.function's data arguments): the caller feeds them
    guarded = {g.slot for g in unit.guard if isinstance(g, FeedRef)}
    inside = []
    for k in range(bisect.bisect_left(first_uses, ((unit.start, -1), -1)), len(first_uses)):
        (i, _), slot = first_uses[k]
        if i >= unit.end:
            break
        if slot in guarded:
            continue
        if not isinstance(trace.feed_values[slot], tfp.EagerTensorBase):
            return None
        inside.append(slot)
    return tuple(inside)


def uncompilable(trace, units=None) -> str | None:
    if trace.unsupported:
        return "; ".join(sorted(set(trace.unsupported))[:3])
    if trace.unseeded_random:
        return "stateful random op without a Generator"
    spans = [(u.start, u.end) for u in (units or {}).values()]
    if any(r.route == "function" and not any(a <= r.index < b for a, b in spans)
           for r in trace.records):
        # only a coarse unit keeps TF from materializing a tf.function's placeholder arguments
        # and from calling another variant (__forward_ under a tape) than the path recorded
        return "a tf.function call outside a coarse unit (arguments Terra cannot guard)"
    if any(f.spec.dtype in ("variant", "resource", "string") for f in trace.feeds):
        return "a feed of a type channels cannot carry"
    return unsnapshotable(trace)


def state_tail(trace, units) -> int | None:
    """The record where a trace that cannot be compiled only for what came after its step
    begins (the next epoch's iterator, made after the last batch's step), or None.

    A tail qualifies when the trace's first problem is a `tf.data` dataset or iterator being
    made (`op_kinds.makes_data_pipeline`: an epoch's end) and from there on no op was recorded
    by a tape or inside a coarse unit: the program's own eager work between steps (Keras'
    validation pass, the next epoch's iterator). (Not variables made after the step: an
    optimizer's slots made by its first apply are the step's, and a model made anew is taken
    by role, roles.py.) Cut there (`cut_trace`), the trace is the step's path: skip mode ends
    the iteration where the tail begins and runs the tail eagerly, as it does for the same
    tail after a full batch's path. Without the cut, a smaller last batch fell back every
    epoch (its only trace held the iterator's creation)."""
    k = trace.first_unsupported
    if not k or trace.unseeded_random or not makes_data_pipeline(trace.records[k].op_type):
        return None
    records = trace.records
    if any(r.taped for r in records[k:]) or any(u.end > k for u in units.values()):
        return None
    used = {e.slot for r in records[:k] for e in r.input_refs() if isinstance(e, FeedRef)}
    if used != set(range(len(used))):  # (slots are numbered in first-use order)
        return None
    return k


def cut_trace(trace: Trace, k: int) -> Trace:
    """`trace`'s first `k` records, with the feeds they use (see `state_tail`); a read after the
    cut of a value before it is a read at the cut."""
    n = len({e.slot for r in trace.records[:k] for e in r.input_refs() if isinstance(e, FeedRef)})
    return Trace(trace.site, trace.records[:k], trace.feeds[:n], trace.feed_values[:n],
                 [replace(f, after_record=min(f.after_record, k)) for f in trace.fetches
                  if f.ref.record < k],
                 dict(trace.variables), [], dict(trace.functions), [],
                 [i for i in trace.fast_fallbacks if i < k],
                 {r: min(a, k) for r, a in trace.shape_reads.items() if r.record < k})
