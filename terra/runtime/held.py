"""Which recorded values the program still holds when an iteration ends: those are the values
the graph must hand back (live-outs), and a held placeholder nobody resolved would be lost."""
from __future__ import annotations

import sys

from terra.ir.records import OutputRef


def kept_unresolved(placeholders: dict, outputs: dict) -> list:
    """Refs of placeholders the program still holds whose value neither Python fetched nor the
    graph returned. Held means reachable from outside `placeholders`: a reference from another
    placeholder's attributes counts only if that one is held (Keras sets `_keras_logits` on an
    activation's output, pointing at its input: a GRU's gate logits stay referenced by a gate
    that nothing holds)."""
    inner, edges = _placeholder_edges(placeholders)
    d = {"probe": object()}
    base = None
    for _, v in d.items():
        base = sys.getrefcount(v)
    del v
    stack = []
    for key, ph in placeholders.items():  # (counting adds no reference: ids only)
        if sys.getrefcount(ph) - base > inner.get(key, 0):
            stack.append(key)
    del ph
    held = set()
    while stack:
        key = stack.pop()
        if key not in held:
            held.add(key)
            stack.extend(edges.get(key, ()))
    return [OutputRef(*key) for key in sorted(held)
            if not placeholders[key].is_materialized and OutputRef(*key) not in outputs]


def _placeholder_edges(placeholders: dict):
    """(references to each placeholder from others' attributes, key -> keys it references)."""
    keys = {id(ph): key for key, ph in placeholders.items()}
    inner, edges = {}, {}
    for key, ph in placeholders.items():
        if ph.__dict__.keys() <= _OWN:  # (most: no attribute but their own, one check in C)
            continue
        for v in _attribute_values(ph):
            k = keys.get(id(v))
            if k is not None and v is placeholders[k]:
                inner[k] = inner.get(k, 0) + 1
                edges.setdefault(key, []).append(k)
    return inner, edges


# A placeholder's own attributes (placeholders.py, python_runner.py): none refers to another
# placeholder, so only what user code set on it (Keras' `_keras_logits`, `_keras_mask`) is read.
_OWN = frozenset({"_dtype", "_shape_val", "_id", "_terra_id", "_name", "_op", "_terra_resolver",
                  "_terra_value", "_terra_bound", "_terra_owner", "_terra_ref",
                  "_terra_on_read"})


def _attribute_values(obj):
    """Values of `obj`'s instance attributes but its own, and of tuples/lists among them (one
    level)."""
    d = getattr(obj, "__dict__", None)
    if not d:
        return
    for k in d.keys() - _OWN:  # (one set difference in C: most placeholders have no other)
        v = d[k]
        if isinstance(v, (tuple, list)):
            yield from v
        else:
            yield v


def held_refs(recorder) -> set:
    """Refs of recorded tensors the program still holds at the end of the iteration."""
    d = {0: (object(), None)}
    base = None
    for t, _ in d.values():
        base = sys.getrefcount(t)
    out = set()
    for t, ref in recorder.produced():
        if sys.getrefcount(t) > base:
            out.add(ref)
    return out
