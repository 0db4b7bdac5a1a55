"""Compiler passes: merge (traces -> TraceGraph), case assignment (Algorithm 1), lowering."""
