"""Lowering (§3.2.2, Figures 3.4, 3.5, 3.7): a TraceGraph -> one TF graph (a concrete function).

    lowered = lower(graph, traces)        # traces: the graph's traces, trace id = position
    runner.start(lowered.function)        # no arguments: every input arrives through a channel

Construct by construct (docs/lowering.md has the details and an example):
- op node: the recorded op rebuilt by the trace interpreter's graph emitter (`GraphReplay.op`), named
  `terra_op_<node id>` so runtime errors map back to the node;
- switch-case (Algorithm 1) with several cases, or a single case that a finished path skips:
  one `tf.switch_case` whose index is a Case-Select feed (at the top level, or a lookup of an
  earlier switch-case's index where, on every path, its case follows from that one's:
  `derived_selects`); an extra empty default branch when some
  path may already have reached `end` (`path_choices` gives it `len(cases)`). A single case every
  path takes is emitted inline. Values produced in a branch and read later (plain values, phi
  slots, loop-carried values) are the switch-case's outputs; a branch that does not produce one
  passes the incoming value through, or a zero dummy of the right dtype (shapes are relaxed by
  `switch_case` where branches differ); neighbouring top-level switch-cases on one select,
  with only small shared blocks between them, are one `switch_case` whose branches copy those
  blocks (`Lowered.runs`, compiler/fuse.py);
- loop node: a `tf.while_loop` whose cond dequeues a Loop-Cond feed per iteration; unrolled (no
  Loop-Cond) when every recorded visit had the same trip count. `Prev`/`Carried` sources and the
  loop's outputs are loop variables: the value of the last iteration that ran the producer
  (`Carried` starts with its `init`);
- phi: a slot updated by each of its producers as they run, read by the consumer (so it holds the
  producer that ran last, which is the phi's rule);
- feeds: each `FeedRef` / `IterFeed` input dequeues from the FeedChannel of its feed point
  (node, input position), unless the same feed was already dequeued in a scope that dominates it;
  `Lowered.feed_points[node]` lists what Python puts for one visit of the node, in order;
- fetches: every `FetchPoint` output enqueues into the FetchChannel of (node, output index) each
  time the node runs (Python consumes one element per visit, discarding those it does not read);
- ordering (Figure 3.4): within each (function) graph every dequeue has control dependencies on
  the previous dequeue and on every enqueue since; a switch_case / while op is one step of that
  chain (its select / first cond waits for what came before; what comes after waits for it), and
  every branch / loop body ends in a token that depends on all its stateful ops. Emission follows
  program order, so an Output-Fetching op always runs before any Input-Feeding op that Python can
  only supply after reading it. Variable reads and writes are ordered by the automatic control
  dependencies of `tf.function(autograph=False)`, which see through branches and loop bodies
  (their resource inputs).

The function returns nothing: everything Python reads goes through `fetches`.

With `commit=True` the writes wait for a token on `commit_channel`, as a path graph's do
(terra/compiler/commit.py): a `switch_case` or `while_loop` counts as one op that writes or can
fail as the ops in its functions do. `commit_dependent` names the fetches whose elements wait
for the commit (their value depends on a write, or they are enqueued inside such an op).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
import tensorflow as tf

from terra import _tf_private as tfp
from terra.compiler import commit as _commit
from terra.compiler import fuse as _fuse
from terra.compiler import replay as _replay
from terra.compiler.case_assignment import assign_cases, path_choices
from terra.compiler.interpret import input_dtypes
from terra.compiler.merge import shape_key  # what `covers` compares
from terra.compiler.merge import merge
from terra.ir.records import (SHAPE_CONSTANT, SITE_CONSTANT, ConstRef, FeedRef, TensorSpec,
                              Trace, VariableRef)
from terra.ir.trace_graph import LOOP, Carried, IterFeed, NodeOut, Phi, Prev, TraceGraph
from terra.compiler.channels import FeedChannel, FetchChannel
from terra.compiler.graph_memo import memo
from terra.compiler.names import op_node_name

__all__ = ["lower", "Lowered", "FeedPoint", "LevelPlan", "TOP", "op_name"]

TOP = "top"  # level id of the top level; a loop body's level id is its loop node's id
FUSE_MAX_SHARED = 16  # nodes of a shared block copied into each branch of a fused switch-case
_OUT, _PHI, _VAR, _VARIN, _FEED, _ITERFEED = "out", "phi", "var", "varin", "feed", "iterfeed"


def op_name(node_id: int) -> str:
    """Graph node name of a TraceGraph node's op: the runtime's naming, so that its error
    translation maps a failing op back to its node."""
    return op_node_name(node_id)


# ---------------------------------------------------------------------------------- public data
@dataclass(frozen=True, slots=True)
class FeedPoint:
    """One Input-Feeding op: node `node` input `position` ((arg,) or (arg, item); for a loop
    node, ("init", body node, position) of a `Carried` init) reads `source` (FeedRef / IterFeed)."""
    node: int
    position: tuple
    source: object

    def __repr__(self) -> str:
        return f"feed(n{self.node}{list(self.position)} <- {self.source!r})"


@dataclass(frozen=True, slots=True)
class LevelPlan:
    """How one level (top, or a loop body) was lowered: its switch-cases (Algorithm 1), for each
    whether it became a `switch_case` op (`has_op`) and whether that op has the extra default
    branch, and the switch-case index of each node."""
    level: object
    switch_cases: tuple
    has_op: tuple
    default: tuple
    switch_case_of: dict


@dataclass
class Lowered:
    """The generated graph and the channels the Python side drives.

    function      ConcreteFunction of no arguments that returns nothing.
    feeds         (node, position) -> FeedChannel (Input-Feeding).
    feed_points   node -> tuple of FeedPoint: what one visit of the node dequeues, in order.
    case_selects  (level, switch-case index) -> FeedChannel(int32) (Case-Select).
    loop_conds    loop node -> FeedChannel(bool) (Loop-Cond; one element per cond evaluation:
                  True per iteration, then False).
    unrolled      loop node -> trip count, for loops emitted unrolled (no Loop-Cond).
    fetches       (node, output index) -> FetchChannel (Output-Fetching; one element per visit).
    levels        level id -> LevelPlan.
    commit_channel  FeedChannel(bool) whose token lets a run write (None: not gated; the
                  runtime snapshots the variables before each run).
    commit_dependent  fetch keys whose elements wait for the commit.
    derived_selects  (TOP, k) -> (j, table): top-level switch-case k takes `table[select j]`,
                  not a Case-Select of its own (on every path its case follows from j's).
    runs          fuse.Run per group of top-level switch-cases emitted as one `switch_case`.
    """
    graph: TraceGraph
    function: object
    feeds: dict
    feed_points: dict
    case_selects: dict
    loop_conds: dict
    unrolled: dict
    fetches: dict
    levels: dict
    build_seconds: float
    stats: dict = field(default_factory=dict)
    commit_channel: object = None
    commit_dependent: frozenset = frozenset()
    derived_selects: dict = field(default_factory=dict)
    runs: tuple = ()

    def channels(self) -> list:
        return (list(self.feeds.values()) + list(self.case_selects.values())
                + list(self.loop_conds.values()) + list(self.fetches.values())
                + ([self.commit_channel] if self.commit_channel is not None else []))

    def feed_channels(self) -> list:
        return (list(self.feeds.values()) + list(self.case_selects.values())
                + list(self.loop_conds.values()))

    def match(self, trace: Trace):
        """The TraceGraph with `trace` merged in (trace id `graph.num_traces`, which maps every
        record to its node) if this graph can run `trace`'s iteration, else None: the merge must
        add nothing (`merge.covers`) and every unrolled loop must run its fixed trip count."""
        merged = merge(self.graph, trace)
        if shape_key(merged) != shape_key(self.graph):
            return None
        tid = self.graph.num_traces
        if self.derived_selects:  # a new combination of the paths' choices has no select
            choices = top_choices(merged, self.levels[TOP], tid)
            if choices is None or any(choices[k] != table[choices[j]] for (_, k), (j, table)
                                      in self.derived_selects.items()):
                return None
        for lid, trips in self.unrolled.items():
            node = _find(merged, lid)
            if any(c != trips for c in node.loop.trip_counts.get(tid, ())):
                return None
        return merged

    def covers(self, trace: Trace) -> bool:
        return self.match(trace) is not None

    def drain(self) -> int:
        """Empty every channel (after a finished or cancelled run); returns how many elements."""
        return sum(ch.drain() for ch in self.channels())

    def describe(self) -> str:
        s = self.stats
        lines = [f"Lowered graph of {self.graph!r}: {s['tf_ops']} TF ops "
                 f"({s['switch_case_ops']} switch_case, {s['while_ops']} while), "
                 f"{len(self.feeds)} feeds, {len(self.fetches)} fetches, "
                 f"{len(self.case_selects)} case selects, {len(self.loop_conds)} loop conds, "
                 f"built in {self.build_seconds:.2f} s"]
        fused = {(TOP, k): r for r in self.runs for k in r.members}
        for lid, lp in self.levels.items():
            where = "top" if lid == TOP else f"body of n{lid}"
            for k, sc in enumerate(lp.switch_cases):
                how = ("switch_case" + (" + default" if lp.default[k] else "")) if lp.has_op[k] \
                    else "inline"
                if (lid, k) in self.derived_selects:
                    how += f" (index from s{self.derived_selects[(lid, k)][0] + 1})"
                run = fused.get((lid, k))
                if run is not None:
                    how = f"in {run!r}: " + how
                lines.append(f"  {where} s{k + 1}: {how}: {sc!r}")
        for lid, t in sorted(self.unrolled.items()):
            lines.append(f"  loop n{lid}: unrolled x{t}")
        for lid in sorted(self.loop_conds):
            lines.append(f"  loop n{lid}: while_loop (Loop-Cond)")
        for node, pts in sorted(self.feed_points.items()):
            lines.append(f"  n{node} feeds: " + ", ".join(map(repr, pts)))
        for (node, i) in sorted(self.fetches):
            lines.append(f"  n{node}:{i} fetched")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- graph analysis
def top_choices(graph: TraceGraph, plan: LevelPlan, tid: int):
    """The case trace `tid` takes at each top-level switch-case (`path_choices`), None where
    the switch-cases do not cover its path."""
    visits = sorted((r, n.id) for n in graph.op_nodes for r in n.seen.get(tid, ()))
    try:
        return path_choices(plan.switch_cases, (graph.start,) + tuple(n for _, n in visits) +
                            (graph.end,))
    except ValueError:
        return None


def derive_selects(graph: TraceGraph, plan: LevelPlan) -> dict:
    """(TOP, k) -> (j, table) for each top-level switch-case op k whose case follows, on every
    trace, from the case of an earlier one j that has a Case-Select: its index is then
    `table[select j]` in the graph, and Python puts one select instead of one per switch-case
    (a random head among three made 25 switch-cases, 25 puts per step)."""
    choices = [top_choices(graph, plan, t) for t in range(graph.num_traces)]
    if not choices or any(c is None for c in choices):
        return {}
    sources, derived = [], {}
    for k, has_op in enumerate(plan.has_op):
        if not has_op:
            continue
        for j in sources:
            table = {}
            if all(table.setdefault(c[j], c[k]) == c[k] for c in choices):
                width = len(plan.switch_cases[j].cases) + (1 if plan.default[j] else 0)
                derived[(TOP, k)] = (j, tuple(table.get(v, 0) for v in range(width)))
                break
        else:
            sources.append(k)
    return derived


def _find(g: TraceGraph, nid: int):
    if nid in g.nodes:
        return g.nodes[nid]
    for n in g.nodes.values():
        if n.kind == LOOP:
            found = _find(n.loop.body, nid)
            if found is not None:
                return found
    return None


def _flat(inputs):
    """(position, source) for every input slot: positions (arg,) or (arg, item)."""
    for a, arg in enumerate(inputs):
        if isinstance(arg, tuple):
            for k, s in enumerate(arg):
                yield (a, k), s
        else:
            yield (a,), arg


def _relax(specs):
    """dtype and most specific common shape (tuple with None dims / None) of TensorSpecs."""
    specs = [s for s in specs if s is not None]
    if not specs:
        return None, None
    dtype, shape = specs[0].dtype, specs[0].shape
    for s in specs[1:]:
        if s.dtype != dtype:
            raise ValueError(f"lower: one value has dtypes {dtype} and {s.dtype} on different "
                             f"traces")
        if shape is None or s.shape is None or len(shape) != len(s.shape):
            shape = None
        else:
            shape = tuple(a if a == b else None for a, b in zip(shape, s.shape))
    return dtype, shape


class _Analysis:
    """Static facts about the whole graph: node index, levels, specs, reads and writes."""

    def __init__(self, graph: TraceGraph, traces, fuse: int = 0, commit: bool = False,
                 shapes_known: bool = False):
        self.graph, self.traces = graph, traces
        self.node, self.level_of, self.levels = {}, {}, {}
        self._index(TOP, graph)
        self.plans = {lid: self._plan(lid, g) for lid, g in self.levels.items()}
        self.derived = derive_selects(graph, self.plans[TOP])
        self.vars = {lid: self._vars(lid) for lid in self.levels if lid != TOP}
        self.phi_keys, self.var_keys = {}, {}
        for lid, g in self.levels.items():
            for n in g.op_nodes:
                for pos, phi in n.phis:
                    for o in phi.options:
                        self.phi_keys.setdefault((o.source.node, o.source.index), []).append(
                            (_PHI, n.id, pos))
        for lid, vs in self.vars.items():
            for v in vs:
                self.var_keys.setdefault((v[0], v[1]), []).append((_VAR, v))
        self.runs = self._fuse(fuse, commit, shapes_known)

    def _fuse(self, fuse, commit, shapes_known) -> tuple:
        """compiler/fuse.py's runs of the top level."""
        top = self.plans[TOP]

        def size(n):  # a loop: its body's nodes, each counted once
            return 1 + (sum(size(m) for m in n.loop.body.op_nodes) if n.kind == LOOP else 0)

        def size_of(k):
            block = top.switch_cases[k].cases[0].block if top.switch_cases[k].cases else ()
            return sum(size(self.node[n]) for n in block)
        kinds = {}

        def kind_of(k):
            """(writes, can fail or is fetched) of switch-case k's ops: a fused `switch_case`
            that writes waits for the commit as a whole, so one holding an op that can fail
            would leave a gated graph ungated (compiler/commit.py) and one holding a fetch
            would keep Python's read of it until the commit."""
            if k not in kinds:
                w = f = False
                for c in top.switch_cases[k].cases:
                    for n in c.block:
                        nw, nf = self.node_kind(self.node[n], shapes_known)
                        w, f = w or nw, f or nf
                kinds[k] = (w, f)
            return kinds[k]
        return _fuse.fused_runs(top, self.derived, TOP, size_of, fuse,
                                kind_of if commit else None)

    def node_kind(self, n, shapes_known) -> tuple:
        """(writes, can fail or is fetched) of a node, loops with their bodies
        (`commit.record_kind`)."""
        if n.kind == LOOP:
            kinds = [self.node_kind(m, shapes_known) for m in n.loop.body.op_nodes]
            return any(w for w, _ in kinds), any(f for _, f in kinds)
        defined = shapes_known or all(
            self.out_spec(n.id, i)[1] is not None and None not in self.out_spec(n.id, i)[1]
            for i in range(len(n.op.outputs)))
        writes, fails = _commit.record_kind(n.op, defined)
        return writes, fails or bool(n.fetches)

    def _index(self, lid, g):
        self.levels[lid] = g
        for n in g.op_nodes:
            self.node[n.id], self.level_of[n.id] = n, lid
            if n.kind == LOOP:
                self._index(n.id, n.loop.body)

    def _plan(self, lid, g) -> LevelPlan:
        scs = assign_cases(g)
        of, ended, has_op, default = {}, (g.start, g.end) in g.edges, [], []
        to_end = {a for a, b in g.edges if b == g.end}
        for k, sc in enumerate(scs):
            nonempty = any(c.block for c in sc.cases)
            has_op.append(nonempty and (len(sc.cases) > 1 or ended))
            default.append(has_op[-1] and ended)
            for c in sc.cases:
                for n in c.block:
                    of[n] = k
                    ended = ended or n in to_end
        return LevelPlan(lid, scs, tuple(has_op), tuple(default), of)

    def _vars(self, lid) -> list:
        """Loop variables of body level `lid`: (node, index, init or None) for every Prev /
        Carried of a node of this level (anywhere below it) and every loop output."""
        out = []

        def add(v):
            if v not in out:
                out.append(v)

        def scan(g):
            for n in g.op_nodes:
                for _, s in _flat(n.inputs):
                    if isinstance(s, Carried) and self.level_of.get(s.update.node) == lid:
                        add((s.update.node, s.update.index, s.init))
                    elif isinstance(s, Prev) and self.level_of.get(s.node) == lid:
                        add((s.node, s.index, None))
                if n.kind == LOOP:
                    scan(n.loop.body)
        scan(self.levels[lid])
        for o in self.node[lid].loop.outputs:
            if not any(v[0] == o.node and v[1] == o.index for v in out):
                add((o.node, o.index, None))
        return out

    # ---- specs
    def records_of(self, n):
        """(trace, record) for every recorded visit of op node `n`."""
        for tid, idxs in n.seen.items():
            if tid < len(self.traces):
                for r in idxs:
                    yield self.traces[tid], self.traces[tid].records[r]

    def out_spec(self, nid, i):
        n = self.node[nid]
        if n.kind == LOOP:
            o = n.loop.outputs[i]
            return self.out_spec(o.node, o.index)
        specs = [rec.outputs[i] for _, rec in self.records_of(n)] or [n.op.outputs[i]]
        return _relax(specs)

    def feed_spec(self, nid, pos):
        specs = []
        for tr, rec in self.records_of(self.node[nid]):
            ref = rec.inputs[pos[0]] if len(pos) == 1 else rec.inputs[pos[0]][pos[1]]
            if isinstance(ref, FeedRef):
                specs.append(tr.feeds[ref.slot].spec)
        return _relax(specs)

    def timed_feed(self, nid, pos) -> bool:
        """Whether the feed at input `pos` of node `nid` counts the graph's wait for Python
        (channels.py): not a shape group's or a path's constant, which the runtime puts, not
        Python."""
        for tr, rec in self.records_of(self.node[nid]):
            ref = rec.inputs[pos[0]] if len(pos) == 1 else rec.inputs[pos[0]][pos[1]]
            if isinstance(ref, FeedRef) and tr.feeds[ref.slot].source not in (SHAPE_CONSTANT,
                                                                              SITE_CONSTANT):
                return True
        return False


    def key_spec(self, key):
        kind = key[0]
        if kind == _OUT:
            return self.out_spec(key[1], key[2])
        if kind == _PHI:
            pos, node = key[2], self.node[key[1]]
            phi = dict(node.phis)[pos]
            return _relax([TensorSpec(*self.out_spec(o.source.node, o.source.index))
                           for o in phi.options])
        if kind == _VAR:
            return self.out_spec(key[1][0], key[1][1])
        raise KeyError(key)

    # ---- reads / writes
    def reads(self, n) -> set:
        out = set()

        def src(node, pos, s):
            if isinstance(s, NodeOut):
                out.add((_OUT, s.node, s.index))
            elif isinstance(s, Phi):
                out.add((_PHI, node.id, pos))
            elif isinstance(s, Carried):
                src(node, pos, s.init)

        def scan(node):
            for pos, s in _flat(node.inputs):
                src(node, pos, s)
            if node.kind == LOOP:
                for m in node.loop.body.op_nodes:
                    scan(m)
        scan(n)
        return out

    def n_outputs(self, n) -> int:
        return len(n.loop.outputs) if n.kind == LOOP else len(n.op.outputs)

    def writes(self, n) -> list:
        out = []
        for i in range(self.n_outputs(n)):
            out.append(((_OUT, n.id, i), i))
            out += [(k, i) for k in self.phi_keys.get((n.id, i), ())]
            out += [(k, i) for k in self.var_keys.get((n.id, i), ())]
        return out


# ------------------------------------------------------------------------------ emission helpers
class _Chain:
    """Figure 3.4 ordering within one graph: last dequeue and enqueues since."""
    __slots__ = ("last_feed", "pending")

    def __init__(self, start=()):
        self.last_feed, self.pending = None, list(start)

    def control(self):
        return self.pending + ([self.last_feed] if self.last_feed is not None else [])

    def fed(self, op):
        self.last_feed, self.pending = op, []

    def fetched(self, op):
        self.pending.append(op)

    def after(self, op):
        self.last_feed, self.pending = op, [op]


class _Scope:
    """Values visible at a point of emission; `chain` is shared by scopes of the same graph."""
    __slots__ = ("parent", "env", "chain")

    def __init__(self, parent=None, new_graph=True):
        self.parent, self.env = parent, {}
        self.chain = _Chain() if new_graph or parent is None else parent.chain

    def get(self, key, default=None):
        s = self
        while s is not None:
            if key in s.env:
                return s.env[key]
            s = s.parent
        return default


def _dummy(dtype, shape):
    """A zero value standing in for one a branch does not produce: one per graph, dtype and
    shape (a one-path site graph of a residual CNN asked for 936, and each `tf.zeros` cost
    more than the op it stands in for), made outside any control dependencies so that every
    user can share it."""
    if dtype in ("variant", "resource"):
        raise ValueError(f"lower: cannot make a placeholder value of dtype {dtype} for a "
                         f"branch that does not produce it")
    dims = () if shape is None else tuple(0 if d is None else d for d in shape)
    cache = memo(tf.compat.v1.get_default_graph(), "dummies", dict)  # {(dtype, dims): tensor}
    t = cache.get((dtype, dims))
    if t is None:
        with tf.control_dependencies(None):
            t = tf.fill(dims, "") if dtype == "string" else tf.zeros(dims, dtype)
        cache[(dtype, dims)] = t
    return t


def _stateful(op) -> bool:
    try:
        return op.op_def.is_stateful
    except Exception:  # function-call ops without a registered op def
        return True


def _token(chain: _Chain):
    """A scalar that depends on every stateful op of the current graph and on the chain."""
    g = tf.compat.v1.get_default_graph()
    deps = [op for op in g.get_operations() if _stateful(op)] + chain.control()
    with tf.control_dependencies(deps):
        return tf.zeros([], tf.int32)


class _NodeReplay(_replay.GraphReplay):
    """The graph emitter for single nodes; inputs are resolved by the lowering beforehand
    (`_Ready`)."""

    def __init__(self, variables, functions):
        super().__init__(Trace("lowered", variables=variables, functions=functions), ())
        self._consts = {}  # graph id -> (graph, {ConstRef: tensor})

    def value(self, ref, dtype=None):
        if isinstance(ref, _Ready):
            return ref.tensor
        if isinstance(ref, ConstRef):  # replay caches constants; keep one cache per graph
            g = tf.compat.v1.get_default_graph()
            entry = self._consts.get(id(g))
            if entry is None or entry[0] is not g:  # (the graph is kept, so ids stay unique)
                entry = self._consts[id(g)] = (g, {})
            self.consts = entry[1]
        return super().value(ref, dtype)


class _Ready:
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


# --------------------------------------------------------------------------------- the lowering
def _control_flow_op(t):
    """The `Case` / `While` op behind an output of `tf.switch_case` / `tf.while_loop` (which
    wrap its outputs in identities)."""
    op = t.op
    while op.type == "Identity":
        op = op.inputs[0].op
    return op


class _Lowering:
    def __init__(self, an: _Analysis, unroll: bool, timed: bool, commit: bool = False,
                 shapes_known: bool = False):
        self.an, self.unroll, self.timed = an, unroll, timed
        self.shapes_known = shapes_known
        # commit gating (compiler/commit.py): the op type of each node, None where not gated
        self.op_types = _commit.record_types(
            {nid: n.op for nid, n in an.node.items() if n.kind != LOOP}) if commit else None
        self.inner = {}         # Case / While op -> (writes, can fail) of the ops inside it
        self.members = None     # fetch keys enqueued inside the top-level op being emitted
        self.contains = {}      # top-level Case / While op -> fetch keys enqueued inside it
        self.top_fetches = {}   # fetch key -> its enqueue ops at the top level
        variables, functions = {}, {}
        for t in an.traces:
            variables.update(t.variables)
            functions.update(t.functions)
        self.builder = _NodeReplay(variables, functions)
        self.feeds, self.feed_points, self.case_selects = {}, {}, {}
        self.loop_conds, self.unrolled, self.fetches = {}, {}, {}
        self.selects = {}  # (level, k) -> the select tensor of a top-level switch-case
        self._emitted_points = {}

    # ---- channels (created eagerly, lifted out of the function being traced)
    def _channel(self, table, key, make):
        ch = table.get(key)
        if ch is None:
            with tf.init_scope():
                ch = table[key] = make()
        return ch

    def _dequeue(self, scope, ch):
        value = ch.dequeue_op(control_inputs=scope.chain.control())
        scope.chain.fed(value.op)
        return value

    # ---- levels
    def level(self, lid, scope):
        """Emit level `lid` (its switch-cases in order) into `scope`."""
        an, plan = self.an, self.an.plans[lid]
        reads_after = [set() for _ in plan.switch_cases]
        later = set((_VAR, v) for v in an.vars.get(lid, ()))  # a body's end reads its variables
        for k in range(len(plan.switch_cases) - 1, -1, -1):
            reads_after[k] = set(later)
            for c in plan.switch_cases[k].cases:
                for n in c.block:
                    later |= an.reads(an.node[n])
        runs = {r.members[0]: r for r in an.runs} if lid == TOP else {}
        fused = set()
        for k, sc in enumerate(plan.switch_cases):
            if k in fused:
                continue
            if k in runs:
                fused.update(runs[k].members)
                self.fused(runs[k], reads_after[runs[k].members[-1]], scope)
                continue
            if not plan.has_op[k]:
                for c in sc.cases:
                    for n in c.block:
                        self.node(an.node[n], scope)
                continue
            self.switch_case(lid, k, sc, plan.default[k], reads_after[k], scope)

    def switch_case(self, lid, k, sc, default, needed, scope):
        derived = self.an.derived.get((lid, k))
        if derived is not None:  # (a top-level one: the select it follows is in scope)
            with tf.control_dependencies(scope.chain.control()):
                select = tf.gather(tf.constant(derived[1], tf.int32),
                                   self.selects[(lid, derived[0])])
            scope.chain.fed(select.op)
        else:
            ch = self._channel(self.case_selects, (lid, k), lambda: FeedChannel(
                tf.int32, [], name=f"case_select_{lid}_{k}", timed=self.timed))
            select = self._dequeue(scope, ch)
        if lid == TOP:
            self.selects[(lid, k)] = select
        blocks = [c.block for c in sc.cases] + ([()] if default else [])
        self._case_op(select, blocks, needed, scope, f"terra_switch_{lid}_{k}")

    def fused(self, run, needed, scope):
        """One `switch_case` for a fusion run (compiler/fuse.py): branch v runs each member's
        case for the driver's select v, the shared blocks between them copied in."""
        plan = self.an.plans[TOP]
        if run.driver == run.members[0]:
            ch = self._channel(self.case_selects, (TOP, run.driver), lambda: FeedChannel(
                tf.int32, [], name=f"case_select_{TOP}_{run.driver}", timed=self.timed))
            select = self.selects[(TOP, run.driver)] = self._dequeue(scope, ch)
        else:  # a select dequeued earlier at the top level
            with tf.control_dependencies(scope.chain.control()):
                select = tf.identity(self.selects[(TOP, run.driver)])
            scope.chain.fed(select.op)
        blocks = []
        for v in range(run.width):
            block = []
            for k in run.members:
                c = _fuse.case_for(plan, self.an.derived, TOP, run.driver, k, v)
                if c is not None:
                    block.extend(plan.switch_cases[k].cases[c].block)
            blocks.append(tuple(block))
        self._case_op(select, blocks, needed, scope,
                      f"terra_switch_{TOP}_{run.members[0]}_{run.members[-1]}")

    def _case_op(self, select, blocks, needed, scope, name):
        an = self.an
        written = set()
        for block in blocks:
            for n in block:
                written |= {key for key, _ in an.writes(an.node[n])}
        keys = sorted(written & needed, key=repr)
        summaries, top = [], self._enter()

        def branch(block):
            def fn():
                inner = _Scope(scope, new_graph=True)
                for n in block:
                    self.node(an.node[n], inner)
                outs = [inner.get(key) for key in keys]
                outs = [o if o is not None else _dummy(*an.key_spec(key))
                        for o, key in zip(outs, keys)]
                self._summarize(summaries)
                return [_token(inner.chain)] + outs
            return fn
        res = tf.switch_case(select, [branch(b) for b in blocks], name=name)
        res = list(res) if isinstance(res, (list, tuple)) else [res]
        self._leave(top, _control_flow_op(res[0]), summaries)
        for key, t in zip(keys, res[1:]):
            scope.env[key] = t
        scope.chain.after(res[0].op)

    # ---- nodes
    def node(self, n, scope):
        if n.kind == LOOP:
            outs = self.loop(n, scope)
        else:
            outs = self.op(n, scope)
        for key, i in self.an.writes(n):
            scope.env[key] = outs[i]
        for i in sorted({f.index for f in n.fetches}):
            dtype, shape = self.an.out_spec(n.id, i)
            # the traces' common shape, widened to what the graph guarantees for every value
            # of its feeds (a computed `Range` limit: unknown length)
            shape = tf.TensorShape(shape).most_specific_compatible_shape(outs[i].shape)
            ch = self._channel(self.fetches, (n.id, i), lambda: FetchChannel(
                dtype, shape, name=f"fetch_{n.id}_{i}"))
            op = ch.enqueue_op(outs[i])
            scope.chain.fetched(op)
            if self.members is not None:
                self.members.add((n.id, i))
            else:
                self.top_fetches.setdefault((n.id, i), []).append(op)

    # ---- commit gating (what each control-flow op holds)
    def _enter(self) -> bool:
        """A control-flow op's emission begins; True if it is a top-level one."""
        if self.op_types is None or self.members is not None:
            return False
        self.members = set()
        return True

    def _summarize(self, summaries) -> None:
        """At the end of a branch or loop body: what its graph's ops do."""
        if self.op_types is not None:
            summaries.append(_commit.summarize(
                tf.compat.v1.get_default_graph().get_operations(), self.op_types, self.inner,
                self.shapes_known))

    def _leave(self, top: bool, op, summaries) -> None:
        if self.op_types is None:
            return
        self.inner[op] = (any(w for w, _ in summaries), any(f for _, f in summaries))
        if top:
            self.contains[op], self.members = self.members, None

    def gate(self, channel):
        """Gate the top-level graph's writes on `channel` (compiler/commit.py); the fetch keys
        whose elements then wait for the commit, or None where the graph cannot be gated."""
        tainted = _commit.gate_writes(tf.compat.v1.get_default_graph().get_operations(),
                                      self.op_types, channel.dequeue_op, self.inner,
                                      self.shapes_known)
        if tainted is None:
            return None
        dependent = {key for key, ops in self.top_fetches.items()
                     if any(op in tainted for op in ops)}
        for op, keys in self.contains.items():
            if op in tainted:
                dependent |= keys
        return frozenset(dependent)

    def _record_points(self, nid, points):
        prev = self._emitted_points.get(nid)
        if prev is not None and prev != points:
            raise AssertionError(f"lower: n{nid} dequeues {points} here but {prev} elsewhere")
        self._emitted_points[nid] = points
        if points:
            self.feed_points[nid] = tuple(points)

    def feed(self, nid, pos, src, scope, points, key, spec):
        t = scope.get(key)
        if t is not None:
            return t
        dtype, shape = spec
        ch = self._channel(self.feeds, (nid, pos), lambda: FeedChannel(
            dtype, shape, name=f"feed_{nid}_{'_'.join(map(str, pos))}",
            timed=self.timed and self.an.timed_feed(nid, pos)))
        t = self._dequeue(scope, ch)
        points.append(FeedPoint(nid, pos, src))
        scope.env[key] = t
        return t

    def source(self, n, pos, s, scope, points):
        an = self.an
        if isinstance(s, NodeOut):
            t = scope.get((_OUT, s.node, s.index))
            return _Ready(t if t is not None else _dummy(*an.out_spec(s.node, s.index)))
        if isinstance(s, Phi):
            t = scope.get((_PHI, n.id, pos))
            return _Ready(t if t is not None else _dummy(*an.key_spec((_PHI, n.id, pos))))
        if isinstance(s, Prev):
            return _Ready(scope.get((_VARIN, (s.node, s.index, None))))
        if isinstance(s, Carried):
            return _Ready(scope.get((_VARIN, (s.update.node, s.update.index, s.init))))
        if isinstance(s, FeedRef):
            return _Ready(self.feed(n.id, pos, s, scope, points, (_FEED, s.slot),
                                    an.feed_spec(n.id, pos)))
        if isinstance(s, IterFeed):
            return _Ready(self.feed(n.id, pos, s, scope, points,
                                    (_ITERFEED, an.level_of[n.id], s.ordinal),
                                    an.feed_spec(n.id, pos)))
        if isinstance(s, (VariableRef, ConstRef)):
            return s
        raise TypeError(f"lower: n{n.id} has an input of unknown kind {s!r}")

    def op(self, n, scope):
        points, inputs = [], []
        flat = {pos: self.source(n, pos, s, scope, points) for pos, s in _flat(n.inputs)}
        for a, arg in enumerate(n.inputs):
            inputs.append(tuple(flat[(a, k)] for k in range(len(arg))) if isinstance(arg, tuple)
                          else flat[(a,)])
        self._record_points(n.id, points)
        rec = n.op.__class__(n.op.index, n.op.op_type, n.op.attrs, tuple(inputs), n.op.outputs,
                             n.op.location, n.op.route, n.op.function)
        with tf.name_scope(op_name(n.id)):
            outs = self.builder.function(rec) if rec.route == "function" else self.builder.op(rec)
        return list(outs or ())

    # ---- loops
    def loop(self, n, scope):
        an, lid = self.an, n.id
        vars_ = an.vars[lid]
        points, init = [], []
        for v in vars_:
            m, i, src = v
            if src is None:
                init.append(_dummy(*an.out_spec(m, i)))
                continue
            consumer, pos = self._carried_consumer(lid, v)
            if isinstance(src, FeedRef):
                t = self.feed(lid, ("init", consumer, pos), src, scope, points, (_FEED, src.slot),
                              an.feed_spec(consumer, pos))
            elif isinstance(src, NodeOut):
                t = scope.get((_OUT, src.node, src.index))
                t = t if t is not None else _dummy(*an.out_spec(src.node, src.index))
            else:
                dtype = input_dtypes(an.node[consumer].op).get(pos)
                t = self.builder.value(src, dtype)
            init.append(tf.convert_to_tensor(t))
        self._record_points(lid, points)
        trips = n.loop.seen_trip_counts
        if self.unroll and len(trips) == 1:
            (t_count,) = trips
            self.unrolled[lid] = t_count
            vals = init
            for _ in range(t_count):
                vals = self.iteration(lid, vals, _Scope(scope, new_graph=False))
            final = vals
        else:
            with tf.control_dependencies(scope.chain.control()):
                counter = tf.zeros([], tf.int32)
            final = self.while_loop(lid, vars_, init, counter, scope)
        return [final[self._var_index(vars_, o)] for o in n.loop.outputs]

    @staticmethod
    def _var_index(vars_, o):
        return next(k for k, v in enumerate(vars_) if v[0] == o.node and v[1] == o.index)

    def _carried_consumer(self, lid, v):
        for m in _walk_nodes(self.an.levels[lid]):
            for pos, s in _flat(m.inputs):
                if isinstance(s, Carried) and (s.update.node, s.update.index, s.init) == v:
                    return m.id, pos
        raise AssertionError(f"no consumer of {v!r}")

    def iteration(self, lid, vals, scope):
        for v, t in zip(self.an.vars[lid], vals):
            scope.env[(_VARIN, v)] = t
            scope.env[(_VAR, v)] = t
        self.level(lid, scope)
        return [scope.get((_VAR, v)) for v in self.an.vars[lid]]

    def while_loop(self, lid, vars_, init, counter, scope):
        ch = self._channel(self.loop_conds, lid, lambda: FeedChannel(
            tf.bool, [], name=f"loop_cond_{lid}", timed=self.timed))

        def cond(c, *vals):
            return ch.dequeue_op(control_inputs=[c.op])

        summaries, top = [], self._enter()

        def body(c, *vals):
            inner = _Scope(scope, new_graph=True)
            new = self.iteration(lid, list(vals), inner)
            self._summarize(summaries)
            with tf.control_dependencies([_token(inner.chain)]):
                return [c + 1] + new

        invariants = [tf.TensorShape([])]
        for v, t in zip(vars_, init):
            dtype, shape = self.an.out_spec(v[0], v[1])
            s = tf.TensorShape(None if shape is None else list(shape))
            invariants.append(s.most_specific_compatible_shape(t.shape))
        res = tf.while_loop(cond, body, [counter] + list(init), shape_invariants=invariants,
                            parallel_iterations=1, name=f"terra_while_{lid}")
        self._leave(top, _control_flow_op(res[0]), summaries)
        scope.chain.after(res[0].op)
        return list(res[1:])


def _walk_nodes(g):
    for n in g.op_nodes:
        yield n
        if n.kind == LOOP:
            yield from _walk_nodes(n.loop.body)


def _count_ops(concrete) -> dict:
    gd = concrete.graph.as_graph_def()
    nodes = list(gd.node) + [nd for f in gd.library.function for nd in f.node_def]
    kinds = [nd.op for nd in nodes]
    return {"tf_ops": len(kinds),
            "switch_case_ops": sum(k in ("Case", "StatelessCase") for k in kinds),
            "while_ops": sum(k in ("While", "StatelessWhile") for k in kinds),
            "functions": len(gd.library.function)}


def lower(graph: TraceGraph, traces, *, unroll: bool = True, timed: bool = True,
          commit: bool = False, shapes_known: bool = False,
          fuse: int = FUSE_MAX_SHARED) -> Lowered:
    """Build the TF graph for `graph`. `traces[t]` must be the trace merged as trace id `t` (for
    variables, called functions and feed shapes). `unroll`: unroll loops whose recorded trip
    counts are all equal. `timed`: feed channels measure graph stall (see compiler/channels.py).
    `commit`: gate the writes on a commit channel where the graph allows it (module docstring);
    `shapes_known`: every value has its recorded shape on each path (the paths' own graphs
    infer every shape), so shapes relaxed across paths do not make an op count as fallible.
    `fuse`: fuse neighbouring switch-cases driven by one select across shared blocks of at most
    this many nodes (compiler/fuse.py; 0: never)."""
    if not isinstance(graph, TraceGraph):
        raise TypeError(f"lower expects a TraceGraph, got {type(graph).__name__}")
    traces = list(traces)
    if len(traces) != graph.num_traces or not all(isinstance(t, Trace) for t in traces):
        raise ValueError(f"lower: need the {graph.num_traces} traces merged into the graph (in "
                         f"merge order), got {len(traces)} objects")
    if graph.num_traces == 0:
        raise ValueError("lower: the TraceGraph has no traces")
    t0 = time.perf_counter()
    an = _Analysis(graph, traces, fuse, commit, shapes_known)
    lw = _Lowering(an, unroll, timed, commit, shapes_known)
    gated = {}
    channel = FeedChannel(tf.bool, [], name="terra_commit", timed=False) \
        if lw.op_types is not None else None

    def build():
        lw.level(TOP, _Scope())
        if channel is not None:
            gated["dependent"] = lw.gate(channel)

    with tfp.without_op_tracebacks():
        concrete = tfp.trace_once(build)
    stats = _count_ops(concrete)
    stats.update(nodes=graph.size()["nodes"],
                 switch_cases=sum(len(p.switch_cases) for p in an.plans.values()))
    dependent = gated.get("dependent")
    return Lowered(graph, concrete, lw.feeds, lw.feed_points, lw.case_selects, lw.loop_conds,
                   lw.unrolled, lw.fetches, an.plans, time.perf_counter() - t0, stats,
                   channel if dependent is not None else None, dependent or frozenset(),
                   an.derived, an.runs)
