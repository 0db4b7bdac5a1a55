"""`terra.pipeline.pipeline`: hand over a Keras model, get a pipeline trainer.

The model becomes a `LayerGraph`; at the first batch (or at once, given ``example_batch``) every call
is profiled at the micro-batch size (`profile`), the planner picks the cuts (`planner.plan`), each
part's variables move to its rank's device, and a `PipelineTrainer` with one optimizer over all
variables runs the schedule. ``trainer.plan`` prints the cut and ``plan.explain()`` says why;
``trainer.check()`` measures what the plan predicted.
"""
from __future__ import annotations

from typing import Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from terra import _tf_private
from terra.pipeline import planner as planner_lib
from terra.pipeline import profile as profile_lib
from terra.pipeline.executor import PipelineTrainer, check_devices, full_device_name, same_device, make_schedule
from terra.pipeline.keras_graph import LayerGraph

#: Schedules that run one copy of the model (Chimera runs two: use `PipelineTrainer`).
PLANNED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "kfkb", "zb-h1", "zb-v", "dualpipe-v")


def _default_devices(p: int) -> list[str]:
    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    if len(gpus) >= p:
        return gpus[:p]
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(cpus) >= p:
        return cpus[:p]
    raise ValueError(f"{p} stages need {p} devices; this process has GPUs {gpus} and CPUs {cpus} (split "
                     f"the CPU with tf.config.set_logical_device_configuration before TF starts, or "
                     f"pass devices=)")


def _loss_fn(loss):
    """A ``(labels, predictions) -> scalar mean`` from a Keras loss (object or name) or callable."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if not callable(loss):
        raise TypeError(f"loss must be a Keras loss, its name, or a callable (y, y_pred), got {loss!r}")
    return lambda labels, predictions: tf.reduce_mean(loss(labels, predictions))


def _optimizer_slots(optimizer) -> int:
    """How many variables the optimizer keeps per model variable (Adam 2, SGD 0 or 1), found by
    building a fresh copy on one variable."""
    try:
        probe = [keras.Variable(np.zeros(1, "float32"))]
        empty = type(optimizer).from_config(optimizer.get_config())
        empty.build([])
        full = type(optimizer).from_config(optimizer.get_config())
        full.build(probe)
        return max(0, len(full.variables) - len(empty.variables))
    except Exception:  # noqa: BLE001 - an optimizer that cannot be cloned: assume Adam's two
        return 2


def _spec_of(t, size):
    return tf.TensorSpec([size] + list(t.shape[1:]), t.dtype)


class ModelPipeline:
    """A Keras model trained with a pipeline schedule; see `pipeline`."""

    def __init__(self, model, loss, optimizer, *, stages: Optional[int], devices: Optional[Sequence[str]],
                 schedule: str, balance: Optional[str], microbatches: int, memory_budget: Optional[int],
                 example_batch: Optional[tuple], cuts: Optional[Sequence[int]], measure: bool,
                 timeout: float, schedule_options: dict, memory_probe=None):
        if not isinstance(schedule, str) or schedule not in PLANNED_SCHEDULES:
            raise ValueError(f"schedule must be one of {list(PLANNED_SCHEDULES)}, got {schedule!r}"
                             + (" (Chimera runs two model copies: use PipelineTrainer)" if schedule == "chimera" else ""))
        if devices is None:
            if stages is None:
                raise ValueError("pass stages= (the number of pipeline ranks) or devices=")
            if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
                raise ValueError(f"stages must be a positive int, got {stages!r}")
            devices = _default_devices(stages)
        devices = list(devices)
        if stages is not None and stages != len(devices):
            raise ValueError(f"stages={stages} but {len(devices)} devices were given")
        check_devices([[d] for d in devices])
        self.graph = LayerGraph.of(model)
        self.model = model
        self.loss_fn = _loss_fn(loss)
        if isinstance(optimizer, str):
            optimizer = keras.optimizers.get(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a keras.optimizers.Optimizer or its name, got {optimizer!r}")
        if optimizer.built:
            raise ValueError("the optimizer is already built for other variables; pass a new one")
        self.optimizer = optimizer
        self.devices = devices
        self.schedule = make_schedule(schedule, len(devices), microbatches, balance, **schedule_options)
        self.m = microbatches
        self.memory_budget = memory_budget
        self.cuts = None if cuts is None else list(cuts)
        self.measure = measure
        self.memory_probe = memory_probe
        self.timeout = timeout
        self.profile: Optional[profile_lib.Profile] = None
        self._plan: Optional[planner_lib.Plan] = None
        self.trainer: Optional[PipelineTrainer] = None
        self.segments = []
        if example_batch is not None:
            self._prepare_for(*example_batch)

    # ------------------------------------------------------------------------------ planning
    @property
    def plan(self) -> planner_lib.Plan:
        if self._plan is None:
            raise RuntimeError("the plan is made at the first step (or pass example_batch=(x, y) to pipeline())")
        return self._plan

    def _specs(self, x, y):
        leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(x)]
        if not leaves:
            raise ValueError("x holds no tensors")
        batch_size = leaves[0].shape[0]
        if batch_size is None or batch_size % self.m:
            raise ValueError(f"batch size {batch_size} must be a multiple of microbatches={self.m}")
        size = batch_size // self.m
        x_spec = tf.nest.map_structure(lambda t: _spec_of(tf.convert_to_tensor(t), size), x)
        return x_spec, _spec_of(tf.convert_to_tensor(y), size)

    def _prepare_for(self, x, y):
        x_spec, y_spec = self._specs(x, y)
        self.profile = profile_lib.profile(self.graph, self.loss_fn, x_spec, y_spec, device=self.devices[0],
                                           measure=self.measure, probe=self.memory_probe)
        self._plan = planner_lib.plan(self.profile, self.schedule, memory_budget=self.memory_budget,
                                      optimizer_slots=_optimizer_slots(self.optimizer), cuts=self.cuts)
        self.segments = [self.graph.segment(p.start, p.stop) for p in self._plan.parts]
        placed = set()
        for part, segment in zip(self._plan.parts, self.segments):
            device = self.devices[part.rank]
            for v in segment.variables:   # a variable shared by parts lives with the first
                if id(v) in placed:
                    continue
                placed.add(id(v))
                if not same_device(full_device_name(v.value.device), full_device_name(device)):
                    _tf_private.move_keras_variable(v, device)
        optimizer = self.optimizer
        self.trainer = PipelineTrainer([[s] for s in self.segments], lambda: optimizer, devices=self.devices,
                                       schedule=self.schedule, microbatches=self.m, loss_fn=self.loss_fn,
                                       one_optimizer=True, timeout=self.timeout)

    # --------------------------------------------------------------------------------- steps
    def _ready(self, x, y):
        if self.trainer is None:
            self._prepare_for(x, y)

    def step(self, x, y) -> float:
        """One training step on batch (x, y); returns the mean loss over the batch."""
        self._ready(x, y)
        return self.trainer.step(x, y)

    def evaluate(self, x, y) -> float:
        """Forward-only mean loss with ``training=False``; nothing is updated."""
        self._ready(x, y)
        return self.trainer.evaluate(x, y)

    def memory_report(self, allocator=None) -> list[dict]:
        return self.trainer.memory_report(allocator)

    @property
    def last_step_seconds(self):
        return None if self.trainer is None else self.trainer.last_step_seconds

    def close(self):
        if self.trainer is not None:
            self.trainer.close()

    # ---------------------------------------------------------------------------- prediction
    def check(self, repeats: int = 5) -> list[dict]:
        """The plan's predictions beside measurement, per part: pack bytes (the built stage's
        saved activations), forward and backward seconds (the part's compiled pair run alone on
        its device, median of ``repeats``), the rank's peak bytes in the executor's ledger after
        the steps run so far (beside the plan's peak in the same terms), and where the device
        keeps allocator stats its allocator peak (beside the plan's total with temporaries). ``*_error`` is (predicted - measured) / measured."""
        if self.trainer is None or self.trainer._built_for is None:
            raise RuntimeError("check() needs one step first: the parts are built at the first step")
        ledger = self.trainer.memory_report()
        every = self.graph.segment(0, len(self.graph)).variables
        saved = [v.numpy() for v in every]   # the runs below draw dropout and move statistics
        try:
            return self._check(ledger, repeats)
        finally:
            for v, value in zip(every, saved):
                v.assign(value)

    def _check(self, ledger, repeats):
        rows = []
        for part, tpart in zip(self.plan.parts, self.trainer.parts):
            program = tpart.program
            x = tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), program.input_spec)
            labels = None
            if program.is_last:
                labels = tf.zeros(self.trainer._built_for[1].shape, self.trainer._built_for[1].dtype)
            out, pack = program.forward(x, labels)
            grad = tf.nest.map_structure(tf.ones_like, out)
            row = {"part": part.index, "rank": part.rank, "pack_bytes": program.plan.moved_bytes,
                   "pack_bytes_predicted": part.act_bytes}
            if self.profile.measured:
                row["forward_s"] = _median(lambda: program.forward(x, labels), repeats)
                row["backward_s"] = _median(lambda: program.backward(pack, grad), repeats)
                row["forward_s_predicted"], row["backward_s_predicted"] = part.forward, part.backward
            rank = ledger[part.rank]
            row["rank_peak_bytes"] = rank["peak_total"]     # the ledger's terms: no temporaries
            row["rank_peak_bytes_predicted"] = self.plan.rank_peak_bytes[part.rank]
            row["rank_total_bytes_predicted"] = self.plan.rank_total_bytes[part.rank]
            if rank.get("allocator"):
                row["allocator_peak_bytes"] = rank["allocator"]["peak"]
            for key in ("pack_bytes", "forward_s", "backward_s", "rank_peak_bytes"):
                if key in row and row[key]:
                    row[key + "_error"] = (row[key + "_predicted"] - row[key]) / row[key]
            rows.append(row)
        return rows


def _median(fn, repeats):
    return profile_lib._median_seconds(fn, repeats)


def pipeline(model, loss, optimizer, stages: Optional[int] = None, devices: Optional[Sequence[str]] = None,
             schedule: str = "1f1b", balance: Optional[str] = None, microbatches: int = 4, *,
             memory_budget: Optional[int] = None, example_batch: Optional[tuple] = None,
             cuts: Optional[Sequence[int]] = None, measure: bool = True, timeout: float = 120.0,
             memory_probe=None, **schedule_options) -> ModelPipeline:
    """Train ``model`` (a ``keras.Sequential``, a functional model, or a list of blocks applied in
    order) with pipeline ``schedule`` over ``stages`` ranks.

    ``loss``: a Keras loss (object or name) or a callable ``(y, y_pred)``; its mean over each
    micro-batch is the micro-batch's loss. ``optimizer``: a new Keras optimizer (or its name); one
    optimizer updates every variable after each step, so ``global_clipnorm`` and a
    ``LossScaleOptimizer`` see the whole model. ``devices``: one per rank (default: the first
    ``stages`` GPUs, else logical CPUs). ``balance="bpipe"`` adds BPipe's evict/load pass.
    ``memory_budget``: bytes per device the plan must fit. ``example_batch``: an ``(x, y)`` batch
    of the size every step will have, to plan now rather than at the first step. ``cuts``: the call index where each part
    after the first starts, instead of the planner's. ``measure=False`` plans on FLOPs instead of
    measured times. ``memory_probe``: the first device's allocator (`memory.AllocatorProbe`;
    default: its own where TF keeps stats, as on GPUs) to measure each backward's temporaries. ``schedule_options``: ``v`` for interleaved, ``k`` for kFkB.

    The model's variables move to the devices of the parts that use them (a variable shared by
    parts lives with the first). Returns a `ModelPipeline`: ``step(x, y)``, ``evaluate(x, y)``,
    ``plan`` (with ``explain()``), ``profile``, ``check()``, ``memory_report()``, ``close()``.
    """
    return ModelPipeline(model, loss, optimizer, stages=stages, devices=devices, schedule=schedule,
                         balance=balance, microbatches=microbatches, memory_budget=memory_budget,
                         example_batch=example_batch, cuts=cuts, measure=measure, timeout=timeout,
                         schedule_options=schedule_options, memory_probe=memory_probe)
