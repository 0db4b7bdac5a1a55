"""Generalization: constants that change between two traces of one path become feeds.

A Python value the program changes between iterations (a mutated keep_prob, an action sampled
every step) reaches the trace as a constant; two traces of one path that differ only in such
constants are one path whose graph takes them as feeds (`generalize`). Units whose Python read
tensor values are left alone (`read_changed_spans`): their constants may be made from those
values."""
from __future__ import annotations

import numpy as np

from terra import _tf_private as tfp
from terra.compiler.shapes import shapes_fixed
from terra.ir.records import ConstRef, Feed, FeedRef, OutputRef, TensorSpec, Trace, replace
from terra.tracing.recorder import frozen_value

__all__ = ["generalize", "read_changed_spans"]


def generalize(base: Trace, new: Trace, frozen=()):
    """`base` with every small constant whose value differs in `new` turned into a feed (a Python
    value the program changes, e.g. a mutated keep_prob); None if the traces differ otherwise or
    in nothing. Feed slots are renumbered in first-use order; values are `new`'s. A constant
    becomes a feed only where its op's output shapes do not depend on its value (`shapes_fixed`):
    elsewhere each value keeps its own path; nor inside the record spans `frozen` (units whose
    Python read tensor values: their constants may be made from those values).

    A constant that changed at one pass of a Python loop is fed at every pass: the other
    passes' constants issued from the same place (`Location.site`, same op and input) become
    feeds too, though the two traces happen to agree on them (an action sampled every step of
    an episode: two episodes agree on some steps by chance, and each would cost a fallback)."""
    if len(base.records) != len(new.records):
        return None
    first = _generalize(base, new, frozen, frozenset())
    if first is None:
        return None
    force = _same_place_constants(base, new, first)
    if not force:
        return first
    return _generalize(base, new, frozen, force) or first


def _const_places(rb, rn):
    """(place, base ref, new ref) for each input of one record pair."""
    place = (rb.location.site, rb.op_type)
    for i, (ab, an) in enumerate(zip(rb.inputs, rn.inputs)):
        if isinstance(ab, tuple) and isinstance(an, tuple):
            for j, (x, y) in enumerate(zip(ab, an)):
                yield (place, i, j), x, y
        elif not isinstance(ab, tuple) and not isinstance(an, tuple):
            yield (place, i, None), ab, an


def _same_place_constants(base: Trace, new: Trace, merged: Trace) -> frozenset:
    """Origin pairs of the constants the two traces agree on, issued from a place where
    `merged` fed a constant that came from a tensor object (`ConstRef.origin`)."""
    fed = set()
    for rb, rm in zip(base.records, merged.records):
        if not rb.location.loops:  # not a pass of a Python loop (TF's backprop: one place)
            continue
        for place, b, m in _const_places(rb, rm):
            if isinstance(b, ConstRef) and b.origin is not None and isinstance(m, FeedRef):
                fed.add(place)
    if not fed:
        return frozenset()
    force = set()
    for rb, rn in zip(base.records, new.records):
        for place, b, n in _const_places(rb, rn):
            if place in fed and isinstance(b, ConstRef) and isinstance(n, ConstRef) and \
                    b == n and b.origin is not None and n.origin is not None:
                force.add((b.origin, n.origin))
    return frozenset(force)


def _generalize(base: Trace, new: Trace, frozen, force):
    feeds, values, records = [], [], []
    by_base, by_new, by_const, by_origin, by_new_const = {}, {}, {}, {}, {}
    changed = fed_constant = False

    def slot_for(key_map, key, spec, source, value):
        s = key_map.get(key)
        if s is None:
            s = key_map[key] = len(feeds)
            feeds.append(Feed(s, spec, source))
            values.append(value)
        return s

    def merge_ref(b, n):
        nonlocal changed, fed_constant
        if isinstance(b, FeedRef) and isinstance(n, FeedRef):
            spec = base.feeds[b.slot].spec
            if spec != new.feeds[n.slot].spec:
                return None
            s1 = slot_for(by_base, b.slot, spec, new.feeds[n.slot].source, new.feed_values[n.slot])
            if by_new.setdefault(n.slot, s1) != s1:
                return None
            return FeedRef(s1)
        if b == n and not (isinstance(b, ConstRef) and (b.origin, n.origin) in force):
            return b
        if isinstance(n, ConstRef) and n.dtype != "string":
            shape = tuple(np.shape(n.value))
            if isinstance(b, ConstRef) and b.dtype == n.dtype and tuple(np.shape(b.value)) == shape:
                changed = fed_constant = True
                # (`force`: equal here, but changed at another pass through the same place)
                spec, pair = TensorSpec(n.dtype, shape), (b.value, n.value, n.dtype)
                if b.origin is None or n.origin is None:
                    # a constant of unknown origin joins the first slot of its values (one
                    # Python value that forward and backward converted apart)
                    return FeedRef(slot_for(by_const, pair, spec, "python-constant", n.value))
                # one tensor object (a slice's bounds, used again by the slice's gradient) is one
                # slot; two that hold equal values by chance are two
                s = slot_for(by_origin, (b.origin, n.origin), spec, "python-constant", n.value)
                by_const.setdefault(pair, s)
                return FeedRef(s)
            if isinstance(b, FeedRef) and base.feeds[b.slot].source == "python-constant" and \
                    base.feeds[b.slot].spec == TensorSpec(n.dtype, shape):
                sl = slot_for(by_base, b.slot, base.feeds[b.slot].spec, "python-constant", n.value)
                changed = fed_constant = True  # an instance of `base` (filed under its path)
                return FeedRef(sl) if _same_constant(values[sl], n.value, n.dtype) else None
        if isinstance(b, ConstRef) and isinstance(n, FeedRef) and b.dtype != "string" and \
                new.feeds[n.slot].source == "python-constant" and \
                new.feeds[n.slot].spec == TensorSpec(b.dtype, tuple(np.shape(b.value))):
            # a constant `new` already feeds (its prefix was run on a generalized path's graph)
            changed = fed_constant = True
            s = by_new.get(n.slot)
            if s is None:
                s = by_new[n.slot] = slot_for(by_new_const, n.slot, new.feeds[n.slot].spec,
                                              "python-constant", new.feed_values[n.slot])
            return FeedRef(s)
        return None

    def spec_of(ref):
        if isinstance(ref, OutputRef):
            return base.records[ref.record].outputs[ref.index]
        return feeds[ref.slot].spec

    for rb, rn in zip(base.records, new.records):
        if (rb.op_type, rb.attrs, rb.route == "function", rb.function, rb.outputs) != \
                (rn.op_type, rn.attrs, rn.route == "function", rn.function, rn.outputs):
            return None
        fed_constant = False
        pinned = any(a <= rb.index < b for a, b in frozen)
        inputs = []
        for ab, an in zip(rb.inputs, rn.inputs):
            if isinstance(ab, tuple) or isinstance(an, tuple):
                if not (isinstance(ab, tuple) and isinstance(an, tuple) and len(ab) == len(an)):
                    return None
                m = tuple(merge_ref(x, y) for x, y in zip(ab, an))
                if any(x is None for x in m):
                    return None
                inputs.append(m)
            else:
                m = merge_ref(ab, an)
                if m is None:
                    return None
                inputs.append(m)
        merged = replace(rb, inputs=tuple(inputs))
        if fed_constant and (pinned or not shapes_fixed(merged, spec_of)):
            return None
        records.append(merged)
    if not changed:
        return None
    return Trace(new.site, records, feeds, values, list(new.fetches), dict(new.variables),
                 list(new.unsupported), dict(new.functions), list(new.unseeded_random),
                 list(new.fast_fallbacks))


def read_changed_spans(units: dict, other_units: dict) -> list:
    """Record spans of the units whose Python read values that differ between two traces of a
    path (or that only one trace has): `generalize` keeps their constants, which may be made
    from those values. A unit that read the same values in both (a pooling gradient reading a
    shape) may hold a constant that changes for another reason, e.g. the backward pass of
    `logits * keep` with a Python `keep` the program changes: that one becomes a feed. Skip mode
    still checks the unit's reads before it skips the unit."""
    spans = []
    for mine, theirs in ((units, other_units), (other_units, units)):
        for start, u in mine.items():
            o = theirs.get(start)
            if u.reads and (o is None or (o.start, o.end) != (u.start, u.end) or
                            not _same_reads(u.reads, o.reads)):
                spans.append((u.start, u.end))
    return spans


def _same_reads(a, b) -> bool:
    if len(a) != len(b):
        return False
    for (ra, va), (rb, vb) in zip(a, b):
        if ra != rb:
            return False
        va, vb = np.asarray(va), np.asarray(vb)
        if va.dtype != vb.dtype or va.shape != vb.shape or not np.array_equal(va, vb):
            return False
    return True


def _same_constant(value, frozen, dtype: str) -> bool:
    """Whether feed value `value` (a frozen constant, a Python or NumPy value, or an EagerTensor
    when the slot was first merged from two feeds) is the constant `frozen`, by value. `==` on a
    tensor or an array compares elementwise, and its truth value raises."""
    if isinstance(value, tfp.EagerTensorBase):
        value = value.numpy()
    try:
        return frozen_value(value, dtype) == frozen
    except (TypeError, ValueError):  # not convertible to the constant's dtype: not equal
        return False
