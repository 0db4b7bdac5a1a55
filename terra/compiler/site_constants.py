"""Constants that differ between the paths of one site become feeds of the site graph.

    traces, puts = feed_constants(traces)   # before merging them into one TraceGraph

A Python value the program computes anew each iteration (actor_critic's normalized returns, a
sampled action) reaches each trace as a constant. Two paths that hold different constants at
the same place cannot share the op: merged, every such op is a node per path, and an episode
of another length splits the whole loss into one-op switch-cases (hundreds of them). Here
each such constant becomes a feed of its trace, whose value is the constant the path recorded:
the site graph's plan puts it (`puts[t]`: slot -> ConstRef), so each path still runs exactly
its own values, and skip mode, which matches every record of the path with its constants,
has checked the op before the plan puts it (an event is performed once its record matched).

A place is (call site without iteration numbers, op type, input position); it varies when two
traces hold different values at the k-th constant of that place (a loop index the same on
every path stays a constant). A constant whose op's output shapes depend on its value
(`shapes_fixed`), a string, or a large one stays a constant. One tensor object used twice
(`ConstRef.origin`: a forward op and its gradient) is one feed.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from terra.compiler.shapes import shapes_fixed
from terra.ir.records import (SITE_CONSTANT, ConstRef, Feed, FeedRef, OutputRef, TensorSpec,
                              Trace, replace)

__all__ = ["feed_constants", "varying_places", "MAX_ELEMENTS"]

MAX_ELEMENTS = 64  # larger constants stay constants (a put per element is cheap, not free)


def _places(rec):
    """(place, ConstRef) for each constant input of one record."""
    where = (rec.location.site, rec.op_type)
    for i, a in enumerate(rec.inputs):
        if isinstance(a, tuple):
            for j, x in enumerate(a):
                if isinstance(x, ConstRef):
                    yield (where, i, j), x
        elif isinstance(a, ConstRef):
            yield (where, i, None), a


def _feedable(ref: ConstRef) -> bool:
    return ref.dtype != "string" and int(np.size(np.asarray(ref.value, dtype=object))) <= \
        MAX_ELEMENTS


def varying_places(traces) -> frozenset:
    """Places whose k-th constant differs between two of `traces` (by value and dtype)."""
    seqs = []
    for t in traces:
        s = {}
        for rec in t.records:
            for place, ref in _places(rec):
                s.setdefault(place, []).append((ref.value, ref.dtype))
        seqs.append(s)
    out = set()
    for k, a in enumerate(seqs):
        for b in seqs[k + 1:]:
            for place, va in a.items():
                vb = b.get(place)
                if vb is not None and place not in out and \
                        any(x != y for x, y in zip(va, vb)):
                    out.add(place)
    return frozenset(out)


def _rewrite(trace: Trace, places: frozenset):
    """`trace` with its feedable constants at `places` fed (new slots after its own), and
    {slot: ConstRef} of those slots; (trace, {}) when none is."""
    feeds, values = list(trace.feeds), list(trace.feed_values)
    puts, by_origin = {}, {}
    records, changed = [], False

    def spec_of(ref):
        if isinstance(ref, OutputRef):
            return trace.records[ref.record].outputs[ref.index]
        return feeds[ref.slot].spec

    def fed(ref: ConstRef):
        key = ref.origin if ref.origin is not None else object()
        slot = by_origin.get(key)
        if slot is None or puts[slot] != ref:
            slot = by_origin[key] = len(feeds)
            feeds.append(Feed(slot, TensorSpec(ref.dtype, tuple(np.shape(
                np.asarray(ref.value, dtype=object)))), SITE_CONSTANT))
            values.append(ref.value)
            puts[slot] = ref
        return FeedRef(slot)

    for rec in trace.records:
        todo = {(i, j) for (_, i, j), ref in _places(rec) if _feedable(ref) and
                ((rec.location.site, rec.op_type), i, j) in places}
        if not todo:
            records.append(rec)
            continue
        mark = (len(feeds), dict(by_origin))
        inputs = []
        for i, a in enumerate(rec.inputs):
            if isinstance(a, tuple):
                inputs.append(tuple(fed(x) if (i, j) in todo else x for j, x in enumerate(a)))
            else:
                inputs.append(fed(a) if (i, None) in todo else a)
        new = replace(rec, inputs=tuple(inputs))
        if shapes_fixed(new, spec_of):
            records.append(new)
            changed = True
        else:  # its output shapes follow the value: it stays a constant
            for slot in range(mark[0], len(feeds)):
                puts.pop(slot, None)
            del feeds[mark[0]:], values[mark[0]:]
            by_origin = mark[1]
            records.append(rec)
    if not changed:
        return trace, {}
    return dataclasses.replace(trace, records=records, feeds=feeds, feed_values=values), puts


def feed_constants(traces, places=None):
    """`traces` with the constants that vary between them fed (module docstring), and per
    trace {slot: ConstRef} its plan puts. `places`: `varying_places(traces)` if computed."""
    places = varying_places(traces) if places is None else places
    if not places:
        return list(traces), [{} for _ in traces]
    out = [_rewrite(t, places) for t in traces]
    return [t for t, _ in out], [p for _, p in out]
