"""Structural checks of a TraceGraph, raising `TraceGraphError` with the offending node.

`merge` runs `verify` on its result when `DEBUG` is true or the environment has TERRA_DEBUG=1.
"""
from __future__ import annotations

import os

from terra.ir.trace_graph import (END, LOOP, START, Carried, NodeOut, Phi, Prev, TraceGraph)

__all__ = ["DEBUG", "TraceGraphError", "debug_enabled", "verify"]

DEBUG = False


class TraceGraphError(ValueError):
    """A TraceGraph breaks an invariant (message names the node or edge)."""


def debug_enabled() -> bool:
    return DEBUG or os.environ.get("TERRA_DEBUG", "") == "1"


def verify(g: TraceGraph, _ids: set | None = None, _outer: frozenset = frozenset()) -> None:
    """Check: edges name existing nodes; unique start (no in-edge) and end (no out-edge); acyclic;
    every node reachable from start and reaching end; node ids unique across loop bodies; sources
    name nodes that run before (an ancestor, or an ancestor of an enclosing loop node); phi
    options are distinct producers of this level that precede the node, and no visit resolves to
    two of them; Carried/Prev only inside loop bodies; loop bodies recursively."""
    if not isinstance(g, TraceGraph):
        raise TypeError(f"verify expects a TraceGraph, got {type(g).__name__}")
    ids = set() if _ids is None else _ids
    for nid, n in g.nodes.items():
        if nid != n.id:
            raise TraceGraphError(f"node stored under id {nid} has id {n.id}")
        if nid in ids:
            raise TraceGraphError(f"node id n{nid} is used twice")
        ids.add(nid)
    starts = [n.id for n in g.nodes.values() if n.kind == START]
    ends = [n.id for n in g.nodes.values() if n.kind == END]
    if starts != [g.start] or ends != [g.end]:
        raise TraceGraphError(f"need exactly one start (n{g.start}) and one end (n{g.end}), "
                              f"found starts {starts} and ends {ends}")
    succ = {n: [] for n in g.nodes}
    pred = {n: [] for n in g.nodes}
    for e in g.edges:
        a, b = e
        if a not in g.nodes or b not in g.nodes:
            raise TraceGraphError(f"edge {e} names a node that is not in the graph")
        if b in succ[a]:
            raise TraceGraphError(f"edge {e} appears twice")
        succ[a].append(b)
        pred[b].append(a)
    if pred[g.start] or succ[g.end]:
        raise TraceGraphError(f"start has in-edges {pred[g.start]} or end has out-edges "
                              f"{succ[g.end]}")
    order = _topological(g, succ, pred)
    fwd, bwd = _reach(g.start, succ), _reach(g.end, pred)
    for n in g.nodes:
        if n not in fwd:
            raise TraceGraphError(f"n{n} is not reachable from start")
        if n not in bwd:
            raise TraceGraphError(f"n{n} does not reach end")
    ancestors = {}
    for n in order:
        ancestors[n] = set().union(*({p} | ancestors[p] for p in pred[n])) if pred[n] else set()
    local = frozenset(g.nodes)
    for n in g.nodes.values():
        for s in _sources(n.inputs):
            _check_source(g, n, s, local, _outer, ancestors[n.id], ids)
        if n.kind == LOOP:
            verify(n.loop.body, ids, _outer | ancestors[n.id] | {"body"})
            for o in n.loop.outputs:
                if not isinstance(o, NodeOut) or o.node not in n.loop.body.nodes:
                    raise TraceGraphError(f"loop n{n.id}: output {o!r} is not a body value")


def _check_source(g, n, s, local, outer, anc, ids):
    in_body = "body" in outer
    if isinstance(s, Phi):
        if len(s.options) < 2:
            raise TraceGraphError(f"n{n.id}: phi with fewer than two options: {s!r}")
        nodes = [o.source.node for o in s.options]
        if len(set(nodes)) != len(nodes):
            raise TraceGraphError(f"n{n.id}: phi options repeat a producer: {s!r}")
        for o in s.options:
            if o.source.node not in anc:
                raise TraceGraphError(f"n{n.id}: phi option {o.source!r} is not an ancestor")
        seen = [v for o in s.options for v in o.visits]
        if len(seen) != len(set(seen)):
            raise TraceGraphError(f"n{n.id}: a visit resolves to two phi options: {s!r}")
    elif isinstance(s, Carried):
        if not in_body or s.update.node not in local:
            raise TraceGraphError(f"n{n.id}: {s!r} outside its loop body")
        _check_source(g, n, s.init, local, outer, anc, ids)
    elif isinstance(s, Prev):
        if not in_body or s.node not in ids:
            raise TraceGraphError(f"n{n.id}: {s!r} outside a loop body")
    elif isinstance(s, NodeOut):
        if s.node in local:
            if s.node not in anc:
                raise TraceGraphError(f"n{n.id}: input {s!r} is not an ancestor of it")
        elif s.node not in outer:
            raise TraceGraphError(f"n{n.id}: input {s!r} names no node that runs before it")


def _sources(inputs):
    for a in inputs:
        if isinstance(a, tuple):
            yield from a
        else:
            yield a


def _topological(g, succ, pred):
    indeg = {n: len(pred[n]) for n in g.nodes}
    ready = [n for n, d in indeg.items() if d == 0]
    order = []
    while ready:
        n = ready.pop()
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if len(order) != len(g.nodes):
        cyc = sorted(n for n, d in indeg.items() if d > 0)
        raise TraceGraphError(f"TraceGraph has a cycle through nodes {cyc}")
    return order


def _reach(a, nbrs):
    seen, stack = set(), [a]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(nbrs[n])
    return seen
