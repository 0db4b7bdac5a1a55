"""Memos about a graph kept on the graph itself, so that they die with it.

A module-level `WeakKeyDictionary` keyed by graph never lets go of a key whose value holds one
of the graph's tensors (value -> tensor -> op -> graph): every graph the lowering built stayed
alive for the life of the process, with all its ops, and each full collection walked them all
(a test process that had built a thousand graphs spent seconds per `gc.collect()`). Kept on the
graph, the memo is part of the graph's own cycle and goes when the graph goes."""
from __future__ import annotations

from typing import Callable, TypeVar

__all__ = ["memo"]

_ATTR = "_terra_memos"
T = TypeVar("T")


def memo(graph, name: str, make: Callable[[], T]) -> T:
    """The memo `name` of `graph`, made by `make()` on first use."""
    memos = getattr(graph, _ATTR, None)
    if memos is None:
        memos = {}
        setattr(graph, _ATTR, memos)  # (TF's graphs take attributes but expose no __dict__)
    value = memos.get(name)
    if value is None:
        value = memos[name] = make()
    return value
