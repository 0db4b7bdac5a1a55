import dataclasses

import pytest

from terra.compiler import merge as merge_mod
from terra.ir import verify as verify_mod
from terra.ir.records import Location, OpRecord, OutputRef, TensorSpec, Trace, VariableRef
from terra.ir.trace_graph import (START, Carried, Loop, LOOP, Node, NodeOut, Phi, PhiOption, Prev,
                                  TraceGraph)
from terra.ir.verify import TraceGraphError, verify


def good():
    return TraceGraph.from_edges([(0, 2), (2, 3), (2, 4), (3, 5), (4, 5), (5, 1)])


def with_node(g, n):
    return dataclasses.replace(g, nodes={**g.nodes, n.id: n})


def phi(*nodes, visits=None):
    return Phi(tuple(PhiOption(NodeOut(n), frozenset({(0, k)} if visits is None else visits[k]))
                     for k, n in enumerate(nodes)))


def test_good_graph_passes():
    verify(good())
    verify(with_node(good(), Node(5, "op", inputs=(phi(3, 4),))))


@pytest.mark.parametrize("edit, message", [
    (lambda g: dataclasses.replace(g, edges=g.edges + ((5, 2),)), "cycle"),
    (lambda g: dataclasses.replace(g, edges=g.edges + ((2, 9),)), "not in the graph"),
    (lambda g: dataclasses.replace(g, edges=g.edges + ((2, 3),)), "twice"),
    (lambda g: with_node(g, Node(7, START)), "one start"),
    (lambda g: dataclasses.replace(with_node(g, Node(7, "op")), edges=g.edges + ((7, 5),)),
     "not reachable from start"),
    (lambda g: dataclasses.replace(with_node(g, Node(7, "op")), edges=g.edges + ((2, 7),)),
     "does not reach end"),
    (lambda g: dataclasses.replace(g, edges=g.edges + ((1, 2),)), "end has out-edges"),
    (lambda g: with_node(g, Node(5, "op", inputs=(phi(3),))), "fewer than two"),
    (lambda g: with_node(g, Node(4, "op", inputs=(phi(2, 3),))), "not an ancestor"),
    (lambda g: with_node(g, Node(5, "op", inputs=(phi(3, 4, visits=[{(0, 1)}, {(0, 1)}]),))),
     "two phi options"),
    (lambda g: with_node(g, Node(3, "op", inputs=(NodeOut(4),))), "not an ancestor"),
    (lambda g: with_node(g, Node(3, "op", inputs=(NodeOut(42),))), "runs before"),
    (lambda g: with_node(g, Node(3, "op", inputs=(Carried(NodeOut(2), Prev(3)),))),
     "outside its loop body"),
    (lambda g: with_node(g, Node(3, "op", inputs=(Prev(2),))), "outside a loop body"),
])
def test_broken_graphs_are_reported(edit, message):
    with pytest.raises(TraceGraphError, match=message):
        verify(edit(good()))


def test_loop_bodies_are_checked_recursively():
    body = TraceGraph.from_edges([(10, 12), (12, 11)], start=10, end=11)
    body = with_node(body, Node(12, "op", inputs=(Carried(NodeOut(2), Prev(12)),)))
    lp = Node(3, LOOP, loop=Loop(("L", (), ()), body, (NodeOut(12),)))
    verify(with_node(good(), lp))
    bad_body = with_node(body, Node(12, "op", inputs=(NodeOut(4),)))   # 4 is not before the loop
    with pytest.raises(TraceGraphError, match="runs before"):
        verify(with_node(good(), dataclasses.replace(lp, loop=dataclasses.replace(
            lp.loop, body=bad_body))))
    dup = TraceGraph.from_edges([(10, 2), (2, 11)], start=10, end=11)
    with pytest.raises(TraceGraphError, match="used twice"):
        verify(with_node(good(), dataclasses.replace(lp, loop=Loop(("L", (), ()), dup))))
    with pytest.raises(TraceGraphError, match="not a body value"):
        verify(with_node(good(), dataclasses.replace(lp, loop=dataclasses.replace(
            lp.loop, outputs=(NodeOut(5),)))))


def test_merge_verifies_only_in_debug(monkeypatch):
    calls = []
    monkeypatch.setattr(verify_mod, "verify", lambda g: calls.append(g))
    t = Trace("s", [OpRecord(0, "A", (), (VariableRef(0),), (TensorSpec("float32", ()),),
                             Location(("m.py:f@1",)))])
    monkeypatch.setattr(verify_mod, "DEBUG", False)
    monkeypatch.delenv("TERRA_DEBUG", raising=False)
    merge_mod.merge(None, t)
    assert calls == []
    monkeypatch.setenv("TERRA_DEBUG", "1")
    g = merge_mod.merge(None, t)
    assert calls == [g]
    monkeypatch.delenv("TERRA_DEBUG")
    monkeypatch.setattr(verify_mod, "DEBUG", True)
    merge_mod.merge(None, t)
    assert len(calls) == 2
