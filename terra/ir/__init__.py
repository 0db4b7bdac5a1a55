"""Plain-data intermediate representation: records, traces, the TraceGraph, printer, verifier."""
from terra.ir.records import (ConstRef, Feed, FeedRef, Fetch, Location, LoopIter, OpRecord,
                              OutputRef, TensorSpec, Trace, VariableRef, replace)

__all__ = ["ConstRef", "Feed", "FeedRef", "Fetch", "Location", "LoopIter", "OpRecord",
           "OutputRef", "TensorSpec", "Trace", "VariableRef", "replace"]
