"""Run a pipeline `Schedule` on TensorFlow devices: `PipelineTrainer`.

One Python thread per rank walks that rank's steps of the schedule. Each action is dispatched
through `HANDLERS` (kind -> handler). F and B call the stage's compiled forward/backward pair on
the stage device; stage outputs and input gradients travel through a `Mailbox`, so a rank waits
exactly for its data dependencies (the grid's time steps only fix each rank's order). EVICT and
LOAD run on a per-rank transfer thread, overlapping the compute of the same step; a rank finishes a
step only when that step's transfers are done (the schedule's semantics: an EVICT frees the pack at
the end of its step, a LOAD makes it available from the next step). SEND/RECV actions, if a
schedule carries them, are no-ops: the mailbox already moves the data when it is consumed.

Gradients are accumulated per stage over micro-batches (the last stage seeds its backward with
``1/m``, so the result is the gradient of the mean loss over the whole batch), replicas of one
model part (Chimera) are summed, and each part is updated by its own optimizer on its device.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional, Sequence

import tensorflow as tf

from terra.pipeline import memory as memory_lib
from terra.pipeline import transport
from terra.pipeline.actions import B, EVICT, F, LOAD, RECV, SEND
from terra.pipeline.stage import StageProgram, lm_loss, sequential, trainable_variables


# ---------------------------------------------------------------------------------- schedules
def _schedules():
    from terra.pipeline import schedules as s
    table = {"gpipe": lambda p, m, o: s.gpipe(p, m),
             "1f1b": lambda p, m, o: s.one_f_one_b(p, m)}
    if hasattr(s, "interleaved_1f1b"):
        table["interleaved"] = lambda p, m, o: s.interleaved_1f1b(p, m, o.get("v", 2))
    if hasattr(s, "kfkb"):
        table["kfkb"] = lambda p, m, o: s.kfkb(p, m, o.get("k", 2))
    if hasattr(s, "chimera"):
        table["chimera"] = lambda p, m, o: s.chimera(p, m)
    return table


def make_schedule(name: str, p: int, m: int, balance: Optional[str] = None, **options):
    """Schedule ``name`` for ``p`` ranks and ``m`` micro-batches, with BPipe transfers when
    ``balance == "bpipe"``. ``options``: ``v`` (interleaved chunks), ``k`` (kFkB group)."""
    table = _schedules()
    if name not in table:
        raise ValueError(f"unknown schedule {name!r}; expected one of {sorted(table)}")
    schedule = table[name](p, m, options)
    if balance is None:
        return schedule
    if balance != "bpipe":
        raise ValueError(f"balance must be None or 'bpipe', got {balance!r}")
    from terra import pipeline
    add_evict_load = getattr(pipeline, "add_evict_load", None)
    if add_evict_load is None:
        from terra.pipeline.passes import add_evict_load
    return add_evict_load(schedule)


# ----------------------------------------------------------------------------------- trainer
class _Part:
    """One model part on one device: its stage programs are built lazily per micro-batch shape."""

    def __init__(self, callables, device, is_last, loss_fn):
        self.callables = list(callables) if isinstance(callables, (list, tuple)) else [callables]
        self.device = device
        self.is_last = is_last
        self.variables = trainable_variables(self.callables)
        fn = sequential(self.callables)
        self.fn = (lambda x, labels: loss_fn(labels, fn(x))) if is_last else fn
        self.program: Optional[StageProgram] = None
        self.optimizer = None
        self.apply = None


def _compiled_apply(optimizer, variables):
    def apply(grads):
        optimizer.apply_gradients(zip(grads, variables))
    return tf.function(apply, autograph=False)


class PipelineTrainer:
    """Train a model cut into stages with a pipeline schedule on TF devices.

    ``stages``: one entry per model part (a callable, or a list of callables applied in order,
    each exposing ``trainable_variables``), their variables already on the part's device; the
    last part returns logits and ``loss_fn(labels, logits)`` turns them into a scalar mean loss.
    ``devices[r]`` is rank r's device; plain schedules run part r on rank r, ``interleaved`` with
    ``v`` chunks needs ``len(stages) == v * len(devices)``. Chimera needs ``replica_stages``: a
    second copy of the parts (same initial values) for the upward pipeline; part ``i``'s replica
    runs on rank ``p - 1 - i``.
    """

    def __init__(self, stages: Sequence, optimizer_factory: Callable, *, devices: Sequence[str],
                 schedule="1f1b", balance: Optional[str] = None, microbatches: int = 4,
                 loss_fn: Callable = lm_loss, replica_stages: Optional[Sequence] = None,
                 timeout: float = 120.0, overlap: bool = True, **schedule_options):
        if not callable(optimizer_factory):
            raise TypeError(f"optimizer_factory must be callable, got {optimizer_factory!r}")
        self.devices = list(devices)
        p = len(self.devices)
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
        self.m = microbatches
        if isinstance(schedule, str):
            self.schedule = make_schedule(schedule, p, microbatches, balance, **schedule_options)
        else:
            self.schedule = schedule
            if balance is not None:
                raise ValueError("pass balance only with a schedule name (the given schedule is used as is)")
        sch = self.schedule
        if sch.p != p or sch.m != microbatches:
            raise ValueError(f"schedule is for p={sch.p}, m={sch.m}; trainer has {p} devices and "
                             f"{microbatches} micro-batches")
        if len(stages) != sch.pipe_depth:
            raise ValueError(f"schedule {sch.name!r} needs {sch.pipe_depth} model parts, got {len(stages)}")
        replicas = sch.num_stages // sch.pipe_depth
        copies = [list(stages)]
        if replicas == 2:
            if replica_stages is None or len(replica_stages) != len(stages):
                raise ValueError(f"schedule {sch.name!r} runs two pipelines: pass replica_stages "
                                 f"with {len(stages)} parts")
            copies.append(list(replica_stages))
        self.loss_fn = loss_fn
        self.timeout = timeout
        self.overlap = overlap
        d = sch.pipe_depth
        # Global stage g runs part g % d of replica g // d on rank stage_ranks[g].
        self.parts = [_Part(copies[g // d][g % d], self.devices[sch.stage_ranks[g]],
                            g % d == d - 1, loss_fn) for g in range(sch.num_stages)]
        for g in range(sch.num_stages):
            if g >= d:  # replicas start from the primary's values
                for a, b in zip(self.parts[g].variables, self.parts[g % d].variables):
                    a.assign(b)
        self.optimizer_factory = optimizer_factory
        self.ledger = memory_lib.Ledger(p)
        self._transfer_pools = [ThreadPoolExecutor(1, thread_name_prefix=f"pipe-xfer{r}") for r in range(p)]
        self._built_for = None
        self.last_step_seconds = None
        self.transfer_seconds = [0.0] * p

    # ------------------------------------------------------------------------------- build
    def _build(self, x_spec, y_spec):
        sch = self.schedule
        spec = x_spec
        for g, part in enumerate(self.parts):
            if g % sch.pipe_depth == 0:
                spec = x_spec
            part.program = StageProgram(part.fn, part.variables, spec,
                                        y_spec if part.is_last else None, part.device)
            spec = part.program.output_spec
            if part.optimizer is None:
                with tf.device(part.device):
                    part.optimizer = self.optimizer_factory()
                    part.optimizer.build(part.variables)
                part.apply = _compiled_apply(part.optimizer, part.variables)
        self._accumulate = tf.function(lambda acc, g: [a + b for a, b in zip(acc, g)], autograph=False)
        for r in range(sch.p):
            stages = [self.parts[g] for g in sch.stages_of(r)]
            vs = [v for part in stages for v in part.variables]
            opt_vars = [v for part in stages for v in part.optimizer.variables]
            self.ledger.set_static(r, weights=memory_lib.variable_bytes(vs),
                                   optimizer=memory_lib.variable_bytes(opt_vars),
                                   grads=memory_lib.variable_bytes(vs))
        self._built_for = (x_spec, y_spec)

    @property
    def pack_bytes(self) -> list[int]:
        """Bytes one micro-batch's pack occupies (moved bases), per global stage."""
        if self._built_for is None:
            raise RuntimeError("pack sizes are known after the first step")
        return [part.program.plan.moved_bytes for part in self.parts]

    # -------------------------------------------------------------------------------- step
    def step(self, x, y, apply: bool = True) -> float:
        """One training step on batch (x, y): returns the mean loss over the batch. The summed
        per-part gradients stay in ``last_gradients``; ``apply=False`` skips the update."""
        x, y = tf.convert_to_tensor(x), tf.convert_to_tensor(y)
        if x.shape[0] is None or x.shape[0] % self.m:
            raise ValueError(f"batch size {x.shape[0]} must be a multiple of microbatches={self.m}")
        xs, ys = tf.split(x, self.m), tf.split(y, self.m)
        specs = (tf.TensorSpec(xs[0].shape, xs[0].dtype), tf.TensorSpec(ys[0].shape, ys[0].dtype))
        if self._built_for != specs:
            self._build(*specs)
        sch = self.schedule
        state = _StepState(self, transport.Mailbox(self.timeout))
        first = {a.microbatch: a.stage for r in range(sch.p) for a in sch.compute_order(r)
                 if a.kind is F and sch.prev_stage(a.stage) is None}
        for i in range(self.m):
            state.mailbox.put(("x", first[i], i), xs[i])
            state.labels[i] = ys[i]
        start = time.perf_counter()
        threads = [threading.Thread(target=state.run_rank, args=(r,), name=f"pipe-rank{r}", daemon=True)
                   for r in range(sch.p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if state.errors:
            raise state.errors[0]
        self.last_gradients = self._reduce(state)
        if apply:
            for g, part in enumerate(self.parts):
                with tf.device(part.device):
                    part.apply(self.last_gradients[g % sch.pipe_depth])
        self.last_step_seconds = time.perf_counter() - start
        self.transfer_seconds = state.transfer_seconds
        leftovers = state.mailbox.pending()
        if leftovers or state.packs or state.evicted:
            raise RuntimeError(f"schedule left work undone: mail {leftovers}, packs "
                               f"{sorted(state.packs)}, evicted {sorted(state.evicted)}")
        return float(tf.add_n([tf.identity(l) for l in state.losses.values()]) / self.m)

    def _reduce(self, state) -> list:
        """Per model part: the gradient summed over micro-batches and replicas (Chimera)."""
        d = self.schedule.pipe_depth
        grads = {}
        for g in sorted(state.grads):
            part, acc = g % d, state.grads[g]
            if part in grads:
                with tf.device(self.parts[part].device):
                    acc = [a + b for a, b in zip(grads[part], acc)]
            grads[part] = acc
        return [grads[k] for k in range(d)]

    # ----------------------------------------------------------------------------- reports
    def memory_report(self, allocator: Optional[Callable] = None) -> list[dict]:
        """Per rank: the live ledger (bytes and peaks) and, where readable, the allocator's
        ``{'current', 'peak'}`` for the rank's device (``allocator(rank)`` overrides the reader,
        e.g. a cluster's per-worker reader)."""
        out = []
        for r, entry in enumerate(self.ledger.report()):
            entry = dict(entry, rank=r, device=self.devices[r],
                         allocator=(allocator(r) if allocator else memory_lib.allocator_info(self.devices[r])))
            out.append(entry)
        return out

    def close(self):
        for pool in self._transfer_pools:
            pool.shutdown(wait=True)


class _StepState:
    """Everything one step's ranks share: mailbox, packs, evicted bases, accumulators, losses."""

    def __init__(self, trainer: PipelineTrainer, mailbox):
        self.t = trainer
        self.mailbox = mailbox
        self.packs = {}
        self.evicted = {}
        self.grads = {}
        self.losses = {}
        self.labels = {}
        self.errors = []
        self.lock = threading.Lock()
        self.transfer_seconds = [0.0] * trainer.schedule.p

    def run_rank(self, rank: int):
        sch = self.t.schedule
        pack_bytes = [p.program.plan.moved_bytes for p in self.t.parts]
        try:
            for step in range(sch.steps):
                action = sch.compute[rank][step]
                transfers = sch.transfers[rank][step]
                start, end = memory_lib.step_deltas(rank, action, transfers, sch.stage_ranks, pack_bytes)
                self.t.ledger.apply(start)
                before = [a for a in transfers if a.kind is not EVICT or (a.stage, a.microbatch) in self.packs]
                after = [a for a in transfers if a not in before]
                futures = [self._submit(rank, a) for a in before]
                if not self.t.overlap:
                    for fut in futures:
                        fut.result()
                if action is not None:
                    HANDLERS[action.kind](self, rank, action)
                futures += [self._submit(rank, a) for a in after]
                for fut in futures:
                    fut.result()
                self.t.ledger.apply(end)
        except BaseException as e:  # noqa: BLE001 - re-raised by step()
            with self.lock:
                self.errors.append(e if not isinstance(e, transport.PipelineAborted) or not self.errors
                                   else self.errors[0])
            self.mailbox.abort(f"rank {rank} failed: {e!r}")

    def _submit(self, rank, action):
        def timed():
            start = time.perf_counter()
            HANDLERS[action.kind](self, rank, action)
            self.transfer_seconds[rank] += time.perf_counter() - start
        return self.t._transfer_pools[rank].submit(timed)

    # ------------------------------------------------------------------------------ handlers
    def forward(self, rank, a):
        part = self.t.parts[a.stage]
        x = self.mailbox.get(("x", a.stage, a.microbatch))
        if part.is_last:
            out, pack = part.program.forward(x, self.labels[a.microbatch])
            self.losses[a.microbatch] = out
        else:
            out, pack = part.program.forward(x)
            self.mailbox.put(("x", a.stage + 1, a.microbatch), out)
        with self.lock:
            self.packs[(a.stage, a.microbatch)] = pack

    def backward(self, rank, a):
        sch, part = self.t.schedule, self.t.parts[a.stage]
        if part.is_last:
            with tf.device(part.device):
                grad = tf.constant(1.0 / self.t.m, part.program.output_spec.dtype)
        else:
            grad = self.mailbox.get(("g", a.stage, a.microbatch))
        with self.lock:
            pack = self.packs.pop((a.stage, a.microbatch), None)
        if pack is None:
            raise RuntimeError(f"{a}: no saved activations for stage {a.stage} micro-batch {a.microbatch}")
        if not pack.resident:
            raise RuntimeError(f"{a}: activations were evicted and not loaded before the backward")
        gx, gvars = part.program.backward(pack, grad)
        if sch.prev_stage(a.stage) is not None:
            self.mailbox.put(("g", a.stage - 1, a.microbatch), gx)
        acc = self.grads.get(a.stage)
        with tf.device(part.device):
            self.grads[a.stage] = gvars if acc is None else self.t._accumulate(acc, gvars)

    def evict(self, rank, a):
        plan = self.t.parts[a.stage].program.plan
        with self.lock:
            pack = self.packs[(a.stage, a.microbatch)]
        bases = pack.split(plan)
        self.evicted[(a.stage, a.microbatch)] = transport.move(bases, self.t.devices[a.peer])

    def load(self, rank, a):
        plan = self.t.parts[a.stage].program.plan
        bases = self.evicted.pop((a.stage, a.microbatch))
        with self.lock:
            pack = self.packs[(a.stage, a.microbatch)]
        pack.restore(plan, transport.move(bases, self.t.parts[a.stage].device))

    def noop(self, rank, a):
        """SEND/RECV: the mailbox moves stage outputs and gradients when they are consumed."""


#: Action kind -> handler(state, rank, action).
HANDLERS = {F: _StepState.forward, B: _StepState.backward, EVICT: _StepState.evict,
            LOAD: _StepState.load, SEND: _StepState.noop, RECV: _StepState.noop}
