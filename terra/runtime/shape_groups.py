"""Shape groups: one graph for the paths of a site that differ only in shapes.

A program whose batch size or sequence length changes issues the same ops on every step, with
other shapes and with other small constants made from those shapes (a reshape's target, a causal
mask's size, a mean's count). Each such trace stays a path of its own for skip mode (its
placeholders report its exact shapes and its units were built for them), but the paths share
one graph: `relax` lowers their common trace, with every dimension that differs made unknown
(as `tf.function`'s `reduce_retracing` relaxes a signature) and every constant that differs made
a feed. A path that joins a group whose relaxed trace already covers it costs a trace and no
build: the graph is built and instantiated once for every length.

A member's constants are put by the runtime (`PathRun`), not by Python: skip mode checks them as
constants against the member's own records, so the graph gets exactly the value Python used.

Which outputs have a shape the graph cannot know before it runs (a `tf.where`'s length, not a
sequence length) is structural: the members share ops, constant positions and feed ranks, so TF's
inference on one member's exact trace says it for all (`compiler.shapes.unknown_shapes`).
Everywhere else a member's recorded shape is the one every iteration on it sees.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from terra.ir.records import (SHAPE_CONSTANT, ConstRef, Feed, FeedRef, OutputRef, TensorSpec,
                              Trace, replace)
from terra.ir.op_kinds import DATA_DEPENDENT_SHAPE_OPS as _DATA_DEPENDENT
from terra.tracing.recorder import frozen_value

__all__ = ["ShapeGroup", "Relaxed", "current_record", "derive", "relax", "member_values",
           "rules_hold", "speculate", "covers_open"]



@dataclass(frozen=True)
class Relaxed:
    """A relaxed trace and where its shape constants sit: `const_sites[slot]` is the (record,
    flat input position) whose constant each member puts into feed `slot`."""
    trace: Trace
    const_sites: dict


def _relax_spec(a: TensorSpec, b: TensorSpec):
    if a.dtype != b.dtype:
        return None
    if a.shape is None or b.shape is None:
        return TensorSpec(a.dtype, None) if a.shape == b.shape else None
    if len(a.shape) != len(b.shape):
        return None
    return TensorSpec(a.dtype, tuple(x if x == y else None for x, y in zip(a.shape, b.shape)))


def relax(base: Relaxed, new: Trace) -> Relaxed | None:
    """`base` relaxed to cover `new` too, or None if `new` differs in more than shapes and
    shape constants (another op, attr, producer, variable, feed slot, dtype or rank), or if it
    differs in no shape at all (a changing Python value: `generalize.generalize`'s case)."""
    bt = base.trace
    if len(bt.records) != len(new.records) or len(new.feeds) != sum(
            1 for f in bt.feeds if f.source != SHAPE_CONSTANT):
        return None
    feeds = list(bt.feeds)
    values = list(bt.feed_values)
    const_sites = dict(base.const_sites)
    shaped = False
    for i, nf in enumerate(new.feeds):
        spec = _relax_spec(feeds[i].spec, nf.spec)
        if spec is None:
            return None
        shaped |= spec != feeds[i].spec or nf.spec != feeds[i].spec
        feeds[i] = Feed(i, spec, feeds[i].source)
    records = []
    for rb, rn in zip(bt.records, new.records):
        if (rb.op_type, rb.attrs, rb.route == "function", rb.function, rb.recorded) != \
                (rn.op_type, rn.attrs, rn.route == "function", rn.function, rn.recorded) or \
                len(rb.outputs) != len(rn.outputs) or len(rb.inputs) != len(rn.inputs):
            return None
        outs = []
        for a, b in zip(rb.outputs, rn.outputs):
            s = _relax_spec(a, b)
            if s is None:
                return None
            shaped |= a != b
            outs.append(s)
        pos = 0
        inputs = []
        for ab, an in zip(rb.inputs, rn.inputs):
            if isinstance(ab, tuple) != isinstance(an, tuple) or \
                    isinstance(ab, tuple) and len(ab) != len(an):
                return None
            merged = []
            for x, y in (zip(ab, an) if isinstance(ab, tuple) else ((ab, an),)):
                m = _merge_ref(x, y, rb.index, pos, feeds, values, const_sites)
                if m is None:
                    return None
                merged.append(m)
                pos += 1
            inputs.append(tuple(merged) if isinstance(ab, tuple) else merged[0])
        records.append(replace(rb, inputs=tuple(inputs), outputs=tuple(outs)))
    if not shaped:
        return None
    trace = Trace(bt.site, records, feeds, values, list(bt.fetches), dict(bt.variables),
                  list(bt.unsupported), dict(bt.functions), list(bt.unseeded_random),
                  list(bt.fast_fallbacks))
    return Relaxed(trace, const_sites)


def _merge_ref(b, n, record, pos, feeds, values, const_sites):
    if b == n:
        return b
    if isinstance(b, FeedRef) and b.slot in const_sites:   # a shape constant already
        spec = feeds[b.slot].spec
        if isinstance(n, ConstRef) and n.dtype == spec.dtype and \
                tuple(np.shape(n.value)) == spec.shape:
            return b
        return None
    if isinstance(b, ConstRef) and isinstance(n, ConstRef) and b.dtype == n.dtype and \
            b.dtype != "string" and np.shape(b.value) == np.shape(n.value):
        slot = len(feeds)
        feeds.append(Feed(slot, TensorSpec(b.dtype, tuple(np.shape(b.value))), SHAPE_CONSTANT))
        values.append(constant_value(b))
        const_sites[slot] = (record, pos)
        return FeedRef(slot)
    return None


def constant_value(ref: ConstRef):
    return np.array(ref.value, dtype=tf.as_dtype(ref.dtype).as_numpy_dtype)


def member_values(relaxed: Relaxed, trace: Trace) -> dict | None:
    """`{slot: value}` of the shape constants a member with exact trace `trace` puts; None if a
    site does not hold a constant of the slot's spec there."""
    out = {}
    for slot, (record, pos) in relaxed.const_sites.items():
        ref = trace.records[record].input_refs()[pos]
        spec = relaxed.trace.feeds[slot].spec
        if not isinstance(ref, ConstRef) or ref.dtype != spec.dtype or \
                tuple(np.shape(ref.value)) != spec.shape:
            return None
        out[slot] = constant_value(ref)
    return out


@dataclass(eq=False)
class ShapeGroup:
    """Paths of one site that share one graph (see the module docstring). `path` is the
    group's own Path over the relaxed trace (what the graph is built from); `unknown` the
    outputs whose shapes the graph cannot know before it runs (the same for every member)."""
    id: int
    relaxed: Relaxed
    path: object
    unknown: frozenset
    members: list = field(default_factory=list)
    graph: object = None
    derived: dict = field(default_factory=dict)  # slot -> rules: constants the graph computes
    claims: dict = field(default_factory=dict)   # id(member) -> {ref: its claimed shape}
    # one member so far, its graph built for the shapes a second one is expected to differ in
    # (`speculate`): its rules are that member's guesses until a second member's trace holds them
    speculative: bool = False

    def dims(self) -> str:
        """The relaxed feed dimensions, for explain()."""
        out = []
        for f in self.relaxed.trace.feeds:
            if f.source != SHAPE_CONSTANT and f.spec.shape is not None and None in f.spec.shape:
                out.append(f"feed{f.slot} {f.spec!r}")
        consts = len(self.relaxed.const_sites) - len(self.derived)
        if consts:
            out.append(f"{consts} shape constants fed")
        if self.derived:
            out.append(f"{len(self.derived)} computed from shapes")
        return ", ".join(out)

    def const_positions(self) -> dict:
        """`{record: {flat input position: slot}}` of the constants the graph computes."""
        cached = self.__dict__.get("_positions")
        if cached is None or cached[0] is not self.derived:
            out = {}
            for slot in self.derived:
                record, pos = self.relaxed.const_sites[slot]
                out.setdefault(record, {})[pos] = slot
            cached = self.__dict__["_positions"] = (self.derived, out)
        return cached[1]

    def computes_constants_of(self, unit) -> bool:
        """Whether the group's graph computes every shape constant of `unit`'s ops itself
        (`derive`), so the unit may run with shapes no member was traced with."""
        return all(slot in self.derived for slot, (r, _) in self.relaxed.const_sites.items()
                   if unit.start <= r < unit.end)

    def takes_shape(self, ref: OutputRef, traced, shape) -> bool:
        """Whether value `ref`, traced with `traced`, may have `shape` on the group's graph: it
        differs only in dimensions the members differ in (unknown in the relaxed trace), and
        none of those is 0 or 1, now or as traced (whose special cases, broadcasting and empty
        reductions, TF's Python may build other ops for: they are traced as members of their
        own)."""
        relaxed = self.relaxed.trace.records[ref.record].outputs[ref.index].shape
        if relaxed is None or len(shape) != len(traced) or len(shape) != len(relaxed):
            return False
        return all(a == b or r is None and min(a, b) >= 2
                   for a, b, r in zip(shape, traced, relaxed))

    def static_shape(self, member, ref: OutputRef):
        """The shape a member's placeholder claims: its recorded shape, or for an output whose
        shape no member's graph knows before it runs, the graph's."""
        claims = self.claims.get(id(member))
        if claims is None or claims[0] is not self.graph:
            claims = self.claims[id(member)] = (self.graph, {})
        shape = claims[1].get(ref)
        if shape is None:
            if ref in self.unknown:
                shape = self.graph.shapes.get(ref) if self.graph is not None else None
            else:
                shape = tf.TensorShape(member.trace.records[ref.record].outputs[ref.index].shape)
            claims[1][ref] = shape
        return shape


# ------------------------------------------------------------------------------------ derivation
_DERIVABLE = frozenset({"int32", "int64", "float32", "float64"})


def derive(relaxed: Relaxed, traces) -> dict:
    """`{slot: rules}` for the shape constants of `relaxed` that the graph can compute from the
    shapes of values it holds, as every member's trace in `traces` shows: element by element,
    either the same number in every member (`("const", v)`) or, in every member, the product
    of dimensions `dims` of one earlier value's shape (`("dims", ref, dims)`: the length a
    gradient tiles by, a mean's count). A constant with an element no rule explains is not
    derived (the member puts its own)."""
    out = {}
    for slot, (record, pos) in relaxed.const_sites.items():
        spec = relaxed.trace.feeds[slot].spec
        if spec.dtype not in _DERIVABLE or spec.shape is None or len(spec.shape) > 1 or \
                int(np.prod(spec.shape)) > 8:
            continue
        values = [constant_value(t.records[record].input_refs()[pos]).reshape(-1)
                  for t in traces]
        rules = []
        for k in range(values[0].size):
            col = [v[k].item() for v in values]
            if all(c == col[0] for c in col):
                rules.append(("const", col[0]))
                continue
            rule = None
            if all(float(c).is_integer() for c in col):
                rule = _dims_rule(relaxed.trace, traces, record, [int(c) for c in col])
            if rule is None:
                break
            rules.append(rule)
        else:
            out[slot] = tuple(rules)
    return out


def current_record(group, rec, shape_of):
    """Record `rec` of a member with each shape constant the group's graph computes replaced by
    the value its rules give for the shapes `shape_of(ref)` returns (this iteration's: another
    length than the member was traced with). None where a shape is not known."""
    sites = group.const_positions().get(rec.index)
    if not sites:
        return rec
    flat = list(rec.input_refs())
    for pos, slot in sites.items():
        spec = group.relaxed.trace.feeds[slot].spec
        values = []
        for rule in group.derived[slot]:
            if rule[0] == "const":
                values.append(rule[1])
                continue
            shape = shape_of(rule[1])
            if shape is None or any(shape[d] is None for d in rule[2]):
                return None
            values.append(math.prod(shape[d] for d in rule[2]))
        value = np.asarray(values, dtype=tf.as_dtype(spec.dtype).as_numpy_dtype)
        flat[pos] = ConstRef(frozen_value(value.reshape(spec.shape), spec.dtype), spec.dtype)
    it = iter(flat)
    inputs = tuple(tuple(next(it) for _ in x) if isinstance(x, tuple) else next(it)
                   for x in rec.inputs)
    return replace(rec, inputs=inputs)


def rules_hold(derived: dict, relaxed: Relaxed, trace: Trace) -> bool:
    """Whether every rule of `derived` gives the constant that member trace `trace` holds."""
    for slot, rules in derived.items():
        record, pos = relaxed.const_sites[slot]
        want = constant_value(trace.records[record].input_refs()[pos]).reshape(-1)
        for rule, v in zip(rules, want):
            got = rule[1] if rule[0] == "const" else \
                math.prod(_shape_of(trace, rule[1])[d] for d in rule[2])
            if got != v.item():
                return False
    return True


def _shape_of(trace, ref):
    if isinstance(ref, FeedRef):
        return trace.feeds[ref.slot].spec.shape
    return trace.records[ref.record].outputs[ref.index].shape


def _dims_rule(relaxed_trace, traces, before, col):
    """The first value before record `before` (feeds first, then outputs in record order) and
    the fewest of its dimensions, one at least unknown in the relaxed trace, whose product is
    `col[i]` in member `i`'s trace, for every member; None if there is none."""
    refs = [FeedRef(f.slot) for f in relaxed_trace.feeds if f.source != SHAPE_CONSTANT]
    refs += [OutputRef(r.index, j) for r in relaxed_trace.records[:before]
             for j in range(len(r.outputs))]
    for ref in refs:
        shape = _shape_of(relaxed_trace, ref)
        if shape is None or None not in shape or len(shape) > 4:
            continue
        shapes = [_shape_of(t, ref) for t in traces]
        if any(s is None or None in s for s in shapes):
            continue
        subsets = sorted((c for n in range(1, len(shape) + 1)
                          for c in itertools.combinations(range(len(shape)), n)
                          if any(shape[d] is None for d in c)), key=len)
        for dims in subsets:
            if all(math.prod(s[d] for d in dims) == v for s, v in zip(shapes, col)):
                return ("dims", ref, dims)
    return None


# ----------------------------------------------------------------------------------- speculation
# Image ops whose size input, a constant Python computed (`tf.image.resize(x, (h, h))` with `h`
# from a random ratio), is a length a program may change from step to step; NHWC, so the
# dimensions the size sets are 1 and 2 of the values downstream.
SIZE_INPUTS = {"ResizeBilinear": 1, "ResizeNearestNeighbor": 1, "ResizeBicubic": 1,
               "ResizeArea": 1}
_SPATIAL = (1, 2)
# the dimension sets of an NHWC value a count may take; each takes a spatial one
_SPATIAL_SUBSETS = tuple(c for n in range(1, 5) for c in itertools.combinations(range(4), n)
                         if set(c) & set(_SPATIAL))


def speculate(trace: Trace) -> Relaxed | None:
    """A relaxed trace for a shape group of one path, built before a second is seen: each image
    size constant of `trace` (`SIZE_INPUTS`) becomes a shape constant the member puts, and so
    does each constant downstream of it with an element that is, in this trace, a product of
    dimensions of a value downstream that takes a spatial one (a mean's count, a tiling of the
    gradient: what a path with another size would hold another value of). Every member puts its
    own (none is computed: one trace cannot tell a rule from a coincidence, such as a batch of
    16 against a 4 x 4 map), and the relaxed trace keeps this trace's exact shapes (nothing runs
    with another shape on the group's graph until a second member joins; `covers_open` says
    whether it may). None if `trace` has no such size, or an op whose shapes a member's trace
    does not fix (a data-dependent op, a function call): then the path's own graph."""
    records = trace.records
    if any(r.route == "function" or r.op_type in _DATA_DEPENDENT for r in records):
        return None
    sizes = {r.index for r in records if r.op_type in SIZE_INPUTS and _small_int_const(
        r.input_refs()[SIZE_INPUTS[r.op_type]])}
    if not sizes:
        return None
    first = min(sizes)
    downstream = set(sizes)
    for r in records[first + 1:]:
        if any(isinstance(x, OutputRef) and x.record in downstream for x in r.input_refs()):
            downstream.add(r.index)
    lengths = set()   # products of the spatial dimensions of values downstream, so far
    feeds, values = list(trace.feeds), list(trace.feed_values)
    const_sites, new_records = {}, list(records)
    for i in sorted(downstream):
        rec = records[i]
        flat = list(rec.input_refs())
        changed = False
        for pos, ref in enumerate(flat):
            if i in sizes and pos == SIZE_INPUTS[rec.op_type] or _holds_length(ref, lengths):
                slot = len(feeds)
                feeds.append(Feed(slot, TensorSpec(ref.dtype, tuple(np.shape(ref.value))),
                                  SHAPE_CONSTANT))
                values.append(constant_value(ref))
                const_sites[slot] = (i, pos)
                flat[pos], changed = FeedRef(slot), True
        if changed:
            it = iter(flat)
            inputs = tuple(tuple(next(it) for _ in x) if isinstance(x, tuple) else next(it)
                           for x in rec.inputs)
            new_records[i] = replace(rec, inputs=inputs)
        for o in rec.outputs:
            if o.shape is not None and len(o.shape) == 4 and None not in o.shape:
                lengths.update(math.prod(o.shape[d] for d in dims) for dims in _SPATIAL_SUBSETS)
    out = Trace(trace.site, new_records, feeds, values, list(trace.fetches),
                dict(trace.variables), list(trace.unsupported), dict(trace.functions),
                list(trace.unseeded_random), list(trace.fast_fallbacks))
    return Relaxed(out, const_sites)


def _small_int_const(ref) -> bool:
    return isinstance(ref, ConstRef) and ref.dtype in ("int32", "int64") and \
        len(np.shape(ref.value)) == 1 and 0 < np.shape(ref.value)[0] <= 8


def _holds_length(ref, lengths) -> bool:
    """Whether constant `ref` (a number or a short vector) has an element in `lengths`."""
    if not isinstance(ref, ConstRef) or ref.dtype not in _DERIVABLE:
        return False
    shape = np.shape(ref.value)
    if len(shape) > 1 or int(np.prod(shape)) > 8:
        return False
    return any(float(v).is_integer() and int(v) >= 2 and int(v) in lengths
               for v in constant_value(ref).reshape(-1).tolist())


def covers_open(graph, group_relaxed: Relaxed, relaxed: Relaxed) -> bool:
    """Whether `graph`, built for a speculative group's trace `group_relaxed`, runs a member
    whose joining relaxed it to `relaxed`: the same ops, inputs and feeds, and every dimension
    the members differ in is one the graph's own inference leaves open."""
    if [f.spec for f in relaxed.trace.feeds] != [f.spec for f in group_relaxed.trace.feeds]:
        return False
    for a, b in zip(group_relaxed.trace.records, relaxed.trace.records):
        if a.outputs == b.outputs:
            if a != b:
                return False
            continue
        if replace(a, outputs=b.outputs) != b:
            return False
        for j, o in enumerate(b.outputs):
            if o.shape is None:
                return False
            known = graph.shapes.get(OutputRef(a.index, j))
            if known is None or known.rank != len(o.shape):
                return False
            dims = known.as_list()
            if any(d is None and g is not None for d, g in zip(o.shape, dims)):
                return False
    return True
