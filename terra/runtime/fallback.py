"""Fallback: leave skip mode mid-iteration and continue eagerly with nothing lost.

On a divergence the graph is cancelled, the variables it may have written are restored from the
snapshot taken at iteration start (where it wrote any: see below), and the ops the skeleton
already matched (the "prefix") are
replayed eagerly, op by op, through TF's own execute path and recorded on the active gradient
tapes exactly as eager would have recorded them. Every placeholder the program holds is then bound
to its real value, and a `ContinuingRecorder` (terra/tracing/recorder.py, seeded with the prefix)
continues the iteration in the tracing phase, so the finished trace is identical to one recorded
eagerly.

Most paths need no snapshot: their graph's writes wait for one commit token per iteration
(terra/compiler/commit.py, `commit_writes`), which Python puts when the iteration has ended on
its path, and for every op that can fail; a run abandoned or failed before then wrote nothing.
The snapshot is one graph call that reads every written variable (the reads share buffers with
the variables, so each update then copies its variable): on the worker thread before every run
of a graph that cannot be gated, and on the program's thread when Python reads a value that
depends on a write before its iteration ends (it commits early). One token per iteration, not
one per coarse unit as ARCHITECTURE.md §2 weighed, keeps the graph running ahead into the
optimizer update: in a pipelined loop the token of iteration i is put before run i starts.
"""
from __future__ import annotations

import functools
import weakref

import tensorflow as tf

from terra import _tf_private as tfp
from terra.ir.op_kinds import HOST_OPS
from terra.compiler.interpret import Interpreter, attrs_flat
from terra.ir.records import Feed, FeedRef, TensorSpec, Trace, VariableRef
from terra.runtime.placeholders import Placeholder

# Ops whose first input is a variable they update (anything else taking a variable only reads).
_READ_ONLY = frozenset({"ReadVariableOp", "VariableShape", "VarIsInitializedOp",
                        "ResourceGather", "ResourceGatherNd"})


def written_variables(trace: Trace) -> list:
    """Variables some record of `trace` may write (every variable a function call captures)."""
    keys = []
    seen = set()
    for rec in trace.records:
        if rec.op_type in _READ_ONLY or rec.op_type in HOST_OPS:  # a summary writer: not ours
            continue
        for r in rec.input_refs():
            if isinstance(r, VariableRef) and r.key not in seen:
                if rec.route == "function" or rec.op_type not in _READ_ONLY:
                    seen.add(r.key)
                    keys.append(r.key)
    out = []
    for k in keys:
        v = trace.variables.get(k)
        if isinstance(v, tfp.BaseResourceVariable):
            out.append(v)
        elif v is not None:  # a handle no known variable owns: snapshot it by handle
            out.append(HandleVariable(v, _handle_dtype(trace, k)))
    return out


def unsnapshotable(trace: Trace) -> str | None:
    """Why a fallback could not restore what `trace` writes (None: it can)."""
    try:
        written_variables(trace)
    except ValueError as e:
        return str(e)
    return None


def _handle_dtype(trace: Trace, key) -> str | None:
    """The value dtype of the resource `key`, from a record that reads or writes it."""
    for rec in trace.records:
        if any(isinstance(r, VariableRef) and r.key == key for r in rec.input_refs()):
            for name in ("dtype", "T"):
                if isinstance(rec.attr(name), str):
                    return rec.attr(name)
    return None


class HandleVariable:
    """A resource handle read and written by handle (no variable object is known for it)."""

    def __init__(self, handle, dtype):
        if dtype is None:
            raise ValueError("a written resource handle whose value dtype no record names")
        self.handle, self.dtype = handle, dtype

    def read_value(self):
        return tfp.read_variable_op(self.handle, self.dtype)

    def assign(self, value):
        tfp.assign_variable_op(self.handle, value)


def _read_all(variables):
    return [tf.identity(v.read_value()) for v in variables]


class Snapshot:
    """Reads a fixed list of variables in one graph call; `restore(values)` writes them back.

    `Snapshot.of(variables)` shares one snapshot among the paths that write the same variables
    (the branches of one model): each new one would trace its function again, and TF warns
    about a function traced that often. Variables of the same dtypes and shapes as a snapshot
    already traced (a metric made anew every epoch) are read by that snapshot's function with
    their handles captured in place of its own: no tracing (a trace cost 30 ms per epoch)."""

    _shared: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
    _templates: dict = {}   # dtypes and shapes -> a traced snapshot of such variables

    @classmethod
    def of(cls, variables) -> "Snapshot":
        variables = list(variables)
        key = tuple(id(v) for v in variables)  # live while the snapshot holds the variables
        snap = cls._shared.get(key)
        if snap is None:
            snap = cls._shared[key] = cls(variables)
        return snap

    @classmethod
    def forget_templates(cls) -> None:
        """Drop the traced functions kept for other variables (they keep those alive)."""
        cls._templates.clear()

    def __init__(self, variables):
        self.variables = list(variables)
        self._read = self._rebound = None
        if not self.variables:
            return
        self._kind = tuple((v.dtype, str(v.shape)) for v in self.variables) if all(
            isinstance(v, tfp.BaseResourceVariable) for v in self.variables) else None
        template = self._templates.get(self._kind) if self._kind is not None else None
        if template is not None:
            concrete = template._read.get_concrete_function()
            handles = {id(a.handle): b.handle for a, b in zip(template.variables, self.variables)}
            captured = [handles.get(id(c), c) for c in concrete.captured_inputs]
            if sum(id(c) in handles for c in concrete.captured_inputs) == len(handles):
                self._rebound = tfp.ReboundFunction(concrete, captured)
                return
        # a partial, not a closure: TF counts retracing per code object, and every snapshot's
        # function (traced once) would count as a retrace of one function, which TF warns about
        self._read = tf.function(functools.partial(_read_all, tuple(self.variables)),
                                 autograph=False)

    def take(self):
        if self._rebound is not None:
            return tfp.call_concrete_cancellable(self._rebound, [], tfp.CancellationManager())
        if self._read is None:
            return []
        values = self._read()
        if self._kind is not None:
            self._templates.setdefault(self._kind, self)
        return values

    def restore(self, values) -> None:
        for v, x in zip(self.variables, values):
            v.assign(x)


# ------------------------------------------------------------------------------------ eager replay
class EagerReplay(Interpreter):
    """The eager emitter of the trace interpreter: executes records eagerly (recording gradients
    on active tapes) into `env`."""

    def __init__(self, trace: Trace, feed_values: dict, tape_spans=(), watches=None,
                 pre_watch=None, rewrite=None):
        super().__init__(trace, feed_values)
        # rec, shape_of -> the record as this iteration runs it (None: as recorded): a shape
        # group's member run with another length computes its shape constants anew
        self.rewrite = rewrite
        self.rewritten: dict = {}   # record index -> the record as run
        self.pre_watch = pre_watch or {}  # tape -> tensors to watch once it records
        self.watches = watches or {}   # (record, index) -> tapes that watch that output
        # (tape, first record, end record or None): tapes open over those records in eager;
        # the replay puts exited tapes back on the stack over their span.
        self.tape_spans = tape_spans
        self.converted: dict = {}   # slot -> tensor made from a non-tensor feed value

    def feed(self, slot):
        v = self.feeds[slot]
        if isinstance(v, Placeholder):
            v = v._terra_materialize()
        if isinstance(v, tfp.EagerTensorBase):
            return v
        t = self.converted.get(slot)
        if t is None:
            t = self.converted[slot] = tf.convert_to_tensor(v, self.trace.feeds[slot].spec.dtype)
        return t

    def variable(self, ref, dtype):
        var = self.trace.variables[ref.key]
        if dtype == "resource" or dtype is None:
            return var.handle if isinstance(var, tfp.BaseResourceVariable) else var
        return var.read_value() if isinstance(var, tfp.BaseResourceVariable) else \
            tfp.read_variable_op(var, dtype)

    def run(self, upto: int | None = None) -> dict:
        upto = len(self.trace.records) if upto is None else upto
        spans = [(t, a, b) for t, a, b in self.tape_spans
                 if not tfp.tape_is_recording(t) and tfp.tape_has_state(t) and a < upto]
        for t, values in self.pre_watch.items():
            if tfp.tape_is_recording(t):
                for v in values:
                    tfp.PlainGradientTape.watch(t, v)
        resumed = []
        try:
            with tfp.resume_recording():  # (records say which ops a tape recorded: `emit`)
                self._run(upto, spans, resumed)
        finally:
            for t in resumed:
                tfp.pause_tape(t)
        return self.env

    def _run(self, upto, spans, resumed) -> None:
        for rec in self.trace.records[:upto]:
            for t, a, b in spans:
                if a == rec.index and t not in resumed:
                    tfp.resume_tape(t)
                    resumed.append(t)
                    for v in self.pre_watch.get(t, ()):
                        tfp.PlainGradientTape.watch(t, v)
                if b == rec.index and t in resumed:
                    tfp.pause_tape(t)
                    resumed.remove(t)
            if self.rewrite is not None:
                new = self.rewrite(rec, self._shape_of)
                if new is not rec:
                    rec = self.rewritten[rec.index] = new
            self.step(rec)  # (`at`: the failing record on an error)

    def _shape_of(self, ref):
        v = self.feed(ref.slot) if isinstance(ref, FeedRef) else \
            self.env.get((ref.record, ref.index))
        return None if v is None else tuple(v.shape.as_list())

    def as_run(self) -> Trace:
        """The trace with the records as run and each fed slot's spec of the value fed."""
        t = self.trace
        if self.rewrite is None:
            return t
        feeds = list(t.feeds)
        for slot in self.feeds:
            shape = tuple(self.feed(slot).shape.as_list())
            if feeds[slot].spec.shape != shape:
                feeds[slot] = Feed(slot, TensorSpec(feeds[slot].spec.dtype, shape),
                                   feeds[slot].source)
        if not self.rewritten and feeds == t.feeds:
            return t
        records = [self.rewritten.get(r.index, r) for r in t.records]
        return Trace(t.site, records, feeds, list(t.feed_values), list(t.fetches),
                     dict(t.variables), list(t.unsupported), dict(t.functions),
                     list(t.unseeded_random), list(t.fast_fallbacks))

    def emit(self, rec):
        if rec.op_type in HOST_OPS:  # the program's thread ran it when it got there
            return None
        if not rec.taped and rec.route != "function":
            # eager ran it with every tape stopped (`tape.stop_recording()`, `tf.stop_gradient`):
            # recorded now, gradients would flow through it (twice the gradient of `w * a` with
            # `a = w * 3` made unrecorded), or take another route (an ulp off eager's). (TF runs
            # every taped function call's forward with the tapes stopped and records the call
            # itself, as the replay's TapeRecordedFunction does: a function record's flag says
            # nothing)
            with tfp.stop_recording():
                return self.op(rec)
        return super().emit(rec)

    def function(self, rec):
        return self.trace.functions[rec.function].call_flat(*self.flat_inputs(rec))

    def op(self, rec):
        inputs = self.flat_inputs(rec)
        if rec.op_type == "ReadVariableOp" and isinstance(rec.inputs[0], VariableRef) and \
                isinstance(self.trace.variables.get(rec.inputs[0].key), tfp.BaseResourceVariable):
            # through the variable, so active tapes watch it as eager did
            return [self.trace.variables[rec.inputs[0].key].value()]
        execute = tfp.execute_module
        attrs = attrs_flat(rec)
        outs = execute.execute(rec.op_type, len(rec.outputs), inputs, attrs, tfp.context())
        if outs and execute.must_record_gradient():
            execute.record_gradient(rec.op_type, inputs, attrs, outs)
        return outs

    def write(self, rec, outs) -> None:
        super().write(rec, outs)
        for j, t in enumerate(outs or ()):
            for tape in self.watches.get((rec.index, j), ()):
                if tfp.tape_has_state(tape):  # (none: its gradient, later, is already taken)
                    tfp.PlainGradientTape.watch(tape, t)


def bind_placeholders(placeholders: dict, env: dict) -> None:
    """Make every placeholder of the iteration forward to its replayed value."""
    for key, ph in placeholders.items():
        value = env.get(key)
        if value is not None and not ph.is_bound:
            ph._terra_bind(value)


__all__ = ["written_variables", "Snapshot", "EagerReplay", "bind_placeholders"]
