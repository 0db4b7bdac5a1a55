"""Case assignment (Algorithm 1, §3.2.2): a TraceGraph -> an ordered list of switch-cases.

A loop node counts as one node (it becomes one While op). The result covers every start->end path
of the graph (Theorem 1): at each switch-case exactly one case's control edges contain the edge
the path is waiting on; that case's block is the next stretch of the path (or empty: the edge
waits for a later switch-case). A path that already reached `end` takes no case of the later
switch-cases: the lowering gives each Switch-Case an extra, empty default branch for that. `path_choices` gives, for one path, the case index chosen at each
switch-case: the values the runtime feeds into the Case-Select ops.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Case", "SwitchCase", "assign_cases", "path_choices", "in_chain_edges"]


@dataclass(frozen=True, slots=True)
class Case:
    """A basic block (node ids of a linear chain, possibly empty) and the control edges
    ((src, dst) pairs) that select it."""
    block: tuple
    control_edges: tuple

    def __repr__(self) -> str:
        blk = "[" + " ".join(f"n{n}" for n in self.block) + "]" if self.block else "[]"
        edges = ", ".join(f"n{a}->n{b}" for a, b in self.control_edges)
        return f"Case({blk} <- {{{edges}}})"


@dataclass(frozen=True, slots=True)
class SwitchCase:
    cases: tuple  # of Case

    def __repr__(self) -> str:
        return "SwitchCase(" + " | ".join(map(repr, self.cases)) + ")"


def in_chain_edges(case: Case) -> tuple:
    return tuple(zip(case.block, case.block[1:]))


def assign_cases(graph) -> tuple:
    """Algorithm 1 over `graph.start`, `graph.end`, `graph.edges` (a TraceGraph; loop bodies are
    not entered). Cases within a switch-case are ordered by first appearance of their target in
    `next_edges`, which follows edge insertion order, so the result is deterministic."""
    start, end, edges = graph.start, graph.end, tuple(graph.edges)
    succ, indeg = {}, {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
        indeg[b] = indeg.get(b, 0) + 1
    out = []
    next_edges = [(a, b) for a, b in edges if a == start and b != end]
    guard = len(edges) + 2
    while next_edges:
        guard -= 1
        if guard < 0:
            raise ValueError("case assignment did not terminate: the graph is not a DAG")
        targets = list(dict.fromkeys(b for _, b in next_edges))
        cases, new_next = [], []
        for v in targets:
            control = tuple(e for e in next_edges if e[1] == v)
            block = []
            if indeg.get(v, 0) == len(control):  # no in-edge from outside next_edges
                block.append(v)
                while (len(succ.get(v, ())) == 1 and succ[v][0] != end
                       and indeg[succ[v][0]] == 1):
                    v = succ[v][0]
                    block.append(v)
                new_next += [(v, y) for y in succ.get(v, ()) if y != end]
            else:
                new_next += control
            cases.append(Case(tuple(block), control))
        out.append(SwitchCase(tuple(cases)))
        next_edges = list(dict.fromkeys(new_next))
    return tuple(out)


def path_choices(switch_cases, path) -> list:
    """For a path `(start, v1, ..., vk, end)` of node ids, the index of the case chosen at each
    switch-case. Raises ValueError when the switch-cases do not cover the path (Definition 5).

    Once the path waits only on its edge into `end` it is finished; Algorithm 1 has no case for
    that (Definition 5 silently assumes every path meets every switch-case), so every later
    switch-case gets `len(cases)`: the lowering adds one empty default branch for it."""
    path = list(path)
    if len(path) < 2:
        raise ValueError(f"path {path!r} needs at least start and end")
    edges = list(zip(path, path[1:]))
    on_path = set(edges)
    pos, choices = 0, []  # edges[pos] is the edge the path waits on
    for k, sc in enumerate(switch_cases):
        hit = [i for i, c in enumerate(sc.cases) if on_path.intersection(c.control_edges)]
        if not hit and pos == len(edges) - 1:
            choices.append(len(sc.cases))  # finished: the default (exit) branch
            continue
        if len(hit) != 1:
            raise ValueError(f"switch-case {k}: {len(hit)} cases have control edges on path "
                             f"{path!r} (need exactly one)")
        case = sc.cases[hit[0]]
        if set(case.control_edges) & on_path != {edges[pos]}:
            raise ValueError(f"switch-case {k}: case {hit[0]} is selected by "
                             f"{sorted(set(case.control_edges) & on_path)}, but the path waits "
                             f"on {edges[pos] if pos < len(edges) else 'nothing'}")
        for m, n in enumerate(case.block):
            if pos + m >= len(edges) or edges[pos + m][1] != n:
                raise ValueError(f"switch-case {k}: block {case.block} does not follow path "
                                 f"{path!r} from edge {edges[pos]}")
        pos += len(case.block)
        choices.append(hit[0])
    if pos != len(edges) - 1:
        raise ValueError(f"path {path!r}: switch-cases end after {pos} of {len(edges) - 1} "
                         f"nodes")
    return choices
