"""The TraceGraph (§3.2.2): a DAG of ops merged from many traces, with loop nodes.

Plain data only. `terra.compiler.merge` builds it, `terra.compiler.case_assignment` turns it into
switch-cases, the lowering turns those into one TF graph. Node ids are unique across the whole
graph, loop bodies included, so a `NodeOut` is unambiguous wherever it appears.

Sources (what feeds one input of a node):
- `NodeOut(n, i)`: output `i` of node `n` on the current path (same graph level, or an enclosing
  level: a loop body may read values computed before the loop). For a loop node `n`, output `i`
  is `n.loop.outputs[i]`, a body value as of the loop's last iteration.
- `Prev(n, i)`: output `i` of body node `n` in the previous iteration of the enclosing loop.
- `Carried(init, update)`: a loop-carried value: `init` on the first iteration, `update` (a `Prev`)
  on every later one. Lowers to a while_loop variable.
- `Phi(options)`: the producer depends on the path taken (an SSA phi). On a given path it is the
  option whose producer ran last before this node (producers are nodes of the same level). Each
  option lists the trace ids that used it.
- `records.VariableRef`, `records.ConstRef`, `records.FeedRef` (feed slot of the trace), and
  `IterFeed(k)`: the k-th new feed of the current loop iteration (a per-iteration Input-Feeding).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from terra.ir.records import FeedRef, Location, LoopIter, OpRecord

START, END, OP, LOOP = "start", "end", "op", "loop"


# ------------------------------------------------------------------------------------- sources
@dataclass(frozen=True, slots=True)
class NodeOut:
    node: int
    index: int = 0

    def __repr__(self) -> str:
        return f"n{self.node}:{self.index}" if self.index else f"n{self.node}"


@dataclass(frozen=True, slots=True)
class Prev:
    node: int
    index: int = 0

    def __repr__(self) -> str:
        return f"prev(n{self.node}:{self.index})" if self.index else f"prev(n{self.node})"


@dataclass(frozen=True, slots=True)
class IterFeed:
    ordinal: int

    def __repr__(self) -> str:
        return f"iterfeed{self.ordinal}"


@dataclass(frozen=True, slots=True)
class Carried:
    init: object  # a Source that is not Prev/Carried/Phi
    update: Prev

    def __repr__(self) -> str:
        return f"carried({self.init!r} -> {self.update!r})"


@dataclass(frozen=True, slots=True)
class PhiOption:
    source: NodeOut
    visits: frozenset  # of (trace id, record index of the consuming node's visit)

    @property
    def traces(self) -> frozenset:
        return frozenset(t for t, _ in self.visits)

    def __repr__(self) -> str:
        return f"{self.source!r}<-t{{{','.join(map(str, sorted(self.traces)))}}}"


@dataclass(frozen=True, slots=True)
class Phi:
    options: tuple  # of PhiOption, in the order they were found

    def __repr__(self) -> str:
        return "phi(" + ", ".join(map(repr, self.options)) + ")"


# ---------------------------------------------------------------------------------- annotations
@dataclass(frozen=True, slots=True)
class FetchPoint:
    """Python read output `index` of this node (`how`: numpy, bool, ...) right after node `after`
    had run (the node of the last record before the fetch). Becomes an Output-Fetching op."""
    index: int
    how: str
    after: int

    def __repr__(self) -> str:
        return f"fetch:{self.index}({self.how}, after n{self.after})"


# --------------------------------------------------------------------------------------- nodes
@dataclass(frozen=True, slots=True)
class Loop:
    """A folded Python loop: every iteration is a path through `body` (its own TraceGraph).

    `key` is (loop id, enclosing loop ids, frames of the first op of its first iteration).
    `outputs` are the body values visible after the loop (last iteration); `trip_counts` maps a
    trace id to the trip count of each visit of this loop node by that trace."""
    key: tuple
    body: "TraceGraph"
    outputs: tuple = ()
    trip_counts: dict = field(default_factory=dict)

    @property
    def seen_trip_counts(self) -> frozenset:
        return frozenset(c for cs in self.trip_counts.values() for c in cs)


@dataclass(frozen=True, slots=True)
class Node:
    """One TraceGraph node. `op` is the representative record (from the first trace that reached
    the node); `inputs` mirror `op.inputs` with Sources instead of refs. `seen` maps a trace id to
    the record indices of that trace matched here (one per visit: one per iteration inside a loop
    body; for a loop node, the index of the first record of each visit)."""
    id: int
    kind: str
    op: Optional[OpRecord] = None
    inputs: tuple = ()
    seen: dict = field(default_factory=dict)
    fetches: frozenset = frozenset()
    loop: Optional[Loop] = None
    # inside a loop body: whether some visit was in a first iteration / in a later iteration
    first_iter: bool = False
    later_iter: bool = False
    folded: frozenset = frozenset()  # loop depths folded around this node (see `op_key`)

    @property
    def key(self) -> tuple:
        """What must agree for a record (or a loop visit) to match this node, data flow aside."""
        if self.kind == LOOP:
            return (LOOP, self.loop.key)
        return (self.kind,) if self.op is None else self.op_key(self.op, self.folded)

    @staticmethod
    def op_key(op: OpRecord, folded: frozenset = frozenset()) -> tuple:
        """`folded`: depths of the enclosing loops folded into loop nodes; their iteration numbers
        do not matter (unrolled loops keep theirs)."""
        loc = op.location
        if folded:
            loops = tuple(LoopIter(l.loop, -1) if d in folded else l for d, l in enumerate(loc.loops))
            loc = Location(loc.frames, loops)
        return (OP, op.op_type, op.attrs, loc, op.function, op.recorded)

    @property
    def phis(self) -> tuple:
        """(input position, Phi) for every phi slot (positions are (arg,) or (arg, item))."""
        out = []
        for a, arg in enumerate(self.inputs):
            items = arg if isinstance(arg, tuple) else (arg,)
            for k, s in enumerate(items):
                if isinstance(s, Phi):
                    out.append(((a, k) if isinstance(arg, tuple) else (a,), s))
        return tuple(out)

    @property
    def feeds(self) -> tuple:
        """The feed points of this node: its `FeedRef` / `IterFeed` inputs (Input-Feeding ops)."""
        return tuple(s for a in self.inputs for s in (a if isinstance(a, tuple) else (a,))
                     if isinstance(s, (FeedRef, IterFeed)))

    @property
    def label(self) -> str:
        if self.kind == LOOP:
            return f"loop[{self.loop.key[0]}]"
        if self.op is None:
            return self.kind
        return self.op.function or self.op.op_type

    def __repr__(self) -> str:
        ins = ", ".join(map(repr, self.inputs))
        return f"n{self.id} = {self.label}({ins})"


# ------------------------------------------------------------------------------------ the graph
@dataclass(frozen=True, slots=True)
class TraceGraph:
    """A DAG with unique `start` and `end`. `edges` are (src, dst) pairs in insertion order (this
    order fixes child order, hence case order). `num_traces` counts merged traces; `next_id` is
    the next free node id for the whole graph (meaningful on the top level)."""
    nodes: dict
    edges: tuple
    start: int = 0
    end: int = 1
    num_traces: int = 0
    next_id: int = 2

    @staticmethod
    def empty(start: int = 0, end: int = 1) -> "TraceGraph":
        return TraceGraph({start: Node(start, START), end: Node(end, END)}, (), start, end, 0,
                          max(start, end) + 1)

    @staticmethod
    def from_edges(edges, start: int = 0, end: int = 1) -> "TraceGraph":
        """A bare graph (op-less nodes) from an edge list: for tests and examples."""
        edges = tuple((int(a), int(b)) for a, b in edges)
        ids = {start, end} | {n for e in edges for n in e}
        nodes = {n: Node(n, START if n == start else END if n == end else OP) for n in sorted(ids)}
        return TraceGraph(nodes, edges, start, end, 0, max(ids) + 1)

    def successors(self, n: int) -> tuple:
        return tuple(b for a, b in self.edges if a == n)

    def predecessors(self, n: int) -> tuple:
        return tuple(a for a, b in self.edges if b == n)

    def path(self, trace_id: int) -> tuple:
        """The node ids trace `trace_id` visited on this level, `(start, ..., end)` (a trace
        visits a node at most once per level; inside a body, once per iteration)."""
        visits = sorted((v[0], n.id) for n in self.nodes.values() if (v := n.seen.get(trace_id)))
        if not visits and trace_id not in range(self.num_traces):
            raise KeyError(f"no trace {trace_id} in this TraceGraph ({self.num_traces} traces)")
        return (self.start,) + tuple(n for _, n in visits) + (self.end,)

    @property
    def op_nodes(self) -> tuple:
        return tuple(n for n in self.nodes.values() if n.kind in (OP, LOOP))

    def size(self) -> dict:
        """Node and edge counts, loop bodies included."""
        nodes, edges = len(self.op_nodes), len(self.edges)
        for n in self.op_nodes:
            if n.kind == LOOP:
                sub = n.loop.body.size()
                nodes, edges = nodes + sub["nodes"], edges + sub["edges"]
        return {"nodes": nodes, "edges": edges}

    def __repr__(self) -> str:
        s = self.size()
        return f"TraceGraph({s['nodes']} nodes, {s['edges']} edges, {self.num_traces} traces)"
