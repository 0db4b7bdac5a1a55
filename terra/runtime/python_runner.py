"""PythonRunner: the skeleton run of the user's Python during the co-execution phase.

While a generated graph computes an iteration, the user's Python still runs, but every TF op is
*skipped*: the runner checks it against the next record of the path the graph executes (op type,
attrs, and every input: the same producer, variable, constant value or feed slot), returns
placeholders for its outputs, and puts new external values (data, changed Python values) into the
graph's feed channels. Checking data flow, not the call site, is what makes a skipped op safe: the
graph computes exactly this op on exactly these inputs. A check that fails is a `Divergence`; the
session then falls back (terra/runtime/fallback.py).

Coarse units: a whole `tape.gradient` call is matched as one unit (its target and sources must be
the recorded ones) and its recorded backward ops are skipped without looking at them
(terra/runtime/unit_skip.py).

Placeholders are the runtime's `Placeholder` (terra/runtime/placeholders.py) with one change
(`SkipPlaceholder`): while its iteration is being skipped, converting it to a tensor returns the
placeholder itself, so op wrappers hand it to the hook instead of fetching its value.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.ir.op_kinds import HOST_OPS
from terra.ir.records import ConstRef, FeedRef, Fetch, OutputRef, VariableRef
from terra.runtime.op_inputs import (attr_types, may_take_variable, np_dtype_name,
                                     single_output, takes_variables, tape_word, variable_ref)
from terra.runtime.divergence import (GRAPH_ERROR, PAST_END, Diverged, Divergence,
                                      DivergenceKind, user_line)
from terra.runtime.path_view import PathView, host_tail
from terra.runtime.placeholders import Placeholder
from terra.runtime.new_shapes import NewShapes
from terra.runtime.unit_skip import UNSET, UnitSkipping  # noqa: F401 - UNSET: re-exported
from terra.tracing import hook
from terra.tracing.recorder import frozen_value, is_python_value, freeze_attr


# ------------------------------------------------------------------------------------ placeholders
class SkipPlaceholder(Placeholder):
    """A Placeholder that passes through tensor conversion while its iteration is skipped."""

    def __tf_tensor__(self, dtype=None, name=None):
        owner = self.__dict__.get("_terra_owner")
        # the op is skipped too: hand it the placeholder. Only while the hook routes this
        # thread's ops to the owner: an op that runs for real (the iteration has ended, or
        # another thread converts) must get the value, or TF's execute gets no tensor at all
        if owner is not None and owner.skipping and hook.active() is owner:
            return self
        return super().__tf_tensor__(dtype, name)


# Arithmetic operators of a skipped float placeholder, by the op TF's operator issues for a
# Python number or a tensor of its dtype (and reversed: the operand is the op's first input):
# the operator's layers above that op (traceback filter, name scope, dtype promotion, dispatch,
# conversion of the number) cost more than matching the op; the op is the same op, and the
# raw op's wrapper routes it to the hook as TF's own call would. Anything else takes TF's
# operator.
_OPERATORS = {"__add__": ("AddV2", False), "__radd__": ("AddV2", True),
              "__sub__": ("Sub", False), "__rsub__": ("Sub", True),
              "__mul__": ("Mul", False), "__rmul__": ("Mul", True),
              "__truediv__": ("RealDiv", False), "__rtruediv__": ("RealDiv", True),
              "__pow__": ("Pow", False), "__rpow__": ("Pow", True)}
_FLOATS = frozenset(tf.dtypes.as_dtype(d) for d in ("float16", "bfloat16", "float32", "float64"))


def _operator(method, op_type, reverse):
    tf_method = getattr(tf.Tensor, method)
    raw = getattr(tf.raw_ops, op_type)

    def operator(self, other):
        owner = self.__dict__.get("_terra_owner")
        if owner is not None and owner.skipping and hook.active() is owner and \
                self._dtype in _FLOATS and (
                    type(other) in (float, int) or
                    isinstance(other, (Placeholder, tfp.EagerTensorBase)) and
                    other.dtype == self._dtype) and tfp.plain_operator_dtypes():
            return raw(x=other, y=self) if reverse else raw(x=self, y=other)
        return tf_method(self, other)
    operator.__name__ = method
    return operator


for _method, (_op, _reverse) in _OPERATORS.items():
    setattr(SkipPlaceholder, _method, _operator(_method, _op, _reverse))


def placeholder_ref(x, runner) -> Optional[OutputRef]:
    """The OutputRef of `x` if it is a placeholder of `runner`'s current iteration."""
    if isinstance(x, SkipPlaceholder) and x.__dict__.get("_terra_owner") is runner \
            and not x._terra_bound:
        return x.__dict__["_terra_ref"]
    return None


class _Resolver:
    """Resolves a placeholder through the session (fetch channel, run output, or fallback)."""

    __slots__ = ("iteration", "ref")

    def __init__(self, iteration, ref):
        self.iteration = iteration
        self.ref = ref

    def resolve(self):
        return self.iteration.resolve(self.ref)


# ------------------------------------------------------------------------------------ the runner
class PythonRunner(UnitSkipping, NewShapes, hook.Interceptor):
    """Skip mode for one iteration on one path. `iteration` is the session's iteration object: it
    owns the feed/fetch channels, and `iteration.fallback(divergence)` ends skip mode."""

    def __init__(self, iteration, view: PathView):
        self.iteration = iteration
        self.view = view
        self.pos = 0
        self.skipping = True
        self.placeholders: dict = {}   # (record, index) -> SkipPlaceholder
        self.fed: dict = {}            # slot -> value put into its channel
        self.fed_ids: dict = {}        # slot -> id of the object fed
        self.born: dict = {}           # id(tensor) -> (tensor, python value), this iteration
        self.fetch_log: list = []      # Fetch records of this iteration
        self.fed_order: list = []      # slots in the order they were fed
        self.passed: list = []         # starts of the coarse units skipped (their gates opened)
        self._raised = None            # op type whose fast path this runner refused, until an
                                       # op comes on the slow route (its own, after conversions)
        self._frozen_cache: dict = {}
        self.handles: dict = {}        # id(handle) -> (handle, variable) seen this iteration
        self.advance = None            # called with `pos` after each match (SiteRun.advance)
        # from this record on, shapes are this iteration's, not the path's (`_takes_new_shape`)
        self.shape_from: Optional[int] = None
        self.new_feed = None    # (slot, dtype, shape) of a feed that diverged on its signature
        self.data_divergence = None    # that divergence, where data handed to a unit made it
        self.new_shapes: dict = {}     # feed slot -> shape, record index -> output shapes
        self.shapes_checked: set = set()  # data-dependent shapes checked equal to the traced
        self.generic_units: set = set()   # starts of units skipped with other shapes than traced

    # ------------------------------------------------------------------ hook callbacks
    def variable_handle(self, variable, handle) -> None:
        """Remember which variable owns a handle, so a fallback's recorder can name variables
        whose handles it first meets as op inputs (instead of searching the heap)."""
        self.handles[id(handle)] = (handle, variable)
        recorder = self.iteration.recorder
        if recorder is not None:
            recorder.variable_handle(variable, handle)

    def converted(self, value, dtype, tensor) -> None:
        if self.skipping:
            self.born[id(tensor)] = (tensor, value)

    def op(self, op_type, inputs, attrs, route, run):
        if not self.skipping:  # after a fallback the session routes ops to the recorder
            return run()
        refused = self._raised
        if route == "fallback":
            self._raised = None  # the refused op's slow route has come
        mark = len(self.fed_order)
        self.new_feed = None
        try:
            p = self.pos
            outs = self._skip(op_type, inputs, attrs, route)
            if op_type in HOST_OPS:  # matched: now it really runs, on the fetched inputs
                _log_twin_reads(inputs)  # (the execute hook resolves the placeholders in place)
                return run()
            if p in self.view.twins:
                self._run_twin(outs, inputs, route, run)
            return outs
        except Diverged as d:
            self.rollback(mark)
            if d.divergence.kind is not DivergenceKind.GRAPH_ERROR:
                tried = {id(self.iteration.path)}
                pos = self.pos
                # (a path whose op here is a variable read may be right when the op takes a
                # variable on the fast route: that route runs the reads of variable inputs
                # only after it hands the op to the slow route)
                kinds = (op_type, "ReadVariableOp") if route == "fast" and \
                    may_take_variable(inputs) else (op_type,)
                fits = self._feed_fits(pos)
                accepts = None if route == "function" else (
                    lambda q: q.view.records[pos].op_type in kinds and
                    takes_variables(q.view.records[pos], op_type, inputs) and fits(q))
                while self.iteration.switch(d.divergence, tried=tried, accepts=accepts):
                    try:
                        return self._skip(op_type, inputs, attrs, route)
                    except Diverged as d2:
                        self.rollback(mark)
                        d = d2
            # past the path's end (or where only its host-op tail is left): the loop may be
            # over, unless another path goes on from here, or the program is still inside a
            # tape's block whose ops were skipped (a path traced through a step that raised, and
            # the program caught, ends at the op that failed; then only the next batch's host
            # op may follow it)
            if (d.divergence.kind is DivergenceKind.PAST_END and
                    not self.iteration.extended_elsewhere() or
                    self._in_host_tail(d.divergence)) and not self.iteration.tape_open():
                self.iteration.finish_past_end(d.divergence)
                if route != "fast" and isinstance(inputs, list):
                    for i, v in enumerate(inputs):
                        if isinstance(v, Placeholder):
                            inputs[i] = v._terra_materialize()
                return run()
            recorder = self.iteration.fallback(d.divergence)
            if refused is not None and (route != "fallback" or refused == op_type):
                # the divergence is the refused op's slow route, or one of its input conversions
                # (a variable read): the recorder marks the op as eager's fast-path-first route,
                # so the path's later runs refuse its fast path too instead of diverging there
                recorder.retry_on_slow_route(refused)
            if route != "fast" and isinstance(inputs, list):
                # converted inputs may be placeholders (passed through while skipping): the op
                # now really runs, on their values
                for i, v in enumerate(inputs):
                    if isinstance(v, Placeholder):
                        inputs[i] = v._terra_materialize()
            return recorder.op(op_type, inputs, attrs, route, run)

    def _in_host_tail(self, d: Divergence) -> bool:
        """Whether `d` came where only host ops outside any tape are left of the path
        (`path_view.host_tail`): the iteration ends there, as past the path's end, rather than
        falling back to trace what the program does between steps instead."""
        return d.kind is not DivergenceKind.GRAPH_ERROR and \
            host_tail(self.view.records, d.position)

    def _run_twin(self, outs, inputs, route, run) -> None:
        """Run a matched op eagerly too (`PathView.twins`) and make its placeholders hold the
        results, when its inputs are values Python has (not the graph's: those would be a
        fetch). Placeholders among them (earlier twins' results) are resolved in place on the
        slow route only (`_skip` sends such an op there)."""
        if self._pending_here(inputs) or route == "fast" and _placeholders(inputs):
            return
        real = run()
        phs = outs if isinstance(outs, (list, tuple)) else [outs]
        vals = real if isinstance(real, (list, tuple)) else [real]
        if len(phs) != len(vals):
            return
        for ph, v in zip(phs, vals):
            self.hold_twin(ph, v)

    def hold_twin(self, ph, v) -> None:
        """Make placeholder `ph` hold `v`, its eager twin's value, where it fits."""
        if isinstance(ph, Placeholder) and isinstance(v, tfp.EagerTensor) and \
                ph._terra_value is None and v.dtype == ph._dtype and \
                ph._shape_val.is_compatible_with(v.shape):
            ph.__dict__["_terra_value"] = v
            ref = placeholder_ref(ph, self)
            if ref is not None:  # a read of it is still a read (`_log_twin_reads`)
                ph.__dict__["_terra_on_read"] = functools.partial(self.log_fetch, ref)
            self.iteration.session.counters.eager_twins += 1

    # ------------------------------------------------------------------ matching
    def _diverge(self, reason, expected, observed, kind=DivergenceKind.MISMATCH):
        raise Diverged(Divergence(user_line(), str(expected), str(observed), self.pos, reason,
                                  kind))

    def _skip(self, op_type, inputs, attrs, route):
        view, p = self.view, self.pos
        if route == "fast" and p < view.n and view.records[p].op_type == op_type and (
                op_type in HOST_OPS or view.records[p].route == "fallback" and
                p in view.fast_fallbacks and (p in view.twins or may_take_variable(inputs))):
            # a host op runs for real, and only the slow route hands over an input list whose
            # placeholders can be resolved in place; an op eager sent to its slow route reads
            # its variable inputs there first, and an eager twin runs for real on eager's route.
            # Any other (eager's fast path refused a Python number under a tape: the recorder's
            # `_has_raw_value`) issued no op before it (the record here is the op): matched
            # here, its numbers as the constants they became, it skips the wrapper's slow route
            self._raised = op_type
            raise tfp.FallbackException()
        if route == "fast" and p in view.twins and view.records[p].op_type == op_type and \
                _placeholders(inputs) and not self._pending_here(inputs):
            # an eager twin on earlier twins' results, or on an earlier iteration's values
            # (matching reads them: external values now): only the slow route's input list has
            # its placeholders resolved in place when the op runs
            self._raised = op_type
            raise tfp.FallbackException()
        if self.iteration.run_failed():
            self._diverge(GRAPH_ERROR, "no error", "the graph failed", DivergenceKind.GRAPH_ERROR)
        if p >= view.n:
            self._diverge(PAST_END, "end of iteration", op_type, DivergenceKind.PAST_END)
        rec = view.records[p]
        # fast and slow routes of one op are the same op (which one TF takes depends on the
        # inputs' Python types, e.g. a placeholder makes the C fast path bail out)
        if route == "fast":
            if rec.route == "function" or rec.op_type != op_type:
                if op_type in view.fallback_types and self._fallback_ahead(op_type):
                    self._raised = op_type
                    raise tfp.FallbackException()  # the wrapper converts, then retries slowly
                self._diverge("different op", rec.function or rec.op_type, op_type)
            self._check_fast_attrs(rec, attrs, p)
            for arg, e in zip(inputs, rec.inputs):
                if isinstance(e, tuple):
                    if not isinstance(arg, (list, tuple)) or len(arg) != len(e):
                        self._diverge("different list input", e, type(arg).__name__)
                    for v, r in zip(arg, e):
                        self._match(v, r, rec)
                else:
                    self._match(arg, e, rec)
        else:
            want = rec.function if route == "function" else rec.op_type
            if (rec.route == "function") != (route == "function") or want != op_type:
                self._diverge("different op", rec.function or rec.op_type, op_type)
            if op_type not in HOST_OPS:  # a host op runs with the program's own attrs
                self._check_full_attrs(rec, attrs, p, route)
            flat = view.flat_inputs[p]
            if len(inputs) != len(flat):
                self._diverge("different input count", len(flat), len(inputs))
            for v, r in zip(inputs, flat):
                self._match(v, r, rec)
        if route != "function" and rec.taped != tfp.tapes_recording():
            # the same op, recorded otherwise (a `stop_recording()` taken this time only): its
            # gradient differs
            self._diverge("recorded otherwise", tape_word(rec.taped), tape_word(not rec.taped))
        if self.shape_from is not None and p >= self.shape_from:
            self._infer_shapes(rec)
        self.pos = p + 1
        if self.advance is not None:
            self.advance(p + 1)
        outs = [self.placeholder(rec, j) for j in range(len(rec.outputs))]
        if p in view.barriers:  # inside the program's try: its error is raised here
            outs[0]._terra_materialize()
        if self.pos == view.n and view.end_sync:
            self.iteration.wait_run()
        if route == "fast":
            if not outs:
                return None
            return outs[0] if single_output(op_type) else outs
        return outs

    def _pending_here(self, x) -> bool:
        """Whether `x` (an op's input, lists nested) holds a placeholder of this iteration
        without a value yet (one of an earlier iteration is an external value: matching reads
        it)."""
        if isinstance(x, Placeholder):
            return not x.is_materialized and placeholder_ref(x, self) is not None
        if isinstance(x, (list, tuple)):
            return any(self._pending_here(v) for v in x)
        return False

    def _fallback_ahead(self, op_type) -> bool:
        view, p = self.view, self.pos
        for q in range(p, min(p + 6, view.n)):
            if q in view.fast_fallbacks and view.records[q].op_type == op_type:
                return True
        return False

    def _check_fast_attrs(self, rec, attrs, p):
        cached = self.view.attr_cache.get(p)
        if cached is not None:
            try:
                if cached == attrs:
                    return
            except Exception:  # noqa: BLE001 - arrays in attrs: compare the slow way
                pass
        types = attr_types(rec.op_type)
        full = dict(rec.attrs)
        for i in range(0, len(attrs), 2):
            name, value = attrs[i], attrs[i + 1]
            if value is None and types.get(name) != "shape":
                continue
            try:
                frozen = freeze_attr(types[name], value)
            except Exception:  # noqa: BLE001
                self._diverge("unreadable attr", name, repr(value))
            if full.get(name) != frozen:
                self._diverge(f"different attr {name}", full.get(name), frozen)
        self.view.attr_cache[p] = attrs

    def _check_full_attrs(self, rec, attrs, p, route):
        cached = self.view.attr_cache.get(p)
        if cached is not None:
            try:
                if cached == attrs:
                    return
            except Exception:  # noqa: BLE001
                pass
        if route == "function":
            pairs = tuple(sorted((attrs[i], attrs[i + 1]) for i in range(0, len(attrs), 2)))
            if pairs != rec.attrs:
                self._diverge("different function attrs", rec.attrs, pairs)
        else:
            self._check_fast_attrs(rec, attrs, p)
        self.view.attr_cache[p] = attrs

    def _frozen(self, v, dtype):
        key = (type(v), v, dtype) if isinstance(v, (bool, int, float, str, bytes)) else None
        if key is not None:
            f = self._frozen_cache.get(key)
            if f is None:
                f = self._frozen_cache[key] = frozen_value(v, dtype)
            return f
        return frozen_value(v, dtype)

    def _match(self, v, e, rec):
        """Check one input value `v` against recorded ref `e` (feeding it when `e` is a feed)."""
        if isinstance(v, SkipPlaceholder) and v.__dict__.get("_terra_owner") is self \
                and not v._terra_bound:
            if v.__dict__["_terra_ref"] != e:
                self._diverge("different producer", e, v.__dict__["_terra_ref"])
            return
        if isinstance(v, Placeholder):  # from an earlier iteration: an external value now
            v = v._terra_materialize()
        if isinstance(e, VariableRef) and rec.op_type in HOST_OPS and (
                isinstance(v, tfp.EagerTensorBase) and v.dtype == _RESOURCE or
                isinstance(v, tfp.BaseResourceVariable)):
            return  # a host op's writer or iterator: by role (op_kinds.HOST_OPS)
        if isinstance(v, tfp.EagerTensorBase):
            if v.dtype == _RESOURCE:
                if not (isinstance(e, VariableRef) and e.key == id(v)):
                    self._diverge("different variable", e, "resource tensor")
                return
            born = self.born.get(id(v))
            if born is not None and born[0] is v and (is_python_value(born[1]) or isinstance(
                    born[1], (np.ndarray, np.generic)) and isinstance(e, ConstRef)):
                if isinstance(e, ConstRef):
                    if self._frozen(born[1], e.dtype) != e.value or v.dtype.name != e.dtype:
                        self._diverge("different constant", e, born[1])
                    return
            if isinstance(e, FeedRef):
                self.feed(e.slot, v, v)
                return
            self._diverge("external tensor where the path has no feed", e, f"tensor {v.shape}")
        if isinstance(v, tfp.BaseResourceVariable):
            if not (isinstance(e, VariableRef) and e.key == id(v.handle)):
                self._diverge("different variable", e, getattr(v, "name", "variable"))
            return
        if isinstance(v, (np.ndarray, np.generic)):
            if isinstance(e, ConstRef):
                if self._frozen(v, e.dtype) != e.value:
                    self._diverge("different constant", e, "ndarray")
                return
            if isinstance(e, FeedRef):
                self.feed(e.slot, v, v)
                return
            self._diverge("numpy value where the path has no feed", e, f"ndarray {v.shape}")
        if is_python_value(v):
            if isinstance(e, ConstRef):
                try:
                    ok = self._frozen(v, e.dtype) == e.value
                except Exception:  # noqa: BLE001
                    ok = False
                if not ok:
                    self._diverge("different constant", e, repr(v)[:60])
                return
            if isinstance(e, FeedRef):
                self.feed(e.slot, v, v)
                return
            self._diverge("Python value where the path has no feed", e, repr(v)[:60])
        handle = getattr(v, "handle", None)  # keras.Variable and friends
        if handle is not None and isinstance(e, VariableRef) and e.key == id(handle):
            return
        self._diverge("unsupported input", e, type(v).__name__)

    def feed(self, slot, obj, value):
        prev = self.fed_ids.get(slot)
        if prev is not None:
            if prev != id(obj):
                self._diverge("a feed slot got two different values", f"feed{slot}", "new value")
            return
        spec = self.view.feed_specs[slot]
        if isinstance(value, tfp.EagerTensorBase):
            dtype, shape = value.dtype.name, tuple(value.shape.as_list())
        else:
            a = np.asarray(value)
            dtype = spec.dtype if not isinstance(value, np.ndarray) else None
            if dtype is None:
                dtype = np_dtype_name(a.dtype, spec.dtype)
            shape = tuple(a.shape)
        if (dtype != spec.dtype or shape != spec.shape) and \
                not self._takes_new_shape(slot, dtype, shape):
            self.new_feed = (slot, dtype, shape)
            self._diverge("feed with a new signature", spec, f"{dtype}{list(shape)}")
        self.record_feed(slot, obj, value)

    def _feed_fits(self, pos):
        """For a switch after a feed of a new signature at record `pos` (`new_feed`): whether a
        path feeds that input with that signature, or runs a shape group's graph (which may
        take it). Other paths would diverge at the same feed again, each after a restart."""
        if self.new_feed is None:
            return lambda q: True
        slot, dtype, shape = self.new_feed
        mine = self.view.records[pos].input_refs()

        def fits(q):
            if q.group is not None:
                return True
            for a, b in zip(mine, q.view.records[pos].input_refs()):
                if isinstance(a, FeedRef) and a.slot == slot and isinstance(b, FeedRef):
                    spec = q.view.feed_specs[b.slot]
                    return spec.dtype == dtype and spec.shape is not None and \
                        tuple(spec.shape) == shape
            return True
        return fits

    def record_feed(self, slot, obj, value) -> None:
        """Feed slot `slot` with `value` (Python supplied `obj`): remembered, and put."""
        self.fed_ids[slot] = id(obj)
        self.fed[slot] = obj
        self.fed_order.append(slot)
        self.iteration.put_feed(slot, value)

    def rollback(self, mark):
        """Forget feeds of an op that diverged half-way (its channel is drained or replaced)."""
        while len(self.fed_order) > mark:
            slot = self.fed_order.pop()
            self.fed.pop(slot, None)
            self.fed_ids.pop(slot, None)

    def placeholder(self, rec, j, ref=None):
        key = (rec.index, j)
        ph = self.placeholders.get(key)
        if ph is None:
            spec = rec.outputs[j]
            if ref is None:
                ref = OutputRef(rec.index, j)
            mine = self.new_shapes.get(rec.index)
            shape = self.iteration.exe.static_shape(ref) if mine is None else mine[j]
            ph = SkipPlaceholder.create(spec.dtype, spec.shape if shape is None else shape,
                                        _Resolver(self.iteration, ref))
            d = ph.__dict__
            d["_terra_owner"] = self
            d["_terra_ref"] = ref
            self.placeholders[key] = ph
        return ph

    # ------------------------------------------------------------------ units
    def ref_of(self, x):
        """Ref of a tensor or variable for unit guards (None if it has none)."""
        r = placeholder_ref(x, self)
        if r is not None:
            return r
        return variable_ref(x)

    def log_fetch(self, ref, how="numpy"):
        self.fetch_log.append(Fetch(ref, self.pos, how))


_RESOURCE = tf.resource


def _log_twin_reads(inputs) -> None:
    """A host op's inputs are reads (an eager trace records them as fetches): log those that
    eager twins answered without the graph, so a fallback's trace has them as eager's would
    (without them, the path it files would not fetch the value, and its next run would fall
    back at the host op)."""
    for x in inputs:
        for e in (x if isinstance(x, (list, tuple)) else (x,)):
            if isinstance(e, Placeholder):
                on_read = e.__dict__.pop("_terra_on_read", None)
                if on_read is not None:
                    on_read()


def _placeholders(x, pending_only=False) -> bool:
    """Whether `x` (an op's input, lists nested) holds a placeholder (`pending_only`: one
    without a value yet)."""
    if isinstance(x, Placeholder):
        return not (pending_only and x.is_materialized)
    if isinstance(x, (list, tuple)):
        return any(_placeholders(v, pending_only) for v in x)
    return False



__all__ = ["PythonRunner", "SkipPlaceholder", "placeholder_ref", "UNSET"]
