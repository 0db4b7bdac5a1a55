"""Compact text form of a TraceGraph: one node per line, loop bodies indented.

    n4 = MatMul(n2, $var0) @ model.py:call@12 -> n5, n6  {t0:#2 t1:#2}
"""
from __future__ import annotations

from terra.ir.trace_graph import LOOP, TraceGraph

__all__ = ["format_graph"]


def format_graph(g: TraceGraph, *, seen: bool = True, indent: str = "") -> str:
    """Nodes in a topological order (ties by id). Each line: node, inputs (phis inline), a short
    location, successors, fetch points and, with `seen`, trace id -> record indices."""
    if not isinstance(g, TraceGraph):
        raise TypeError(f"format_graph expects a TraceGraph, got {type(g).__name__}")
    lines = []
    if not indent:
        s = g.size()
        lines.append(f"TraceGraph: {s['nodes']} nodes, {s['edges']} edges, {g.num_traces} traces")
    succ = {n: [] for n in g.nodes}
    for a, b in g.edges:
        succ[a].append(b)
    for nid in _order(g, succ):
        n = g.nodes[nid]
        out = ", ".join("end" if m == g.end else f"n{m}" for m in succ[nid])
        if nid == g.start:
            lines.append(f"{indent}start -> {out}")
            continue
        if nid == g.end:
            continue
        text = f"{indent}n{nid} = {n.label}"
        if n.kind == LOOP:
            trips = ",".join(map(str, sorted(n.loop.seen_trip_counts)))
            outs = ", ".join(map(repr, n.loop.outputs))
            text += f" trips {{{trips}}} outputs ({outs})"
        else:
            text += "(" + ", ".join(map(repr, n.inputs)) + ")"
            if n.op is not None:
                loc = n.key[3]  # location with folded loops' iteration numbers dropped
                text += f" @ {loc.frames[-1] if loc.frames else '?'}"
                if loc.loops:
                    text += " [" + ", ".join(map(repr, loc.loops)).replace("#-1", "#*") + "]"
        text += f" -> {out}"
        if n.fetches:
            text += "  " + " ".join(map(repr, sorted(n.fetches, key=repr)))
        if seen and n.seen:
            text += "  {" + " ".join(
                f"t{t}:" + ",".join(f"#{i}" for i in v) for t, v in sorted(n.seen.items())) + "}"
        lines.append(text)
        if n.kind == LOOP:
            lines.append(format_graph(n.loop.body, seen=seen, indent=indent + "    "))
    return "\n".join(lines)


def _order(g, succ):
    indeg = {n: 0 for n in g.nodes}
    for _, b in g.edges:
        indeg[b] += 1
    ready = sorted(n for n, d in indeg.items() if d == 0)
    order = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
        ready.sort()
    order += sorted(set(g.nodes) - set(order))  # cycles: print them anyway
    return order
