import random

import pytest

from terra.compiler.case_assignment import (Case, SwitchCase, assign_cases, in_chain_edges,
                                            path_choices)
from terra.ir.trace_graph import TraceGraph

# Figure 3.6(a) as the walkthrough of Figure 3.7 describes it: start=0, end=10, nodes 1..9.
PAPER = dict(a=(0, 1), b=(1, 2), c=(1, 4), d=(1, 6), e=(2, 3), f=(4, 5), g=(3, 7), h=(5, 7),
             i=(6, 8), j=(7, 8))
PAPER_EDGES = list(PAPER.values()) + [(8, 9), (9, 10)]


def paper_graph():
    return TraceGraph.from_edges(PAPER_EDGES, start=0, end=10)


def test_paper_example_exactly():
    a, b, c, d, e, f, g, h, i, j = (PAPER[k] for k in "abcdefghij")
    assert assign_cases(paper_graph()) == (
        SwitchCase((Case((1,), (a,)),)),
        SwitchCase((Case((2, 3), (b,)), Case((4, 5), (c,)), Case((6,), (d,)))),
        SwitchCase((Case((7,), (g, h)), Case((), (i,)))),   # node 8 waits: edge j is pending
        SwitchCase((Case((8, 9), (j, i)),)),
    )


def test_paper_example_choices():
    sc = assign_cases(paper_graph())
    assert path_choices(sc, [0, 1, 2, 3, 7, 8, 9, 10]) == [0, 0, 0, 0]
    assert path_choices(sc, [0, 1, 4, 5, 7, 8, 9, 10]) == [0, 1, 0, 0]
    assert path_choices(sc, [0, 1, 6, 8, 9, 10]) == [0, 2, 1, 0]   # edge d: case 2; then wait on i
    with pytest.raises(ValueError, match="switch-case"):
        path_choices(sc, [0, 1, 6, 7, 8, 9, 10])                    # 6->7 is no edge
    with pytest.raises(ValueError):
        path_choices(sc, [0, 1, 2, 3, 7, 8, 10])                    # skips node 9


def test_repr_is_readable():
    sc = assign_cases(paper_graph())
    assert repr(sc[2]) == "SwitchCase(Case([n7] <- {n3->n7, n5->n7}) | Case([] <- {n6->n8}))"


def test_rejects_cycles():
    with pytest.raises(ValueError, match="DAG"):
        assign_cases(TraceGraph.from_edges([(0, 1), (1, 2), (2, 1), (2, 3)], 0, 3))


# ------------------------------------------------------------------ Theorem 1 on random DAGs
def random_dag(rng, n):
    """Nodes 1..n in topological order, start 0, end n+1; every node on a start->end path."""
    end, edges = n + 1, set()
    for v in range(1, n + 1):
        edges.add((rng.randrange(0, v), v))                 # reachable from start
        for _ in range(rng.randrange(0, 3)):
            u = rng.randrange(0, v)
            edges.add((u, v))
    for v in range(1, n + 1):
        if not any(a == v for a, _ in edges):
            edges.add((v, rng.randrange(v + 1, end + 1)))    # reaches end
        if rng.random() < 0.2:
            edges.add((v, end))
    if rng.random() < 0.1:
        edges.add((0, end))                                  # an empty trace
    edges = sorted(edges)
    rng.shuffle(edges)                                       # insertion order must not matter
    return TraceGraph.from_edges(edges, 0, end)


def paths(g, rng, limit=60):
    succ = {}
    for a, b in g.edges:
        succ.setdefault(a, []).append(b)
    out = []

    def dfs(p):
        if len(out) >= limit:
            return
        if p[-1] == g.end:
            out.append(tuple(p))
            return
        for m in succ[p[-1]]:
            dfs(p + [m])
    dfs([g.start])
    for _ in range(20):  # random traces too, beyond the first paths in DFS order
        p = [g.start]
        while p[-1] != g.end:
            p.append(rng.choice(succ[p[-1]]))
        out.append(tuple(p))
    return out


def covers_by_definition_5(S, path, end):
    """Definition 5: one case per switch-case meets Path(t) in exactly one edge, the others in
    none; Op(t) and Path(t) are the unions over those cases. Read with the convention that a path
    whose ops are all placed (only its edge into end is left) meets no later switch-case."""
    p_edges = set(zip(path, path[1:]))
    ops, got_edges = [], set()
    for s in S:
        hits = [c for c in s.cases if p_edges & set(c.control_edges)]
        if not hits and sorted(ops) == sorted(path[1:-1]):
            continue
        if len(hits) != 1 or len(p_edges & set(hits[0].control_edges)) != 1:
            return False
        c = hits[0]
        ops += c.block
        got_edges |= (p_edges & set(c.control_edges)) | set(in_chain_edges(c))
    got_edges.add((path[-2], end))
    return sorted(ops) == sorted(path[1:-1]) and len(ops) == len(set(ops)) and got_edges == p_edges


def test_theorem_1_on_random_dags():
    rng = random.Random(20231)
    for trial in range(600):
        g = random_dag(rng, rng.randrange(1, 14))
        S = assign_cases(g)
        inner = [n for n in g.nodes if n not in (g.start, g.end)]
        blocks = [n for s in S for c in s.cases for n in c.block]
        assert sorted(blocks) == sorted(inner), trial                # every node exactly once
        landed, chained = {}, {}
        for s in S:
            for c in s.cases:                                        # Definition 3
                assert c.block == () or all(e[1] == c.block[0] for e in c.control_edges)
                for e in in_chain_edges(c):
                    chained[e] = chained.get(e, 0) + 1
                if c.block:
                    for e in c.control_edges:
                        landed[e] = landed.get(e, 0) + 1
            for x in s.cases:                                        # cases are disjoint
                for y in s.cases:
                    if x is not y:
                        assert not set(x.block) & set(y.block)
                        assert not set(x.control_edges) & set(y.control_edges)
        for e in g.edges:                                            # every edge exactly once
            want = 0 if e[1] == g.end else 1
            assert landed.get(e, 0) + chained.get(e, 0) == want, (trial, e)
        for p in paths(g, rng):
            assert covers_by_definition_5(S, p, g.end), (trial, p, S)
            choices = path_choices(S, p)
            assert len(choices) == len(S)
            done = False
            for k, s in zip(choices, S):   # after the exit branch, only exit branches
                assert 0 <= k <= len(s.cases) and (not done or k == len(s.cases))
                done = k == len(s.cases)
            # the chosen blocks, in order, are exactly the path's ops
            assert [n for k, s in zip(choices, S) if k < len(s.cases)
                    for n in s.cases[k].block] == list(p[1:-1])


def test_finished_path_takes_the_exit_branch():
    g = TraceGraph.from_edges([(0, 1), (1, 2), (1, 4), (2, 3), (3, 4)], 0, 4)
    S = assign_cases(g)
    assert S == (SwitchCase((Case((1,), ((0, 1),)),)), SwitchCase((Case((2, 3), ((1, 2),)),)))
    assert path_choices(S, [0, 1, 4]) == [0, 1]
    assert path_choices(S, [0, 1, 2, 3, 4]) == [0, 0]
