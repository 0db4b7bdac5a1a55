import pytest

from terra.compiler.merge import merge
from terra.ir.printer import format_graph
from terra.ir.records import (FeedRef, Fetch, Location, LoopIter, OpRecord, OutputRef, TensorSpec,
                              Trace, VariableRef)
from terra.ir.trace_graph import TraceGraph


def trace(*ops, fetches=()):
    recs = [OpRecord(k, t, (), tuple(i), (TensorSpec("float32", ()),),
                     Location(("m.py:f@%d" % line,), tuple(LoopIter("m.py:f@12", n) for n in it)))
            for k, (t, i, line, *it) in enumerate(ops)]
    return Trace("m.py:step@1", recs, fetches=list(fetches))


def test_format_of_a_merged_graph_with_branch_phi_and_loop():
    t1 = trace(("Op1", [FeedRef(0)], 5), ("Op2", [OutputRef(0)], 6), ("Op3", [OutputRef(1)], 10),
               ("Op4", [OutputRef(2)], 13, 0), ("Op4", [OutputRef(3)], 13, 1),
               fetches=[Fetch(OutputRef(2), 3)])
    t2 = trace(("Op2", [VariableRef(0)], 8), ("Op3", [OutputRef(0)], 10),
               ("Op4", [OutputRef(1)], 13, 0))
    g = merge(merge(None, t1), t2)
    assert format_graph(g) == "\n".join([
        "TraceGraph: 6 nodes, 9 edges, 2 traces",
        "start -> n2, n9",
        "n2 = Op1(feed0) @ m.py:f@5 -> n3  {t0:#0}",
        "n3 = Op2(n2) @ m.py:f@6 -> n4  {t0:#1}",
        "n9 = Op2($var0) @ m.py:f@8 -> n4  {t1:#0}",
        "n4 = Op3(phi(n3<-t{0}, n9<-t{1})) @ m.py:f@10 -> n5  fetch:0(numpy, after n4)  "
        "{t0:#2 t1:#1}",
        "n5 = loop[m.py:f@12] trips {1,2} outputs () -> end  {t0:#3 t1:#2}",
        "    start -> n8",
        "    n8 = Op4(carried(n4 -> prev(n8))) @ m.py:f@13 [m.py:f@12#*] -> end  "
        "{t0:#3,#4 t1:#2}",
    ])
    assert "{t0" not in format_graph(g, seen=False)


def test_bare_graph_and_bad_input():
    text = format_graph(TraceGraph.from_edges([(0, 2), (2, 1)]))
    assert text.splitlines() == ["TraceGraph: 1 nodes, 2 edges, 0 traces", "start -> n2",
                                 "n2 = op() -> end"]
    with pytest.raises(TypeError, match="TraceGraph"):
        format_graph("g")
