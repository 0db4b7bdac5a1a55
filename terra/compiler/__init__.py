"""Compiler: traces -> TF graphs (replay of one trace; merge and lowering build on it)."""
from terra.compiler.replay import ReplayFunction, compile_trace, substitute_feeds

__all__ = ["ReplayFunction", "compile_trace", "substitute_feeds"]
