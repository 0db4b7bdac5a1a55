"""Run a pipeline `Schedule` on TensorFlow devices: `PipelineTrainer`.

One Python thread per rank walks that rank's steps of the schedule. Each action is dispatched
through `HANDLERS` (kind -> handler). F and B call the stage's compiled forward/backward pair on
the stage device; where the schedule splits a backward (it has the W), B runs the input half
only, sends the input gradient upstream and keeps the pack plus what the weight half needs, and
W computes the weight gradients from those (`StageProgram.backward_input` / `backward_weight`).
Stage outputs and input gradients travel through a `Mailbox`, so a rank waits
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

import keras
import tensorflow as tf

from terra import _tf_private

from terra.pipeline import memory as memory_lib
from terra.pipeline import transport
from terra.pipeline.actions import B, EVICT, F, LOAD, RECV, SEND, W
from terra.pipeline.stage import StageProgram, lm_loss, sequential, trainable_variables
from terra.pipeline.validate import ScheduleError, validate  # noqa: F401 - ScheduleError re-exported


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
    if hasattr(s, "zb_h1"):
        table["zb-h1"] = lambda p, m, o: s.zb_h1(p, m)
        table["zb-v"] = lambda p, m, o: s.zb_v(p, m)
    if hasattr(s, "dualpipe_v"):
        table["dualpipe-v"] = lambda p, m, o: s.dualpipe_v(p, m)
    return table


#: Options each schedule name takes (anything else is a typo that would be silently ignored).
SCHEDULE_OPTIONS = {"interleaved": ("v",), "kfkb": ("k",)}


def make_schedule(name: str, p: int, m: int, balance: Optional[str] = None, **options):
    """Schedule ``name`` for ``p`` ranks and ``m`` micro-batches, with BPipe transfers when
    ``balance == "bpipe"``. ``options``: ``v`` (interleaved chunks), ``k`` (kFkB group)."""
    table = _schedules()
    if name not in table:
        raise ValueError(f"unknown schedule {name!r}; expected one of {sorted(table)}")
    takes = SCHEDULE_OPTIONS.get(name, ())
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for schedule {name!r}; it takes "
                         f"{list(takes) if takes else 'none'}")
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
    """One model part on one device: its stage programs are built lazily per micro-batch shape.
    ``fn`` runs its layers with ``training=True`` (training steps), ``eval_fn`` with
    ``training=False`` (forward-only steps). ``owned`` indexes the variables this part updates:
    a variable shared with another part (tied weights) is updated by one of them only."""

    def __init__(self, callables, device, is_last, loss_fn):
        self.callables = list(callables) if isinstance(callables, (list, tuple)) else [callables]
        self.device = device
        self.is_last = is_last
        self.variables = trainable_variables(self.callables)
        self.owned = list(range(len(self.variables)))
        trainable = {id(v) for v in self.variables}
        self.state = list({id(v): v for c in self.callables for v in getattr(c, "non_trainable_variables", [])
                           if id(v) not in trainable}.values())   # statistics, seed states
        self.fn, self.eval_fn = (self._loss(sequential(self.callables, training), loss_fn)
                                 for training in (True, False))
        self.program: Optional[StageProgram] = None
        self.programs = {}          # per micro-batch shape (a schedule change may change it)
        self.evaluator = None
        self.optimizer = None
        self.apply = None

    def _loss(self, fn, loss_fn):
        return (lambda x, labels: loss_fn(labels, fn(x))) if self.is_last else fn


def full_device_name(name: str) -> str:
    """``name`` with the local job, replica and task where it names none (TF's reading)."""
    local = tf.DeviceSpec(job="localhost", replica=0, task=0)
    return local.make_merged_spec(tf.DeviceSpec.from_string(name or "")).to_string()


def same_device(a: str, b: str) -> bool:
    """Whether device names ``a`` and ``b`` agree on every field both of them name."""
    a, b = tf.DeviceSpec.from_string(a or ""), tf.DeviceSpec.from_string(b or "")
    return all(getattr(a, f) is None or getattr(b, f) is None or getattr(a, f) == getattr(b, f)
               for f in ("job", "replica", "task", "device_type", "device_index"))


def check_devices(rank_devices) -> None:
    """Every device must exist (locally or on a connected cluster): TF would otherwise place the
    stage silently elsewhere (soft placement) and the plan would not be what runs."""
    known = [d.name for d in tf.config.list_logical_devices()]
    full = [full_device_name(k) for k in known]
    for devices in rank_devices:
        for d in devices:
            try:
                spec = tf.DeviceSpec.from_string(d)
            except (ValueError, TypeError) as e:
                raise ValueError(f"device {d!r} is not a device name: {e}") from None
            if spec.device_type is None or not any(same_device(d, k) for k in full):
                raise ValueError(f"device {d!r} does not exist; devices here: {known}")


def _check_pairs(devices, schedule) -> None:
    """BPipe moves packs between each evictor and its acceptor, so a pair belongs on one host
    (pair-adjacent placement); refuse devices ordered so that more pairs cross hosts than the
    pair-adjacent order of the same devices would leave crossing."""
    from terra.pipeline import placement
    pairs = sorted({(r, a.peer) for r in range(schedule.p) for row in schedule.transfers[r]
                    for a in row if a.kind is EVICT})
    split = placement.split_pairs(devices, pairs)
    best = placement.split_pairs(placement.rank_devices(sorted(devices, key=placement.host), "bpipe"), pairs)
    if len(split) > len(best):
        raise ValueError(
            f"BPipe pairs (evictor, acceptor) {split} run on different hosts, so every pack move "
            f"crosses the network; the pair-adjacent order leaves {len(best)} of {len(pairs)} "
            f"pairs split: pass devices=terra.pipeline.placement.rank_devices(devices listed host "
            f"by host, 'bpipe') and build part r on devices[r]")


def _variable_device(v) -> str:
    return v.handle.device


def _tie(parts) -> list:
    """Variables used by several parts of one model copy (tied weights): one group per variable,
    ``[(part, index), ...]`` with the owner (the user on whose device it lives) first. Sets each
    part's ``owned``; raises where a variable lives on no device of a part that uses it."""
    users = {}
    for k, part in enumerate(parts):
        for i, v in enumerate(part.variables):
            users.setdefault(id(v), []).append((k, i))
    groups = []
    for uses in users.values():
        v = parts[uses[0][0]].variables[uses[0][1]]
        where = _variable_device(v)
        homes = [(k, i) for k, i in uses if same_device(full_device_name(where), full_device_name(parts[k].device))]
        if not homes:
            names = sorted({parts[k].device for k, _ in uses})
            raise ValueError(f"variable {v.name!r} is on {where!r}, but the part(s) using it run on "
                             f"{names}: create each part's variables under its device")
        if len(uses) > 1:
            owner = homes[0]
            groups.append([owner] + [u for u in uses if u != owner])
            for k, i in uses:
                if (k, i) != owner:
                    parts[k].owned.remove(i)
    return groups


def _compiled_apply(optimizer, variables):
    """The optimizer update, eager on the first call and compiled from the second on: tracing
    Keras Adam costs about half a second per part, which a one-step run should not pay."""
    def apply(grads):
        optimizer.apply_gradients(zip(grads, variables))
    compiled = tf.function(apply, autograph=False)
    calls = [0]

    def call(grads):
        calls[0] += 1
        return (apply if calls[0] == 1 else compiled)(grads)
    return call


class PipelineTrainer:
    """Train a model cut into stages with a pipeline schedule on TF devices.

    ``stages``: one entry per model part (a callable, or a list of callables applied in order,
    each exposing ``trainable_variables``), their variables already on the part's device; the
    last part returns logits and ``loss_fn(labels, logits)`` turns them into a scalar mean loss.
    ``devices[r]`` is rank r's device; plain schedules run part r on rank r, ``interleaved`` with
    ``v`` chunks needs ``len(stages) == v * len(devices)``. Chimera needs ``replica_stages``: a
    second copy of the parts (same initial values) for the upward pipeline; part ``i``'s replica
    runs on rank ``p - 1 - i``.

    Data parallel x pipeline: ``devices[r]`` may be a list of ``R`` devices (the same ``R`` for
    every rank) and ``data_parallel_stages`` ``R - 1`` further copies of the parts (copy ``j``'s
    part on ``devices[rank][j + 1]``). Each micro-batch is split into ``R`` shards, one per copy;
    per rank a ``tf.distribute.MirroredStrategy`` over its ``R`` devices with
    ``ReductionToOneDevice`` sums the copies' gradients, and every copy applies the same update.

    Layers run with ``training=True`` in `step` and ``training=False`` in `evaluate` (every part
    taking a ``training`` keyword: Keras layers and models, callables that declare it). A variable
    used by several parts (tied weights) lives on the device of one of them, which owns its
    update: its gradient is summed over the parts using it and applied once.
    ``one_optimizer=True`` builds one optimizer over all variables (applied after the flush, so
    ``global_clipnorm`` sees the whole model's gradient) instead of one per part; the last stage
    seeds its backward with the optimizer's ``scale_loss``, so a ``LossScaleOptimizer`` works
    there (one dynamic scale for every stage).

    Rejected before anything runs, with the problem named: devices that do not exist, variables
    not on the device of a part that uses them, options the schedule does not take, a schedule
    that fails `terra.pipeline.validate`, and with BPipe devices on which more evictor/acceptor
    pairs cross hosts than in the pair-adjacent order (`placement.rank_devices`).
    """

    def __init__(self, stages: Sequence, optimizer_factory: Callable, *, devices: Sequence[str],
                 schedule="1f1b", balance: Optional[str] = None, microbatches: int = 4,
                 loss_fn: Callable = lm_loss, replica_stages: Optional[Sequence] = None,
                 data_parallel_stages: Sequence = (), timeout: float = 120.0, overlap: bool = True,
                 one_optimizer: bool = False, link_delay: Optional[Callable[[int], float]] = None,
                 **schedule_options):
        if not callable(optimizer_factory):
            raise TypeError(f"optimizer_factory must be callable, got {optimizer_factory!r}")
        self.rank_devices = [list(d) if isinstance(d, (list, tuple)) else [d] for d in devices]
        self.dp = len(self.rank_devices[0]) if self.rank_devices else 1
        if any(len(d) != self.dp for d in self.rank_devices):
            raise ValueError(f"every rank needs the same number of data-parallel devices, got {devices!r}")
        if len(data_parallel_stages) != self.dp - 1:
            raise ValueError(f"{self.dp} data-parallel devices per rank need {self.dp - 1} more copies "
                             f"of the parts in data_parallel_stages, got {len(data_parallel_stages)}")
        check_devices(self.rank_devices)
        self.devices = [d[0] for d in self.rank_devices]
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
            if schedule_options:
                raise ValueError(f"unknown option(s) {sorted(schedule_options)}: options apply to a "
                                 f"schedule name, the given schedule is used as is")
        validate(self.schedule)  # a schedule that would deadlock or miss work never starts
        _check_pairs(self.devices, self.schedule)
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
        self.link_delay = link_delay
        self.overlap = overlap
        d = sch.pipe_depth
        # Global stage g runs part g % d of pipeline replica g // d on rank stage_ranks[g];
        # replicas[g][j] is its data-parallel copy j.
        dp_copies = [None] + [list(c) for c in data_parallel_stages]
        for j, c in enumerate(dp_copies[1:], 1):
            if len(c) != len(stages):
                raise ValueError(f"data_parallel_stages[{j - 1}] has {len(c)} parts, expected {len(stages)}")
        self.replicas = []
        for g in range(sch.num_stages):
            row = []
            for j in range(self.dp):
                src = copies[g // d] if j == 0 else dp_copies[j]
                if j > 0 and g >= d:
                    raise ValueError("data parallel x Chimera is not supported")
                row.append(_Part(src[g % d], self.rank_devices[sch.stage_ranks[g]][j], g % d == d - 1, loss_fn))
            self.replicas.append(row)
        self.parts = [row[0] for row in self.replicas]
        copies_of = {}
        for g, row in enumerate(self.replicas):
            for j, part in enumerate(row):
                copies_of.setdefault((g // d, j), []).append(part)
        self._ties = {key: _tie(parts) for key, parts in copies_of.items()}[0, 0]
        self.one_optimizer = bool(one_optimizer)
        self.optimizer = None
        for g, row in enumerate(self.replicas):  # every copy starts from the primary's values
            for j, part in enumerate(row):
                if g >= d or j > 0:
                    for a, b in zip(part.variables, self.parts[g % d].variables):
                        a.assign(b)
        self.strategies = None
        if self.dp > 1:
            self.strategies = [tf.distribute.MirroredStrategy(
                devs, cross_device_ops=tf.distribute.ReductionToOneDevice(reduce_to_device=devs[0]))
                for devs in self.rank_devices]
        self.optimizer_factory = optimizer_factory
        self.ledger = memory_lib.Ledger(p)
        self._transfer_pools = [ThreadPoolExecutor(1, thread_name_prefix=f"pipe-xfer{r}") for r in range(p)]
        self._built_for = None
        self._eval_built_for = None
        self.last_step_seconds = None
        self.last_gradients = None
        self.transfer_seconds = [0.0] * p
        self.link_per_byte = None    # seconds per byte the timed links took in the last step

    def _delay(self, src: int, dst: int, value) -> float:
        """Injected time on the wire for ``value`` going from stage ``src`` to ``dst`` (0 where
        no ``link_delay`` was given or both stages share a rank)."""
        if self.link_delay is None or self.schedule.stage_ranks[src] == self.schedule.stage_ranks[dst]:
            return 0.0
        nbytes = sum(int(t.shape.num_elements()) * t.dtype.size for t in tf.nest.flatten(value) if t is not None)
        return float(self.link_delay(nbytes))

    def set_schedule(self, schedule) -> None:
        """Run ``schedule`` from the next step on (Ada-Grouper switching k of kFkB): the same ranks
        and model parts, possibly another number of micro-batches. Parts keep their variables and
        the optimizer its state; stage programs are built once per micro-batch shape."""
        validate(schedule)
        old = self.schedule
        if (schedule.p, schedule.pipe_depth, schedule.stage_ranks) != (old.p, old.pipe_depth, old.stage_ranks):
            raise ValueError(f"schedule {schedule.name!r} places parts differently (p={schedule.p}, "
                             f"stage_ranks={schedule.stage_ranks}) than {old.name!r} "
                             f"(p={old.p}, stage_ranks={old.stage_ranks})")
        if self.dp > 1 and schedule.m != self.m:
            raise ValueError("changing the number of micro-batches with data-parallel copies is not supported")
        _check_pairs(self.devices, schedule)
        self.schedule = schedule
        self.m = schedule.m

    # ------------------------------------------------------------------------------- build
    def _build(self, x_spec, y_spec):
        sch = self.schedule
        spec = x_spec
        for g, row in enumerate(self.replicas):
            if g % sch.pipe_depth == 0:
                spec = x_spec
            for part in row:
                key = (repr(spec), repr(y_spec) if part.is_last else None)
                if key not in part.programs:
                    part.programs[key] = StageProgram(part.fn, part.variables, spec,
                                                      y_spec if part.is_last else None, part.device)
                part.program = part.programs[key]
                if part.optimizer is None and not self.one_optimizer:
                    owned = [part.variables[i] for i in part.owned]
                    with tf.device(part.device):
                        part.optimizer = self.optimizer_factory()
                        part.optimizer.build(owned)
                    part.apply = _compiled_apply(part.optimizer, owned) if owned else (lambda grads: None)
            spec = row[0].program.output_spec
        if self.one_optimizer and self.optimizer is None:
            owned = [part.variables[i] for part in self.parts[:sch.pipe_depth] for i in part.owned]
            with tf.device(self.devices[0]):  # Keras colocates each slot with its variable
                self.optimizer = self.optimizer_factory()
                self.optimizer.build(owned)
            # Each update runs where its variable lives: no gradient travels to devices[0].
            _tf_private.place_updates_with_variables(self.optimizer)
            self._apply_all = _compiled_apply(self.optimizer, owned)
        # One loss scale seeds every stage's backward, so it must belong to one optimizer.
        self._loss_scaler = self.optimizer if self.one_optimizer else self.parts[-1].optimizer
        if not self.one_optimizer and any(isinstance(part.optimizer, keras.optimizers.LossScaleOptimizer)
                                          for row in self.replicas for part in row):
            raise ValueError("a LossScaleOptimizer needs one_optimizer=True: one dynamic scale "
                             "seeds the backward of every stage")
        self._accumulate = tf.function(lambda acc, g: [a + b for a, b in zip(acc, g)], autograph=False)
        for r in range(sch.p):
            stages = [part for g in sch.stages_of(r) for part in self.replicas[g]]
            vs = [part.variables[i] for part in stages for i in part.owned]
            if self.one_optimizer:
                opt_vars = [v for v in self.optimizer.variables
                            if any(same_device(_variable_device(v), dev) for dev in self.rank_devices[r])]
            else:
                opt_vars = [v for part in stages for v in part.optimizer.variables]
            state = list({id(v): v for part in stages for v in part.state}.values())
            self.ledger.set_static(r, weights=memory_lib.variable_bytes(vs) + memory_lib.variable_bytes(state),
                                   optimizer=memory_lib.variable_bytes(opt_vars),
                                   grads=memory_lib.variable_bytes(vs))
        self._built_for = (x_spec, y_spec)

    @property
    def residual_bytes(self) -> list[int]:
        """Bytes a split B leaves for its W per micro-batch, per global stage (0 for a schedule
        that does not split backwards)."""
        if self._built_for is None:
            raise RuntimeError("residual sizes are known after the first step")
        if not self.schedule.split:
            return [0] * len(self.replicas)
        return [sum(part.program.residual_bytes for part in row) for row in self.replicas]

    @property
    def pack_bytes(self) -> list[int]:
        """Bytes one micro-batch's pack occupies (moved bases), per global stage."""
        if self._built_for is None:
            raise RuntimeError("pack sizes are known after the first step")
        return [sum(part.program.plan.moved_bytes for part in row) for row in self.replicas]

    # -------------------------------------------------------------------------------- step
    def _start(self, x, y):
        """Split the batch into micro-batches (and data-parallel shards), post them to the first
        stages; returns the step's state and the micro-batch specs."""
        x, y = tf.nest.map_structure(tf.convert_to_tensor, x), tf.convert_to_tensor(y)
        n = self.m * self.dp
        sizes = {t.shape[0] for t in tf.nest.flatten(x)} | {y.shape[0]}
        if len(sizes) != 1:
            raise ValueError(f"every input and the labels need the same batch size, got {sorted(sizes, key=str)}")
        size = sizes.pop()
        if size is None or size % n:
            raise ValueError(f"batch size {size} must be a multiple of microbatches={self.m}"
                             + (f" x data-parallel copies={self.dp}" if self.dp > 1 else ""))
        # x may be a nested structure (token ids and a mask): every leaf is split the same way.
        leaves = [tf.split(t, n) for t in tf.nest.flatten(x)]
        xs = [tf.nest.pack_sequence_as(x, [leaf[i] for leaf in leaves]) for i in range(n)]
        ys = tf.split(y, n)
        specs = (tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), xs[0]),
                 tf.TensorSpec(ys[0].shape, ys[0].dtype))
        sch = self.schedule
        state = _StepState(self, transport.Mailbox(self.timeout))
        first = {a.microbatch: a.stage for r in range(sch.p) for a in sch.compute_order(r)
                 if a.kind is F and sch.prev_stage(a.stage) is None}
        for i in range(self.m):
            for j in range(self.dp):
                state.mailbox.put(("x", first[i], i, j), xs[i * self.dp + j])
                state.labels[i, j] = ys[i * self.dp + j]
        return state, specs

    def _run_ranks(self, state, target) -> None:
        threads = [threading.Thread(target=state.guard, args=(r, target), name=f"pipe-rank{r}", daemon=True)
                   for r in range(self.schedule.p)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if state.errors:
            raise state.errors[0]

    def _mean_loss(self, state) -> float:
        # Fetching the loss waits for (possibly asynchronous, remote) execution to finish.
        return float(tf.add_n([tf.identity(l) for l in state.losses.values()]) / (self.m * self.dp))

    def evaluate(self, x, y) -> float:
        """Forward-only step with ``training=False``: the mean loss over the batch. Each rank runs
        the schedule's forwards in its order; no backward, no pack kept, nothing updated (BatchNorm
        statistics, Dropout's seed state and the weights stay as they are)."""
        state, specs = self._start(x, y)
        if self._eval_built_for != specs:
            self._build_eval(*specs)
        self._run_ranks(state, _StepState.run_forwards)
        return self._mean_loss(state)

    def _build_eval(self, x_spec, y_spec):
        spec = x_spec
        for g, row in enumerate(self.replicas):
            if g % self.schedule.pipe_depth == 0:
                spec = x_spec
            for part in row:
                args = [spec] + ([y_spec] if part.is_last else [])
                with tf.device(part.device):
                    part.evaluator = tf.function(part.eval_fn, autograph=False).get_concrete_function(*args)
            spec = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype),
                                         row[0].evaluator.structured_outputs)
        self._eval_built_for = (x_spec, y_spec)

    def step(self, x, y, apply: bool = True) -> float:
        """One training step on batch (x, y): returns the mean loss over the batch. The summed
        per-part gradients stay in ``last_gradients`` (multiplied by the loss scale when the
        optimizer scales the loss: what its ``apply_gradients`` takes); ``apply=False`` skips
        the update."""
        state, specs = self._start(x, y)
        if self.last_gradients is not None:
            # The last step's sums would sit beside this step's accumulators (one more copy of the
            # weights per rank). Dropped only once the update that reads them has run: a remote
            # worker may not have started it, and a freed handle fails it.
            _tf_private.wait_for_devices()
            self.last_gradients = None
        if self._built_for != specs:
            self._build(*specs)
        state.seed = float(self._loss_scaler.scale_loss(state.seed))
        state.residual_bytes = self.residual_bytes   # builds split backwards here, not in rank threads
        start = time.perf_counter()
        self._run_ranks(state, _StepState.run_rank)
        leftovers = state.mailbox.pending()
        if leftovers or state.packs or state.evicted or state.residuals:
            raise RuntimeError(f"schedule left work undone: mail {leftovers}, packs "
                               f"{sorted(state.packs)}, evicted {sorted(state.evicted)}, "
                               f"weight gradients pending {sorted(state.residuals)}")
        self.last_gradients = self._sum_tied(self._reduce(state))
        if apply:
            self._apply(self.last_gradients)
        loss = self._mean_loss(state)
        self.last_step_seconds = time.perf_counter() - start
        self.transfer_seconds = state.transfer_seconds
        nbytes, seconds = state.link
        self.link_per_byte = seconds / nbytes if nbytes else None
        return loss

    def _sum_tied(self, grads) -> list:
        """A tied variable's gradient is the sum over the parts using it (every occurrence in
        ``grads`` gets the sum; only its owner applies it)."""
        for group in self._ties:
            k0, _ = group[0]
            with tf.device(self.parts[k0].device):
                total = tf.add_n([grads[k][i] for k, i in group])
            for k, i in group:
                grads[k][i] = total
        return grads

    def _apply(self, grads) -> None:
        d = self.schedule.pipe_depth
        if not self.one_optimizer:
            for g, row in enumerate(self.replicas):
                for part in row:
                    with tf.device(part.device):
                        part.apply([grads[g % d][i] for i in part.owned])
            return
        with tf.device(self.devices[0]):
            self._apply_all([grads[k][i] for k, part in enumerate(self.parts[:d]) for i in part.owned])
        for g, row in enumerate(self.replicas):  # other copies (Chimera, data parallel) follow
            for part in row:
                if part is not self.parts[g % d]:
                    for i in part.owned:
                        part.variables[i].assign(self.parts[g % d].variables[i])

    def _reduce(self, state) -> list:
        """Per model part: the gradient summed over micro-batches, pipeline replicas (Chimera)
        and data-parallel copies (a MirroredStrategy all-reduce per rank)."""
        d = self.schedule.pipe_depth
        grads = {}
        for g, j in sorted(state.grads):
            part, acc = g % d, state.grads[g, j]
            if j > 0:
                continue
            if part in grads:
                with tf.device(self.parts[part].device):
                    acc = [a + b for a, b in zip(grads[part], acc)]
            grads[part] = acc
        if self.dp == 1:
            return [grads[k] for k in range(d)]
        out = []
        for k in range(d):  # no Chimera with data parallelism: stage k is part k
            strategy = self.strategies[self.schedule.stage_ranks[k]]
            per_copy = [state.grads[k, j] for j in range(self.dp)]
            values = [strategy.experimental_distribute_values_from_function(
                lambda ctx, i=i: per_copy[ctx.replica_id_in_sync_group][i]) for i in range(len(per_copy[0]))]
            out.append(list(strategy.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, [(v, self.parts[k].device) for v in values])))
        return out

    # ----------------------------------------------------------------------------- reports
    def memory_report(self, allocator: Optional[Callable] = None) -> list[dict]:
        """Per rank: the live ledger (bytes now, peaks since creation or `ledger.reset_peaks()`;
        ``peak_packs`` counts held + accepted micro-batch packs) and, where readable, the allocator's
        ``{'current', 'peak'}`` for the rank's device (``allocator(rank)`` overrides the reader,
        e.g. a cluster's per-worker reader)."""
        out = []
        for r, entry in enumerate(self.ledger.report()):
            entry = dict(entry, rank=r, device=self.devices[r], devices=self.rank_devices[r],
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
        self.residuals = {}          # (stage, mb) -> per copy: what B left for W
        self.split = trainer.schedule.split
        self.grads = {}
        self.losses = {}
        self.labels = {}
        self.errors = []
        self.lock = threading.Lock()
        self.transfer_seconds = [0.0] * trainer.schedule.p
        self.link = [0, 0.0]         # bytes and seconds on the timed links between ranks
        self.residual_bytes = None   # per stage, set by `PipelineTrainer.step` before the ranks run
        self.seed = 1.0 / (trainer.m * trainer.dp)  # the last stage's output gradient

    def guard(self, rank: int, body):
        """Run ``body(self, rank)``; a failure is kept for the caller and aborts every rank."""
        try:
            body(self, rank)
        except BaseException as e:  # noqa: BLE001 - re-raised by step()
            with self.lock:
                self.errors.append(e if not isinstance(e, transport.PipelineAborted) or not self.errors
                                   else self.errors[0])
            self.mailbox.abort(f"rank {rank} failed: {e!r}")

    def run_rank(self, rank: int):
        """A training step: every step of the rank's row, transfers included."""
        sch = self.t.schedule
        pack_bytes = self.t.pack_bytes
        residual_bytes = self.residual_bytes
        for step in range(sch.steps):
            action = sch.compute[rank][step]
            transfers = sch.transfers[rank][step]
            start, end = memory_lib.step_deltas(rank, action, transfers, sch.stage_ranks,
                                                pack_bytes, self.split, residual_bytes)
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

    def run_forwards(self, rank: int):
        """A forward-only step: the rank's forwards in the schedule's order, nothing else."""
        for action in self.t.schedule.compute_order(rank):
            if action.kind is F:
                EVAL_HANDLERS[F](self, rank, action)

    def _send(self, key, value, src: int, dst: int):
        """Post a stage output or input gradient; where the link between the ranks is timed (an
        injected ``link_delay``), its seconds and bytes count toward the step's link measurement."""
        t = self.t
        delay = t._delay(src, dst, value)
        if t.link_delay is not None and t.schedule.stage_ranks[src] != t.schedule.stage_ranks[dst]:
            nbytes = sum(int(v.shape.num_elements()) * v.dtype.size for v in tf.nest.flatten(value) if v is not None)
            with self.lock:
                self.link[0] += nbytes
                self.link[1] += delay
        self.mailbox.put(key, value, delay)

    def _submit(self, rank, action):
        def timed():
            start = time.perf_counter()
            HANDLERS[action.kind](self, rank, action)
            self.transfer_seconds[rank] += time.perf_counter() - start
        return self.t._transfer_pools[rank].submit(timed)

    # ------------------------------------------------------------------------------ handlers
    # Each handler does its action for every data-parallel copy j of the stage.
    def forward(self, rank, a):
        key = (a.stage, a.microbatch)
        packs = []
        for j, part in enumerate(self.t.replicas[a.stage]):
            x = self.mailbox.get(("x", a.stage, a.microbatch, j))
            if part.is_last:
                out, pack = part.program.forward(x, self.labels[a.microbatch, j])
                self.losses[a.microbatch, j] = out
            else:
                out, pack = part.program.forward(x)
                self._send(("x", a.stage + 1, a.microbatch, j), out, a.stage, a.stage + 1)
            packs.append(pack)
        with self.lock:
            self.packs[key] = packs

    def backward(self, rank, a):
        """B: the whole backward, or its input half where the schedule has this B's W."""
        sch = self.t.schedule
        key = (a.stage, a.microbatch)
        split = key in self.split
        with self.lock:
            packs = self.packs.get(key) if split else self.packs.pop(key, None)
        if packs is None:
            raise RuntimeError(f"{a}: no saved activations for stage {a.stage} micro-batch {a.microbatch}")
        residuals = []
        for j, (part, pack) in enumerate(zip(self.t.replicas[a.stage], packs)):
            if part.is_last:
                with tf.device(part.device):
                    grad = tf.constant(self.seed, part.program.output_spec.dtype)
            else:
                grad = self.mailbox.get(("g", a.stage, a.microbatch, j))
            if not pack.resident:
                raise RuntimeError(f"{a}: activations were evicted and not loaded before the backward")
            if split:
                gx, residual = part.program.backward_input(pack, grad)
                residuals.append(residual)
            else:
                gx, gvars = part.program.backward(pack, grad)
                self._accumulate(a.stage, j, part, gvars)
            if sch.prev_stage(a.stage) is not None:
                self._send(("g", a.stage - 1, a.microbatch, j), gx, a.stage, a.stage - 1)
        if split:
            with self.lock:
                self.residuals[key] = residuals

    def weight(self, rank, a):
        """W: the weight gradients from what this micro-batch's B left; frees its pack."""
        key = (a.stage, a.microbatch)
        with self.lock:
            packs = self.packs.pop(key, None)
            residuals = self.residuals.pop(key, None)
        if packs is None or residuals is None:
            raise RuntimeError(f"{a}: runs before the B of stage {a.stage} micro-batch {a.microbatch}")
        for j, (part, pack, residual) in enumerate(zip(self.t.replicas[a.stage], packs, residuals)):
            if not pack.resident:
                raise RuntimeError(f"{a}: activations were evicted and not loaded before the W")
            self._accumulate(a.stage, j, part, part.program.backward_weight(pack, residual))

    def _accumulate(self, stage, j, part, gvars):
        acc = self.grads.get((stage, j))
        with tf.device(part.device):
            self.grads[stage, j] = gvars if acc is None else self.t._accumulate(acc, gvars)

    def evict(self, rank, a):
        with self.lock:
            packs = self.packs[(a.stage, a.microbatch)]
        # pack.split drops the pack's references; once the (waited) move returns, the bases die
        # with this frame, so the evictor's copy is freed before its next action runs.
        self.evicted[(a.stage, a.microbatch)] = [
            transport.move(pack.split(part.program.plan), self.t.rank_devices[a.peer][j])
            for j, (part, pack) in enumerate(zip(self.t.replicas[a.stage], packs))]

    def load(self, rank, a):
        moved = self.evicted.pop((a.stage, a.microbatch))
        with self.lock:
            packs = self.packs[(a.stage, a.microbatch)]
        for part, pack, bases in zip(self.t.replicas[a.stage], packs, moved):
            pack.restore(part.program.plan, transport.move(bases, part.device))

    def forward_eval(self, rank, a):
        """F of a forward-only step: the part's ``training=False`` function, no pack."""
        for j, part in enumerate(self.t.replicas[a.stage]):
            x = self.mailbox.get(("x", a.stage, a.microbatch, j))
            with tf.device(part.device):
                if part.is_last:
                    self.losses[a.microbatch, j] = part.evaluator(x, self.labels[a.microbatch, j])
                else:
                    self.mailbox.put(("x", a.stage + 1, a.microbatch, j), part.evaluator(x))

    def noop(self, rank, a):
        """SEND/RECV: the mailbox moves stage outputs and gradients when they are consumed."""


#: Action kind -> handler(state, rank, action).
HANDLERS = {F: _StepState.forward, B: _StepState.backward, W: _StepState.weight,
            EVICT: _StepState.evict, LOAD: _StepState.load, SEND: _StepState.noop,
            RECV: _StepState.noop}
#: Forward-only steps (`PipelineTrainer.evaluate`).
EVAL_HANDLERS = {F: _StepState.forward_eval}
