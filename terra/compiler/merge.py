"""Merge a trace into a TraceGraph (§3.2.2), and test whether a trace is already embedded.

`merge(graph_or_None, trace)` returns a new TraceGraph (the input is never mutated). The walk keeps
a pointer to the latest matched node, starting at `start`. Each op is matched, in this order,
against the children of that node, then (merge-back) against any node of the same level that does
not reach the pointer (so the graph stays a DAG). Outside folded loops, an op that a diff of the op
keys aligns with ops of earlier traces (`_alignment`) is matched against their nodes and the
pointer's children only: keys repeat (a backward pass's ops of one kind share one), and the first
node of the right key is often another block's. A match needs the node's key (type, attrs,
location, function) and compatible data flow: an input `OutputRef(j)` becomes the node trace-op
`j` was matched to, variables compare by key, constants by value. Where the same
slot is fed by different producers on different paths the slot becomes a `Phi`. No match: a new
node (a branch). After the last op the pointer is joined to `end`.

Feeds: a node's `FeedRef` slots are the graph's own numbering, not a trace's: each trace's slots
map one-to-one onto graph slots (`_Merger.slot_map`), a trace slot taking the graph slot of the
first node it matches, or a slot of its own (its own number where no trace used that one yet).
Traces number their feeds in first-use order, so two paths that part after a different number of
fed steps (episodes of different lengths) number every later feed differently; matching slots
by number made each later fed op a node per path, hundreds of one-op switch-cases. The lowering
reuses a feed dequeued in a dominating scope by graph slot, which the map keeps right: a trace
that runs both nodes fed the same slot at both. What Python puts at a feed point is the slot of
the trace's own record there (compiler/plan.py), never the node's.

Loops (`Location.loops`): the records of one run of a loop are grouped by iteration, and every
iteration is merged as one path through the loop node's `body`, a TraceGraph of its own. Inside a
body an input from the previous iteration is a `Prev`; a slot that reads an outer value on the
first iteration and `Prev` later is `Carried` (a while_loop variable). Values used after the loop
are the loop node's `outputs` (last iteration). A loop run is folded only when it is uniform;
otherwise its iterations are unrolled as ordinary nodes (their locations keep iteration numbers):
  1. every in-loop reference goes to the same or the immediately previous iteration, and every
     reference from after the loop goes to its last iteration;
  2. iterations differ in control flow only, not in what they read: after merging, the body holds
     at most one node per key (a loop over variables, one variable per iteration, fails this);
  3. loop-carried slots have one update producer, and per-iteration feeds are used only in the
     loop level that reads them.
A run of one iteration makes no loop node where another trace issued its first op in line at
that point (that trace's run was unrolled, e.g. because a backward pass reads every iteration):
it is unrolled too and shares that trace's first iteration, so the paths part where Python
tells them apart (a `break` after the first pass), not at the loop's start.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass

from terra.ir.records import ConstRef, FeedRef, OutputRef, Trace, VariableRef
from terra.ir.trace_graph import (END, LOOP, OP, START, Carried, FetchPoint, IterFeed, Loop,
                                  Node, NodeOut, Phi, PhiOption, Prev, TraceGraph)

__all__ = ["merge", "covers"]

_TOP = "top"


class _NoFold(Exception):
    """This loop run cannot be folded; unroll it."""


# ------------------------------------------------------------------------ trace structuring
@dataclass(slots=True)
class _Instance:
    """One run of a loop inside a trace: `iterations[k]` are the items (record indices or nested
    `_Instance`s) of iteration k (empty when that iteration issued no op)."""
    uid: int
    loop: str
    depth: int
    first: int
    last: int
    iterations: list
    ranges: list  # (first, last) record index of each iteration, None when empty


def _callers(loc, depth: int, cache: dict):
    """The call sites down to the frame that runs `loc.loops[depth]` (None: not found). A run of
    that loop ends where they change: two calls of one function from different call sites
    (a Keras trunk, then a head, each a functional model looping over its layers) both start at
    pass 0, and without this their ops would be one pass of one run."""
    key = (id(loc), depth)
    got = cache.get(key, cache)
    if got is cache:
        frames, fi = loc.frames, 0
        for lp in loc.loops[:depth + 1]:
            label = lp.loop.rsplit("@", 1)[0]
            while fi < len(frames) and frames[fi].rsplit("@", 1)[0] != label:
                fi += 1
        got = cache[key] = frames[:fi] if fi < len(frames) else None
    return got


def _structure(records, idxs, depth, counter, cache=None):
    cache = {} if cache is None else cache  # (`_callers`; the records keep their locations)
    items, i = [], 0
    while i < len(idxs):
        loc = records[idxs[i]].location
        loops = loc.loops
        if len(loops) <= depth:
            items.append(idxs[i])
            i += 1
            continue
        lid, groups, last_it, j = loops[depth].loop, {}, -1, i
        callers = _callers(loc, depth, cache)
        while j < len(idxs):
            loc_j = records[idxs[j]].location
            lp = loc_j.loops
            if len(lp) <= depth or lp[depth].loop != lid or lp[depth].iteration < last_it:
                break
            if loc_j is not loc and _callers(loc_j, depth, cache) != callers:
                break
            last_it = lp[depth].iteration
            groups.setdefault(last_it, []).append(idxs[j])
            j += 1
        uid = next(counter)
        iters = [_structure(records, groups.get(k, []), depth + 1, counter, cache)
                 for k in range(last_it + 1)]
        ranges = [(g[0], g[-1]) if (g := groups.get(k)) else None for k in range(last_it + 1)]
        items.append(_Instance(uid, lid, depth, idxs[i], idxs[j - 1], iters, ranges))
        i = j
    return items


def _instances(items):
    for it in items:
        if isinstance(it, _Instance):
            yield it
            for body in it.iterations:
                yield from _instances(body)


def _refs(arg):
    if isinstance(arg, tuple):
        for a in arg:
            yield from _refs(a)
    else:
        yield arg


def _unfoldable(trace, items) -> set:
    """Rule 1 (see module doc), checked on the trace: uids of loop runs that cannot fold."""
    where = {}  # record index -> [(instance, iteration position)] outermost first
    for inst in _instances(items):
        for pos, rng in enumerate(inst.ranges):
            if rng:
                for k in range(rng[0], rng[1] + 1):
                    if len(trace.records[k].location.loops) > inst.depth:
                        where.setdefault(k, []).append((inst, pos))
    bad = set()
    for r in trace.records:
        rw = dict((inst.uid, pos) for inst, pos in where.get(r.index, ()))
        for ref in _refs(r.inputs):
            if not isinstance(ref, OutputRef):
                continue
            for inst, pos in where.get(ref.record, ()):
                if inst.uid in rw:
                    if rw[inst.uid] - pos not in (0, 1):
                        bad.add(inst.uid)
                elif pos != len(inst.iterations) - 1:
                    bad.add(inst.uid)
    return bad


def _const_slots(rec) -> tuple:
    """(input structure, {position: VariableRef or ConstRef}) of a record."""
    shape, consts = [], {}
    for a, arg in enumerate(rec.inputs):
        items = arg if isinstance(arg, tuple) else (arg,)
        shape.append(len(items) if isinstance(arg, tuple) else None)
        for k, ref in enumerate(items):
            if isinstance(ref, (VariableRef, ConstRef)):
                consts[(a, k)] = ref
    return tuple(shape), consts


def _conflicts(trace, inst, recs) -> bool:
    """Whether two of `recs` (records that land on the body level of `inst` if it folds) have the
    same key but differ in a variable or constant input, or in input structure. No node takes
    both (a variable/constant slot only ever matches itself, or a `Carried` starting from it),
    so the body would hold two nodes with one key: rule 2 fails whatever the graph holds."""
    folded = frozenset(range(inst.depth + 1))  # (outer iterations are equal within `inst`)
    groups = {}
    for k in recs:
        rec = trace.records[k]
        groups.setdefault(Node.op_key(rec, folded), []).append(rec)
    for group in groups.values():
        if len(group) < 2:
            continue
        shape, seen = None, {}
        for rec in group:
            sh, consts = _const_slots(rec)
            if shape is None:
                shape = sh
            elif sh != shape:
                return True
            for pos, ref in consts.items():
                if seen.setdefault(pos, ref) != ref:
                    return True
    return False


def _hopeless(trace, items, bad: set) -> set:
    """Uids of loop runs that rule 2 rejects for sure, found on the trace alone (cheap), so no
    fold is attempted: e.g. a loop over variables, one variable read per iteration. Only records
    certain to land on a body level are compared: its direct records, and those of nested runs
    that are unrolled for sure (recursively)."""
    out = set()

    def level(items) -> list:
        recs = []
        for it in items:
            if not isinstance(it, _Instance):
                recs.append(it)
                continue
            inner = [r for body in it.iterations for r in level(body)]
            if it.uid in bad or _conflicts(trace, it, inner):
                if it.uid not in bad:
                    out.add(it.uid)
                recs.extend(inner)  # unrolled: its records land here
        return recs
    level(items)
    return out


# ---------------------------------------------------------------------- mutable working state
class _MNode:
    __slots__ = ("id", "kind", "op", "inputs", "seen", "fetches", "level", "first_iter",
                 "later_iter", "folded", "loop_key", "body", "outputs", "trip_counts")

    def __init__(self, id, kind, level, op=None, inputs=()):
        self.id, self.kind, self.level, self.op, self.inputs = id, kind, level, op, list(inputs)
        self.seen, self.fetches, self.first_iter, self.later_iter = {}, set(), False, False
        self.folded = frozenset()
        self.loop_key, self.body, self.outputs, self.trip_counts = None, None, [], {}


class _MLevel:
    __slots__ = ("id", "start", "end", "edges", "succ", "pred", "nodes", "members", "log")

    def __init__(self, id, start, end, log=None):
        self.id, self.start, self.end = id, start, end
        self.edges, self.succ, self.pred, self.nodes = [], {start: [], end: []}, {start: [], end: []}, [start, end]
        self.members = {start, end}  # = set(nodes), for membership tests
        self.log = log if log is not None else []

    def add_edge(self, a, b):
        if b not in self.succ[a]:
            self.edges.append((a, b))
            self.succ[a].append(b)
            self.pred[b].append(a)
            self.log.append((_undo_edge, self, a, b))

    def reaches(self, a, b) -> bool:
        seen, stack = set(), [a]
        while stack:
            n = stack.pop()
            if n == b:
                return True
            if n not in seen:
                seen.add(n)
                stack.extend(self.succ[n])
        return False


_MISSING = object()


def _undo_edge(lv, a, b):
    lv.edges.pop()
    lv.succ[a].pop()
    lv.pred[b].pop()


def _undo_item(d, k, old):
    if old is _MISSING:
        del d[k]
    else:
        d[k] = old


def _undo_append(d, k, created):
    lst = d[k]
    lst.pop()
    if created:
        del d[k]


def _undo_node(st, level, n, old_next_id):
    st.next_id = old_next_id
    del st.nodes[n.id]
    bk = (level.id, st.keys.pop(n.id))
    st.bykey[bk].pop()
    if not st.bykey[bk]:
        del st.bykey[bk]
    level.nodes.pop()
    level.members.discard(n.id)
    del level.succ[n.id], level.pred[n.id]


class _State:
    """The graph being merged into, mutated in place. Every mutation during the walk goes through
    the methods here (or `_MLevel.add_edge`) and appends its inverse to `log`, so a failed loop
    fold attempt is undone in time proportional to what it did (`rollback(mark())`), instead of
    copying the whole graph before each attempt."""

    def __init__(self):
        self.levels, self.nodes, self.keys = {}, {}, {}  # keys: node id -> key (cached)
        self.bykey = {}  # (level id, key) -> node ids
        self.next_id = 2
        self.node_of, self.chain_of, self.loop_node_of = {}, {}, {}
        self.log = []  # undo entries: (function, *args)

    # ---- undo log
    def mark(self) -> int:
        return len(self.log)

    def rollback(self, mark: int):
        log = self.log
        while len(log) > mark:
            f, *args = log.pop()
            f(*args)

    def set_item(self, d: dict, k, v):
        self.log.append((_undo_item, d, k, d.get(k, _MISSING)))
        d[k] = v

    def set_attr(self, obj, name, v):
        self.log.append((setattr, obj, name, getattr(obj, name)))
        setattr(obj, name, v)

    def append_to(self, d: dict, k, v):
        """`d.setdefault(k, []).append(v)`, undoably."""
        lst = d.get(k)
        self.log.append((_undo_append, d, k, lst is None))
        if lst is None:
            lst = d[k] = []
        lst.append(v)

    def append(self, lst: list, v):
        self.log.append((list.pop, lst))
        lst.append(v)

    # ---- structure
    def new_level(self, lid, start, end):
        lv = _MLevel(lid, start, end, self.log)
        self.set_item(self.levels, lid, lv)
        return lv

    def new_node(self, level, kind, key, op=None, inputs=()):
        n = _MNode(self.next_id, kind, level.id, op, inputs)
        self.log.append((_undo_node, self, level, n, self.next_id))
        self.next_id += 1
        self.nodes[n.id], self.keys[n.id] = n, key
        self.bykey.setdefault((level.id, key), []).append(n.id)
        level.nodes.append(n.id)
        level.members.add(n.id)
        level.succ[n.id], level.pred[n.id] = [], []
        return n


@dataclass(frozen=True, slots=True)
class _Ctx:
    """Where the walk is: `chain` = ((instance uid, iteration position), ...) of the folded loop
    runs enclosing this level, outermost first; `folded` their depths; `level` the level id."""
    level: object
    chain: tuple = ()
    folded: frozenset = frozenset()
    feeds: tuple = ()  # per-iteration feed slots of the innermost iteration, in first-use order
    spans: tuple = ()  # (first, last) record index of each loop run in `chain`

    @property
    def iter_pos(self):
        return self.chain[-1][1] if self.chain else None


# ------------------------------------------------------------------------- thaw and freeze
def _thaw(g: TraceGraph) -> _State:
    st = _State()
    st.next_id = g.next_id

    def level(lid, tg):
        lv = _MLevel(lid, tg.start, tg.end, st.log)
        st.levels[lid] = lv
        for n in tg.nodes.values():
            if n.kind in (START, END):
                continue
            m = _MNode(n.id, n.kind, lid, n.op, n.inputs)
            m.seen = {t: list(v) for t, v in n.seen.items()}
            m.fetches, m.first_iter, m.later_iter = set(n.fetches), n.first_iter, n.later_iter
            m.folded = n.folded
            if n.kind == LOOP:
                m.loop_key, m.outputs = n.loop.key, list(n.loop.outputs)
                m.trip_counts = {t: list(v) for t, v in n.loop.trip_counts.items()}
                m.body = n.id
                level(n.id, n.loop.body)
            st.nodes[n.id], st.keys[n.id] = m, n.key
            st.bykey.setdefault((lid, n.key), []).append(n.id)
            lv.nodes.append(n.id)
            lv.members.add(n.id)
            lv.succ[n.id], lv.pred[n.id] = [], []
        for a, b in tg.edges:
            lv.add_edge(a, b)
    level(_TOP, g)
    st.log.clear()
    return st


def _freeze(st: _State, lid, num_traces) -> TraceGraph:
    lv = st.levels[lid]
    nodes = {lv.start: Node(lv.start, START), lv.end: Node(lv.end, END)}
    for nid in lv.nodes:
        m = st.nodes.get(nid)
        if m is None:
            continue
        seen = {t: tuple(v) for t, v in m.seen.items()}
        loop = None
        if m.kind == LOOP:
            loop = Loop(m.loop_key, _freeze(st, nid, num_traces), tuple(m.outputs),
                        {t: tuple(v) for t, v in m.trip_counts.items()})
        nodes[nid] = Node(nid, m.kind, m.op, tuple(m.inputs), seen, frozenset(m.fetches), loop,
                          m.first_iter, m.later_iter, m.folded)
    return TraceGraph(nodes, tuple(lv.edges), lv.start, lv.end, num_traces, st.next_id)


# ---------------------------------------------------------------------------------- merging
@dataclass(frozen=True, slots=True)
class _Pending:
    """A trace's feed slot not yet mapped to a graph slot (see the module docstring); never
    left in a node: `_Merger.bind` resolves it."""
    slot: int


def _graph_slots(st: _State) -> set:
    out = set()

    def scan(s):
        if isinstance(s, tuple):
            for a in s:
                scan(a)
        elif isinstance(s, FeedRef):
            out.add(s.slot)
        elif isinstance(s, Carried):
            scan(s.init)
    for n in st.nodes.values():
        scan(tuple(n.inputs))
    return out


class _Merger:
    def __init__(self, st: _State, trace: Trace, tid: int, bad: set, hints=None):
        self.st, self.trace, self.tid, self.bad = st, trace, tid, bad
        self.hints = hints or {}  # record index -> aligned node ids (see `_alignment`)
        # level id -> {node id: node} this walk has passed through since the level's start:
        # each reaches the pointer, which `reaches` would otherwise find by a search per
        # candidate (a trace's ops of one key, all earlier on its own path, made merging one
        # 1347-op trace quadratic: 0.8 s)
        self.trail = {}
        self.first_feed_use = {}
        # this trace's feed slot -> graph slot, and back (one-to-one; undone with a failed fold)
        self.slot_map, self.slot_owner = {}, {}
        self.used_slots = _graph_slots(st)
        self.next_slot = max(self.used_slots, default=-1) + 1
        for r in trace.records:
            for ref in _refs(r.inputs):
                if isinstance(ref, FeedRef):
                    self.first_feed_use.setdefault(ref.slot, r.index)

    # ---- walking
    def walk(self, items, ctx: _Ctx, cur: int) -> int:
        for it in items:
            cur = self.loop(it, ctx, cur) if isinstance(it, _Instance) else self.op(it, ctx, cur)
        return cur

    def candidates(self, lv: _MLevel, cur: int, key):
        """Children of `cur` with `key`, then (lazily) merge-back targets: other nodes of the
        level with `key` that do not reach `cur`."""
        kids = [n for n in lv.succ[cur] if self.st.keys.get(n) == key]
        back = (n for n in self.st.bykey.get((lv.id, key), ())
                if n not in kids and n != cur and not self.reaches(lv, n, cur))
        return kids, back

    def reaches(self, lv: _MLevel, n: int, cur: int) -> bool:
        trail = self.trail.get(lv.id)
        if trail is not None and n in trail and trail[n] is self.st.nodes.get(n):
            return True
        return lv.reaches(n, cur)

    def passed(self, lv: _MLevel, cur: int, node) -> None:
        """The walk went from `cur` to `node` on level `lv` (see `trail`)."""
        trail = self.trail.get(lv.id)
        if trail is None or cur == lv.start:
            trail = self.trail[lv.id] = {}
        trail[node.id] = node

    def op(self, idx: int, ctx: _Ctx, cur: int) -> int:
        st, rec = self.st, self.trace.records[idx]
        lv = st.levels[ctx.level]
        key = Node.op_key(rec, ctx.folded)
        srcs = tuple(self.source(a, ctx) for a in rec.inputs)
        chosen = None
        groups = self.candidates(lv, cur, key)  # children first, then merge-back targets
        hinted = idx in self.hints and not ctx.chain
        if hinted:
            # aligned with earlier traces: their nodes, a child, or a new node (a folded loop's
            # body is matched per iteration instead: an iteration the other trace lacks is new
            # to the diff but not to the body)
            kids = groups[0]
            usable = [h for h in self.hints[idx] if st.keys.get(h) == key and h in lv.members and (
                h in kids or (h != cur and not self.reaches(lv, h, cur)))]
            groups = (usable, kids)
        for group in groups:
            for n in group:
                fit = self.compat(st.nodes[n], srcs, ctx, idx)
                if fit and not fit[1] and not fit[2]:
                    chosen = (n, fit)  # exact: nothing to add
                    break
                if fit and chosen is None:
                    chosen = (n, fit)
            if chosen is not None:
                break
        if hinted and (chosen is None or chosen[1][1]):
            chosen = self.same_inputs(lv, cur, key, srcs, ctx, idx) or chosen
        if chosen is None:
            node = st.new_node(lv, OP, key, rec, self.bind(srcs, {}))
            node.folded = ctx.folded  # (a new node: undone with it)
        else:
            node = st.nodes[chosen[0]]
            st.set_attr(node, "inputs", list(self.bind(tuple(chosen[1][0]), chosen[1][2])))
        self.visit(node, ctx, idx)
        lv.add_edge(cur, node.id)
        self.passed(lv, cur, node)
        st.set_item(st.node_of, idx, node.id)
        st.set_item(st.chain_of, idx, ctx.chain)
        return node.id

    def same_inputs(self, lv: _MLevel, cur: int, key, srcs, ctx, idx):
        """(node, fit) of a node of `key` anywhere on the level (not reaching `cur`) that reads
        exactly what the record reads, else None. Where the diff of the keys aligned an op with
        another block's (a backward pass of repeated steps, aligned from its first step when
        the second trace has fewer: each step's gradient reads its own step's forward values),
        the aligned node needs a new phi or a node of its own, while the step's own node takes
        the op as it is."""
        for n in self.st.bykey.get((lv.id, key), ()):
            if n == cur:
                continue
            fit = self.compat(self.st.nodes[n], srcs, ctx, idx)
            if fit and not fit[1] and (n in lv.succ[cur] or not self.reaches(lv, n, cur)):
                return n, fit
        return None

    def visit(self, node: _MNode, ctx: _Ctx, idx: int):
        st = self.st
        st.append_to(node.seen, self.tid, idx)
        if ctx.chain:
            flag = "first_iter" if ctx.iter_pos == 0 else "later_iter"
            if not getattr(node, flag):
                st.set_attr(node, flag, True)

    def loop(self, inst: _Instance, ctx: _Ctx, cur: int) -> int:
        st = self.st
        lv = st.levels[ctx.level]
        lkey = self.loop_key(inst, ctx)
        if inst.uid not in self.bad:
            kids, back = self.candidates(lv, cur, (LOOP, lkey))
            for nid in kids + list(back) + ([] if self.stays_in_line(inst, ctx, cur) else [None]):
                mark, trail = st.mark(), {k: dict(v) for k, v in self.trail.items()}
                try:
                    node = st.nodes[nid] if nid is not None else self.new_loop(lv, lkey)
                    self.fold(node.id, inst, ctx)
                except _NoFold:
                    st.rollback(mark)
                    self.trail = trail
                    continue
                self.visit(node, ctx, inst.first)
                st.append_to(node.trip_counts, self.tid, len(inst.iterations))
                st.set_item(st.loop_node_of, inst.uid, node.id)
                lv.add_edge(cur, node.id)
                self.passed(lv, cur, node)
                return node.id
        for body in inst.iterations:  # unroll
            cur = self.walk(body, ctx, cur)
        return cur

    def loop_key(self, inst: _Instance, ctx: _Ctx) -> tuple:
        first = self.trace.records[inst.first]
        enclosing = tuple(l.loop if d in ctx.folded else l for d, l in
                          enumerate(first.location.loops[:inst.depth]))
        return (inst.loop, enclosing, first.location.frames)

    def stays_in_line(self, inst: _Instance, ctx: _Ctx, cur: int) -> bool:
        """A run of one iteration whose first op another trace issued in line right here (its
        loop run was unrolled: a backward pass reading every iteration keeps a run from
        folding) is unrolled too, to merge with that trace's first iteration. A loop node of
        its own would part the two paths at the loop's start, before Python tells them apart."""
        if len(inst.iterations) != 1 or not inst.iterations[0]:
            return False
        first = inst.iterations[0][0]  # its key, in line here (ctx: this run unrolled)
        key = (LOOP, self.loop_key(first, ctx)) if isinstance(first, _Instance) else \
            Node.op_key(self.trace.records[first], ctx.folded)
        lv = self.st.levels[ctx.level]
        return any(self.st.keys.get(n) == key for n in lv.succ[cur])

    def new_loop(self, lv, lkey):
        st = self.st
        node = st.new_node(lv, LOOP, (LOOP, lkey))
        node.loop_key, node.body = lkey, node.id  # (a new node: undone with it)
        st.new_level(node.id, st.next_id, st.next_id + 1)
        st.set_attr(st, "next_id", st.next_id + 2)
        return node

    def fold(self, body_id, inst: _Instance, ctx: _Ctx):
        """Merge every iteration of `inst` into the body level `body_id`."""
        for pos, items in enumerate(inst.iterations):
            rng = inst.ranges[pos]
            feeds = () if rng is None else tuple(sorted(
                (s for s, f in self.first_feed_use.items() if rng[0] <= f <= rng[1]),
                key=self.first_feed_use.get))
            sub = _Ctx(body_id, ctx.chain + ((inst.uid, pos),), ctx.folded | {inst.depth}, feeds,
                       ctx.spans + ((inst.first, inst.last),))
            last = self.walk(items, sub, self.st.levels[body_id].start)
            body = self.st.levels[body_id]
            body.add_edge(last, body.end)
        body = self.st.levels[body_id]
        keys = [self.st.keys[n] for n in body.nodes if n not in (body.start, body.end)]
        if len(keys) != len(set(keys)):
            raise _NoFold("iterations read different data")

    # ---- data flow
    def source(self, arg, ctx: _Ctx):
        if isinstance(arg, tuple):
            return tuple(self.source(a, ctx) for a in arg)
        if isinstance(arg, OutputRef):
            return self.translate(arg.record, arg.index, ctx)
        if isinstance(arg, FeedRef):
            if arg.slot in ctx.feeds:
                return IterFeed(ctx.feeds.index(arg.slot))
            first = self.first_feed_use[arg.slot]
            if any(a <= first <= b for a, b in ctx.spans):
                raise _NoFold(f"feed{arg.slot} is fed by another iteration")
            mapped = self.slot_map.get(arg.slot)
            return FeedRef(mapped) if mapped is not None else _Pending(arg.slot)
        if isinstance(arg, (VariableRef, ConstRef)):
            return arg
        raise TypeError(f"unknown input ref {arg!r}")

    def translate(self, j: int, i: int, ctx: _Ctx):
        st = self.st
        if j not in st.node_of:
            raise ValueError(f"trace {self.trace.site!r}: record refers to %{j}, which is not an "
                             f"earlier record")
        cj, cr = st.chain_of[j], ctx.chain
        k = 0
        while k < len(cj) and k < len(cr) and cj[k] == cr[k]:
            k += 1
        if k == len(cj):
            return NodeOut(st.node_of[j], i)
        uid, pos = cj[k]
        if k < len(cr) and cr[k][0] == uid:
            if pos != cr[k][1] - 1:
                raise _NoFold("reference to an iteration before the previous one")
            v = self.inside(cj, k + 1, j, i)
            return Prev(v.node, v.index)
        v = self.inside(cj, k + 1, j, i)
        return NodeOut(st.loop_node_of[uid], self.export(st.loop_node_of[uid], v))

    def inside(self, cj, m, j, i):
        if m == len(cj):
            return NodeOut(self.st.node_of[j], i)
        uid = cj[m][0]
        v = self.inside(cj, m + 1, j, i)
        return NodeOut(self.st.loop_node_of[uid], self.export(self.st.loop_node_of[uid], v))

    def export(self, loop_id, v):
        outs = self.st.nodes[loop_id].outputs
        if v not in outs:
            self.st.append(outs, v)
        return outs.index(v)

    # ---- feed slots
    def fresh_slot(self, slot: int) -> int:
        """A graph slot for trace slot `slot` that no node and no other slot of this trace
        uses: `slot` itself where free (the first trace keeps its numbering)."""
        if slot not in self.used_slots and slot not in self.slot_owner:
            return slot
        while self.next_slot in self.used_slots or self.next_slot in self.slot_owner:
            self.st.set_attr(self, "next_slot", self.next_slot + 1)
        return self.next_slot

    def bind(self, srcs, pairs: dict):
        """`srcs` with every `_Pending` slot mapped: by `pairs` (trace slot -> graph slot, what
        the chosen node's match needs), else to a fresh graph slot; the map records both."""
        st = self.st
        for b, a in pairs.items():
            st.set_item(self.slot_map, b, a)
            st.set_item(self.slot_owner, a, b)

        def res(s):
            if isinstance(s, tuple):
                return tuple(res(a) for a in s)
            if isinstance(s, Carried):
                return Carried(res(s.init), s.update)
            if not isinstance(s, _Pending):
                return s
            a = self.slot_map.get(s.slot)
            if a is None:
                a = self.fresh_slot(s.slot)
                st.set_item(self.slot_map, s.slot, a)
                st.set_item(self.slot_owner, a, s.slot)
            return FeedRef(a)
        return res(srcs)

    def feed_fits(self, s, n, pairs: dict) -> bool:
        """Whether trace slot `n` (a `_Pending`) can take graph slot `s` (a FeedRef) here: `s`
        is no other slot's of this trace, nor claimed by another input of the record."""
        if not (isinstance(s, FeedRef) and isinstance(n, _Pending)):
            return False
        if s.slot in self.slot_owner:
            return False
        got = pairs.get(n.slot)
        if got is not None:
            return got == s.slot
        if s.slot in pairs.values():
            return False
        pairs[n.slot] = s.slot
        return True

    def compat(self, node: _MNode, srcs, ctx, idx):
        """(merged inputs, changed, feed slot pairs) if the record's sources fit `node`, else
        None. The pairs (trace slot -> graph slot) are what the match maps (`bind`)."""
        old = node.inputs
        if len(old) != len(srcs):
            return None
        out, changed, pairs = [], False, {}
        for s, n in zip(old, srcs):
            if isinstance(s, tuple) or isinstance(n, tuple):
                if not (isinstance(s, tuple) and isinstance(n, tuple) and len(s) == len(n)):
                    return None
                items = []
                for a, b in zip(s, n):
                    r = self.slot(node, a, b, ctx, idx, pairs)
                    if r is None:
                        return None
                    items.append(r[0])
                    changed |= r[1]
                out.append(tuple(items))
            else:
                r = self.slot(node, s, n, ctx, idx, pairs)
                if r is None:
                    return None
                out.append(r[0])
                changed |= r[1]
        return out, changed, pairs

    def slot(self, node, s, n, ctx, idx, pairs):
        if s == n or self.feed_fits(s, n, pairs):
            return s, False
        if isinstance(s, Carried):
            want = s.init if ctx.iter_pos == 0 else s.update
            return (s, False) if n == want or self.feed_fits(want, n, pairs) else None
        local = self.st.levels[node.level].members
        if isinstance(s, Phi):
            if not (isinstance(n, NodeOut) and n.node in local):
                return None
            sources = [o.source for o in s.options]
            cand = sources if n in sources else sources + [n]
            if any(o.source.node == n.node and o.source != n for o in s.options):
                return None
            if not self.phi_ok(s.options, n, cand, idx):
                return None
            opts = [PhiOption(o.source, o.visits | {(self.tid, idx)}) if o.source == n else o
                    for o in s.options]
            if n not in sources:
                opts.append(PhiOption(n, frozenset({(self.tid, idx)})))
            return Phi(tuple(opts)), n not in sources
        if (isinstance(s, NodeOut) and isinstance(n, NodeOut) and s.node != n.node
                and s.node in local and n.node in local):
            visits = frozenset((t, v) for t, vs in node.seen.items() for v in vs)
            opts = (PhiOption(s, visits),)
            if not self.phi_ok(opts, n, [s, n], idx):
                return None
            return Phi(opts + (PhiOption(n, frozenset({(self.tid, idx)})),)), True
        if ctx.chain and node.level == ctx.level:
            if isinstance(n, Prev) and n.node in local and self.init_ok(s, local):
                if ctx.iter_pos > 0 and not node.later_iter:
                    return Carried(s, n), True
            elif isinstance(s, Prev) and s.node in local and self.init_ok(n, local):
                if ctx.iter_pos == 0 and not node.first_iter:
                    return Carried(n, s), True
        return None

    @staticmethod
    def init_ok(src, local):
        return not isinstance(src, (Prev, Carried, Phi, IterFeed)) and not (
            isinstance(src, NodeOut) and src.node in local)

    def phi_ok(self, options, new, cand, idx) -> bool:
        """Adding `new` keeps every recorded visit resolving to its option, and the current visit
        (trace `tid`, record `idx`) resolves to `new` (the last producer to run wins)."""
        for o in options:
            for t, v in o.visits:
                if self.resolve(t, v, cand) != o.source:
                    return False
        return self.resolve(self.tid, idx, cand) == new

    def resolve(self, t, at, cand):
        best, best_pos = None, -1
        for src in cand:
            pos = max((p for p in self.st.nodes[src.node].seen.get(t, ()) if p < at), default=-1)
            if pos > best_pos:
                best, best_pos = src, pos
        return best


# ------------------------------------------------------------------------------- public API
def _check_trace(trace):
    if not isinstance(trace, Trace):
        raise TypeError(f"merge expects a terra.ir.records.Trace, got {type(trace).__name__}")
    if trace.unsupported:
        raise ValueError(f"trace {trace.site!r} has unsupported ops {trace.unsupported!r}; "
                         f"it cannot be compiled")
    for k, r in enumerate(trace.records):
        if r.index != k:
            raise ValueError(f"trace {trace.site!r}: record at position {k} has index {r.index}")


_DIFFED = 3  # earlier traces a new trace is diffed against (see `_alignment`)


def _loose(key):
    """An op key without its attrs, for the common ends of two traces: an op of another arity
    (`AddN` over one gradient per step of an episode of another length) is the same program
    point, and stopping there left a backward pass of repeated steps to the diff, which aligned
    its first steps, not its last (each step's gradient reads its own step's forward values)."""
    return key[:2] + key[3:]


def _alignment(st: _State, trace: Trace, num_traces: int) -> dict:
    """Record index -> the nodes its op is aligned with in the earlier traces (most similar
    trace first; empty for an op no earlier trace has at that point: an inserted op).

    Keys need not be unique: a backward pass calls each gradient function from one TF frame, so
    all of its ops of one kind share a key and only data flow tells them apart. Without the
    alignment the walk took the first node of the right key that kept the graph a DAG: past an
    op that differs (a division by another count, an extra resize's gradient) an op merged into
    another block's op of its kind, and the ops after it missed their own nodes: two 1347-op
    paths of a residual CNN made 1600 nodes, 578 of them on one path only (with it: 1328 and
    34, the ops that do differ).
    Each alignment is a diff of the op keys against one earlier trace, after their common
    prefix and suffix (compared without attrs: `_loose`)."""
    if num_traces == 0:
        return {}
    seqs = {t: {} for t in range(num_traces)}
    for nid, node in st.nodes.items():
        if node.op is None:
            continue
        for t, idxs in node.seen.items():
            for i in idxs:
                seqs[t][i] = nid
    mine = [Node.op_key(r) for r in trace.records]  # a folded loop's ops match no node: no hint
    loose_mine = [_loose(k) for k in mine]
    n = len(mine)
    ends = []
    for t, m in seqs.items():
        ref = [m[i] for i in sorted(m)]
        keys = [st.keys[k] for k in ref]
        loose = [_loose(k) for k in keys]
        pre = 0
        while pre < min(len(keys), n) and loose[pre] == loose_mine[pre]:
            pre += 1
        suf = 0
        while suf < min(len(keys), n) - pre and loose[-1 - suf] == loose_mine[-1 - suf]:
            suf += 1
        ends.append((pre + suf, -t, ref, keys, pre, suf))
    # a diff against every earlier trace costs their number squared over a site's builds: the
    # traces that share the most at both ends are diffed, the others only if nothing is between
    ends.sort(key=lambda e: e[:2], reverse=True)
    found = []
    for rank, (_, t, ref, keys, pre, suf) in enumerate(ends):
        if rank >= _DIFFED and pre + suf < max(len(keys), n):
            continue
        pairs = [(i, ref[i]) for i in range(pre)]
        pairs += [(n - 1 - k, ref[len(ref) - 1 - k]) for k in range(suf)]
        sm = difflib.SequenceMatcher(None, keys[pre:len(keys) - suf], mine[pre:n - suf],
                                     autojunk=False)
        for a, b, size in sm.get_matching_blocks():
            pairs += [(pre + b + k, ref[pre + a + k]) for k in range(size)]
        found.append((len(pairs), t, pairs))
    hints = {i: [] for i in range(n)}
    for _, _, pairs in sorted(found, key=lambda f: f[:2], reverse=True):
        for i, node in pairs:
            if node not in hints[i]:
                hints[i].append(node)
    return hints


def merge(graph, trace: Trace) -> TraceGraph:
    """Return a new TraceGraph that embeds `trace` (trace id = `graph.num_traces`)."""
    if graph is None:
        graph = TraceGraph.empty()
    if not isinstance(graph, TraceGraph):
        raise TypeError(f"merge expects a TraceGraph or None, got {type(graph).__name__}")
    _check_trace(trace)
    st = _thaw(graph)
    items = _structure(trace.records, list(range(len(trace.records))), 0, iter(range(1 << 62)))
    bad = _unfoldable(trace, items)
    m = _Merger(st, trace, graph.num_traces, bad | _hopeless(trace, items, bad),
                _alignment(st, trace, graph.num_traces))
    last = m.walk(items, _Ctx(_TOP), st.levels[_TOP].start)
    top = st.levels[_TOP]
    top.add_edge(last, top.end)
    for f in trace.fetches:
        node = st.nodes[st.node_of[f.ref.record]]
        after = st.node_of[f.after_record - 1] if f.after_record > 0 else top.start
        node.fetches.add(FetchPoint(f.ref.index, f.how, after))
    new = _freeze(st, _TOP, graph.num_traces + 1)
    from terra.ir import verify
    if verify.debug_enabled():
        verify.verify(new)
    return new


def shape_key(g: TraceGraph):
    """Structure and data flow of a graph, without the per-trace bookkeeping: equal keys mean
    merging a trace added no node and no edge (the lowered graph covers it)."""
    def src(s):
        if isinstance(s, tuple):
            return tuple(map(src, s))
        return ("phi", tuple(o.source for o in s.options)) if isinstance(s, Phi) else s
    out = []
    for n in g.nodes.values():
        body = shape_key(n.loop.body) + (n.loop.outputs,) if n.kind == LOOP else None
        out.append((n.id, n.key, tuple(map(src, n.inputs)), frozenset(
            (f.index, f.how, f.after) for f in n.fetches), body))
    return (tuple(sorted(out, key=lambda x: x[0])), frozenset(g.edges))


def _trip_counts(g: TraceGraph) -> dict:
    out = {}
    for n in g.nodes.values():
        if n.kind == LOOP:
            out[n.id] = n.loop.seen_trip_counts
            out.update(_trip_counts(n.loop.body))
    return out


def covers(graph, trace: Trace, *, exact_trip_counts: bool = False) -> bool:
    """Whether `trace` is already embedded: merging it would add no node, edge, phi option,
    loop-carried slot, loop output or fetch point. With `exact_trip_counts`, every loop must also
    have run a trip count already seen (for lowerings that unroll loops)."""
    if graph is None:
        return False
    merged = merge(graph, trace)
    if shape_key(merged) != shape_key(graph):
        return False
    return not exact_trip_counts or _trip_counts(merged) == _trip_counts(graph)
