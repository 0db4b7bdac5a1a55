"""Compiler passes: merge (traces -> TraceGraph), case assignment (Algorithm 1), replay of one
trace, lowering (TraceGraph -> one TF graph)."""
from terra.compiler.replay import ReplayFunction, compile_trace, substitute_feeds

__all__ = ["ReplayFunction", "compile_trace", "substitute_feeds"]
