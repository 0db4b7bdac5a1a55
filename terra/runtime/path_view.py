"""What skip mode needs about one compiled path, precomputed once per path: its records and
flat inputs, its coarse units (`GradUnit`), where its feeds are first used, and the records
that are sync points because an error of theirs must be raised inside the program's own `try`
(`barrier_records`)."""
from __future__ import annotations

from dataclasses import dataclass

from terra import _tf_private as tfp
from terra.ir.op_kinds import HOST_OPS, VALUE_SAFE_OPS
from terra.ir.records import FRAME_LOOPS, FRAME_TRIES, ConstRef, FeedRef, OutputRef, Trace
from terra.tracing.locations import code_info


@dataclass(slots=True)
class GradUnit:
    """One recorded `tape.gradient` call: records [start, end) are its ops. `guard` holds the
    refs of its target, sources and output gradients (flattened) and its unconnected-gradients
    mode; `result` the refs of its flat results (None for a None gradient)."""
    start: int
    end: int
    guard: tuple
    result: tuple
    feeds: tuple = ()   # slots first used inside the unit: TF-cached tensors, fed as recorded
    structure: object = None   # the recorded result when it holds composites (IndexedSlices)
    # (ref, value) of every tensor value the unit's Python read while traced (a gradient
    # function's `constant_value` of a slice's bounds, an optimizer's branch on a finite check):
    # what the recorded ops were built from, so skip mode checks them before skipping the unit
    reads: tuple = ()
    # a `tape.gradient`: its gradient functions read the shapes of every forward op they visit
    backprop: bool = False
    # a call of a TF API function (units.py `api_call`): not a unit where it holds an eager
    # twin (the next batch sliced in the tail runs eagerly, op by op, as before)
    api: bool = False
    # a gradient list's packing plan (units.py `_gradient_plan`): None packs by `structure`
    pack: tuple = None
    # (flat result index, attribute, ref) of a Keras tag set on a result (a softmax's
    # `_keras_logits`): skip mode sets it on the result's placeholder, to that ref's
    tags: tuple = ()


def barrier_records(trace: Trace, root) -> frozenset:
    """Records skip mode waits for as soon as it matched them: ops that may raise for a value
    (not `VALUE_SAFE_OPS`), issued inside a `try` with an `except` clause that lies within the
    iteration, so their error is raised inside that `try`, as in eager, not at a later sync
    point outside it. `root` is the site's (code, offset of its `with`): in the tape's own
    frame only a `try` that begins after the `with` counts (one around the whole loop or step
    has its errors raised at a later sync point inside it); in a frame that called the tape's
    function, none does. Ops inside a coarse unit are not visited one by one (not covered)."""
    code, lasti = root
    root_label = code_info(code).label + "@"
    out = set()
    for rec in trace.records:
        if rec.op_type in VALUE_SAFE_OPS or not rec.outputs or rec.location is None:
            continue
        for k, label in enumerate(rec.location.frames):
            starts = FRAME_TRIES.get(label, ())
            if not starts:
                continue
            if label.startswith(root_label):
                if any(s > lasti for s in starts):
                    out.add(rec.index)
                    break
            elif k > 0:
                out.add(rec.index)
                break
    return frozenset(out)


def ends_in_a_step_try(trace: Trace, root) -> bool:
    """Whether the iteration runs inside a `try`/`except` of the program that is entered anew
    every step (in the tape's own frame, or in the frame that calls the tape's function: inside
    the loop that drives the steps, or anywhere in a tape frame with no loop). Its run must then
    end, and an op error of it be raised, before Python leaves the path's last op, still
    inside that `try`: not in a later step's (`PythonRunner._sync_at_end`). A `try` around the
    whole loop does not count: any error ends the loop there anyway."""
    code, _ = root
    root_label = code_info(code).label + "@"
    seen = set()
    for rec in trace.records:
        if rec.location is None or not rec.location.frames:
            continue
        label = rec.location.frames[0]
        if label in seen:
            continue
        seen.add(label)
        loop = FRAME_LOOPS.get(label)
        starts = FRAME_TRIES.get(label, ())
        if label.startswith(root_label):
            if any(loop is None or s > loop for s in starts):
                return True
        elif loop is not None and any(s > loop for s in starts):
            return True
    return False


def eager_twins(trace: Trace, wanted) -> frozenset:
    """Records skip mode also runs eagerly, binding their placeholders to the results: ops no
    tape records (the program's data preparation before its next `with tape`, or arithmetic on
    integer scalars inside it: a tape never records an op on integers), stateless, whose inputs are
    all feeds, constants or other such records' outputs, and from which a value the program
    holds after the iteration or reads (`wanted`) comes. Such a value is otherwise a fetch
    Python waits for at its next use, usually at the next step's first layer: it comes from
    the end of the previous run, so the next step's skeleton could not start before that run
    ended (gpt2 slices `tokens[:, :-1]` before its tape; keras-io's WGAN-GP stacks the batch
    size into the shape of a random draw inside its tape, whose size Python reads). Eager computes
    the same ops again on the same values: the result is eager's own."""
    wanted_records = {r.record for r in wanted if isinstance(r, OutputRef)}
    if not wanted_records:
        return frozenset()
    eligible = set()
    for rec in trace.records:
        if rec.taped and not _integers_only(trace, rec) or rec.route == "function" or \
                rec.op_type in HOST_OPS or not rec.outputs:
            continue
        op_def = tfp.get_op_def(rec.op_type)
        if op_def is None or op_def.is_stateful:
            continue
        if all(isinstance(r, (FeedRef, ConstRef)) or
               (isinstance(r, OutputRef) and r.record in eligible) for r in rec.input_refs()):
            eligible.add(rec.index)
    # keep those a wanted value comes from
    keep, stack = set(), [i for i in wanted_records if i in eligible]
    while stack:
        i = stack.pop()
        if i in keep:
            continue
        keep.add(i)
        stack.extend(r.record for r in trace.records[i].input_refs()
                     if isinstance(r, OutputRef) and r.record in eligible)
    return frozenset(keep)


_UNTRAINABLE = frozenset({"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                          "uint64", "bool"})


def _integers_only(trace: Trace, rec) -> bool:
    """Whether `rec` is arithmetic on integer scalars (a batch size stacked into a shape): every
    output of a dtype no tape records (TF's tape watches floating and complex values only), so
    that run eagerly under a recording tape it is recorded by none, and every input a scalar of
    such a dtype, so that its outputs' shapes are the op's own, never the data's (a ragged
    batch's row lengths would give a twin of one shape group member's shape, unfit for another
    member's placeholder after a switch)."""
    def spec(r):
        if isinstance(r, FeedRef):
            return trace.feeds[r.slot].spec
        if isinstance(r, OutputRef):
            return trace.records[r.record].outputs[r.index]
        return None
    if not all(o.dtype in _UNTRAINABLE for o in rec.outputs):
        return False
    for r in rec.input_refs():
        if isinstance(r, ConstRef):
            if r.dtype not in _UNTRAINABLE:
                return False
            continue
        s = spec(r)
        if s is None or s.dtype not in _UNTRAINABLE or s.shape != ():
            return False
    return True


def twin_units(trace: Trace, units: dict, twins) -> dict:
    """The TF API calls (`GradUnit.api`) whose records are all eager twins reading only feeds,
    constants and one another (`tokens[:, :-1]` in the tail): skip mode checks such a call's
    guard and runs its records straight from the trace, instead of the API's Python with every
    op it issues matched and run one by one (ten times eager's cost for a slice)."""
    out = {}
    for s, u in units.items():
        if u.api and u.end > u.start and all(
                i in twins and all(isinstance(r, (FeedRef, ConstRef)) or
                                   isinstance(r, OutputRef) and u.start <= r.record < i
                                   for r in trace.records[i].input_refs())
                for i in range(u.start, u.end)) and \
                all(isinstance(r, OutputRef) and u.start <= r.record < u.end for r in u.result):
            out[s] = u
    return out


class PathView:
    """What skip mode needs about one compiled trace, precomputed for fast checks."""

    def __init__(self, trace: Trace, units: dict, root=None, caller_step_try: bool = False,
                 wanted=frozenset()):
        self.trace = trace
        self.twins = eager_twins(trace, wanted)
        self.twin_units = {}   # start -> an API call made only of eager twins (`twin_units`)
        self.twin_replay = None  # the eager replay that runs them (UnitSkipping.twin_unit)
        if self.twins:
            self.twin_units = twin_units(trace, units, self.twins)
            units = {s: u for s, u in units.items()
                     if not (u.api and any(i in self.twins for i in range(u.start, u.end)))}
        self.barriers = frozenset() if root is None else barrier_records(trace, root)
        self.end_sync = root is not None and (caller_step_try or ends_in_a_step_try(trace, root))
        self.records = trace.records
        self.units = units
        self.n = len(trace.records)
        self.flat_inputs = [rec.input_refs() for rec in trace.records]
        self.fast_fallbacks = frozenset(trace.fast_fallbacks)
        self.fallback_types = frozenset(trace.records[i].op_type for i in trace.fast_fallbacks)
        self.attr_cache: dict = {}
        self.single_output: dict = {}
        self.feed_specs = [f.spec for f in trace.feeds]
        self.shape_deps: dict = {}  # unit start -> values whose shapes the unit may read
        self.feed_first_use = {}
        for rec in trace.records:
            for r in self.flat_inputs[rec.index]:
                if isinstance(r, FeedRef):
                    self.feed_first_use.setdefault(r.slot, rec.index)

    def shapes_read_by(self, unit) -> tuple:
        """Outputs of records before `unit` whose shapes its Python may have built its ops
        from: its arguments and the values its ops consume; for a `tape.gradient`, every output
        of every record its target depends on (a gradient function reads the shapes of its
        forward op's inputs and outputs, consumed or not: `_SumGrad` tiles by its input's
        shape). Values the target does not depend on (a `tf.unique` of labels for a metric)
        are not among them."""
        refs = self.shape_deps.get(unit.start)
        if refs is not None:
            return refs
        roots = [r for r in _flat_refs(unit.guard) if r.record < unit.start]
        for i in range(unit.start, unit.end):
            roots.extend(r for r in self.flat_inputs[i]
                         if isinstance(r, OutputRef) and r.record < unit.start)
        out = dict.fromkeys(roots)
        if unit.backprop:
            seen, stack = set(), [r.record for r in roots]
            while stack:
                i = stack.pop()
                if i in seen:
                    continue
                seen.add(i)
                stack.extend(r.record for r in self.flat_inputs[i] if isinstance(r, OutputRef))
            out = {OutputRef(i, j): None for i in sorted(seen)
                   for j in range(len(self.records[i].outputs))}
        refs = self.shape_deps[unit.start] = tuple(out)
        return refs


def _flat_refs(guard):
    for g in guard:
        if isinstance(g, OutputRef):
            yield g
        elif isinstance(g, tuple):
            yield from _flat_refs(g)


def host_tail(records, pos: int) -> bool:
    """Whether only host ops outside any tape are left of a path from record `pos` on (the next
    batch's `IteratorGetNext`): the graph runs none of them, so an iteration that goes on
    otherwise there (an epoch's end makes a new iterator instead) has had all of the path's
    graph work and may end there, as past the path's end."""
    return 0 < pos < len(records) and all(r.op_type in HOST_OPS and not r.taped
                                          for r in records[pos:])


__all__ = ["GradUnit", "PathView", "barrier_records", "eager_twins", "ends_in_a_step_try", "host_tail",
           "twin_units"]
