"""Plain-data intermediate representation: records, traces, the TraceGraph, printer, verifier."""
from terra.ir.records import (ConstRef, Feed, FeedRef, Fetch, Location, LoopIter, OpRecord,
                              OutputRef, TensorSpec, Trace, VariableRef, replace)
from terra.ir.trace_graph import (Carried, IterFeed, Loop, Node, NodeOut, Phi, PhiOption, Prev,
                                  TraceGraph)
from terra.ir.printer import format_graph
from terra.ir.verify import TraceGraphError  # `terra.ir.verify` stays the module (DEBUG flag)

__all__ = ["Carried", "ConstRef", "Feed", "FeedRef", "Fetch", "IterFeed", "Location", "Loop",
           "LoopIter", "Node", "NodeOut", "OpRecord", "OutputRef", "Phi", "PhiOption", "Prev",
           "TensorSpec", "Trace", "TraceGraph", "TraceGraphError", "VariableRef", "format_graph",
           "replace"]
