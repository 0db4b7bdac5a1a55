import pytest

from terra.ir.records import Location, LoopIter, OpRecord, TensorSpec
from terra.ir.trace_graph import (END, LOOP, OP, START, Carried, IterFeed, Loop, Node, NodeOut,
                                  Phi, PhiOption, Prev, TraceGraph)


def rec(loops=()):
    return OpRecord(0, "Mul", (("T", "float32"),), (), (TensorSpec("float32", ()),),
                    Location(("m.py:f@3",), loops))


def test_sources_have_short_reprs():
    phi = Phi((PhiOption(NodeOut(3), frozenset({(0, 2)})), PhiOption(NodeOut(5, 1),
                                                                       frozenset({(1, 4), (2, 4)}))))
    assert repr(phi) == "phi(n3<-t{0}, n5:1<-t{1,2})"
    assert repr(Carried(NodeOut(2), Prev(7))) == "carried(n2 -> prev(n7))"
    assert repr(IterFeed(1)) == "iterfeed1"


def test_op_key_drops_iteration_numbers_of_folded_loops_only():
    a = rec((LoopIter("L1", 0), LoopIter("L2", 4)))
    b = rec((LoopIter("L1", 3), LoopIter("L2", 4)))
    c = rec((LoopIter("L1", 3), LoopIter("L2", 5)))
    assert Node.op_key(a) != Node.op_key(b)
    assert Node.op_key(a, frozenset({0})) == Node.op_key(b, frozenset({0}))
    assert Node.op_key(b, frozenset({0})) != Node.op_key(c, frozenset({0}))
    assert Node(2, OP, a, folded=frozenset({0, 1})).key == Node(3, OP, c, folded=frozenset({0, 1})).key


def test_from_edges_sizes_and_paths():
    g = TraceGraph.from_edges([(0, 2), (2, 3), (2, 4), (3, 1), (4, 1)])
    assert [g.nodes[n].kind for n in (0, 1, 2)] == [START, END, OP]
    assert g.successors(2) == (3, 4) and g.predecessors(1) == (3, 4)
    assert g.size() == {"nodes": 3, "edges": 5}
    body = TraceGraph.from_edges([(10, 12), (12, 11)], start=10, end=11)
    lp = Node(5, LOOP, loop=Loop(("L", (), ("m.py:f@3",)), body, (NodeOut(12),), {0: (3, 4)}))
    g2 = TraceGraph({**g.nodes, 5: lp}, g.edges + ((2, 5), (5, 1)), next_id=13)
    assert g2.size() == {"nodes": 5, "edges": 9}
    assert lp.loop.seen_trip_counts == {3, 4} and lp.label == "loop[L]"
    assert repr(g2) == "TraceGraph(5 nodes, 9 edges, 0 traces)"
    with pytest.raises(KeyError, match="no trace 0"):
        g.path(0)


def test_phis_lists_every_phi_slot_with_its_position():
    phi = Phi((PhiOption(NodeOut(3), frozenset()), PhiOption(NodeOut(4), frozenset())))
    n = Node(9, OP, rec(), inputs=(NodeOut(2), (NodeOut(2), phi)))
    assert n.phis == (((1, 1), phi),)
