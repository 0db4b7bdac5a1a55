"""The cost model calibrated from a built `PipelineTrainer`: what `simulate` predicts for its
schedule with its own measured action times and byte sizes, to set beside what it measured.

Each stage's F, B and W is timed alone on its device with its compiled programs (median of
``repeats`` after warm-up; B and W separately where the schedule splits backwards (an unsplit B
of such a schedule, as DualPipeV's steady state has, is then costed B + W), else the whole
backward as B). Bytes are the built stages' packs and the ledger's static bytes per rank.
By default the prediction assumes each rank has its device to itself; `predict(parallel=...)`
models ranks that share compute (logical CPUs on one machine: `Costs.parallel`).

Where each rank's allocator can be read (`predict(probes=...)`: a GPU's own, a cluster worker's),
each stage's backward working set is measured too, as the planner's profile does per call: the
allocator's peak during the stage's backward above what was live before it. A rank's
temporaries are the largest of its stages' working sets and their accumulation (the new gradients
beside the new sum: twice the stage's weights); `Prediction.total_peak_bytes` adds them to the
simulated peaks, what the rank's allocator should peak at.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tensorflow as tf

from terra.pipeline import profile as profile_lib
from terra.pipeline.simulate import Costs, SimResult, simulate


@dataclass(frozen=True)
class Prediction:
    """Measured per-stage costs and what the simulator makes of them."""
    costs: Costs
    result: SimResult
    temp_bytes: tuple = ()     # per rank, where measured (`predict(probes=...)`)

    @property
    def step_time(self) -> float:
        return self.result.step_time

    @property
    def bubble(self) -> float:
        return self.result.bubble

    @property
    def peak_bytes(self) -> tuple:
        return self.result.peak_bytes

    @property
    def total_peak_bytes(self) -> tuple:
        """Per rank: the simulated peak (weights, optimizer state, gradients, packs) plus the
        measured temporaries; the simulated peak alone where none were measured."""
        temps = self.temp_bytes or (0,) * len(self.peak_bytes)
        return tuple(a + b for a, b in zip(self.peak_bytes, temps))


def _zeros(spec):
    return tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), spec)


def stage_costs(trainer, repeats: int = 5) -> Costs:
    """Per global stage: F, B, W seconds of its first copy's programs, run alone."""
    if trainer._built_for is None:
        raise RuntimeError("stage costs are measured after the first step (the stages are built then)")
    split = bool(trainer.schedule.split)
    time = profile_lib._median_seconds
    f, b, w = [], [], []
    labels_spec = trainer._built_for[1]
    for row in trainer.replicas:
        program = row[0].program
        x = _zeros(program.input_spec)
        labels = _zeros(labels_spec) if program.is_last else None
        out, pack = program.forward(x, labels)
        grad = tf.nest.map_structure(tf.ones_like, out)
        f.append(time(lambda: program.forward(x, labels), repeats))
        if split:
            _, residual = program.backward_input(pack, grad)
            b.append(time(lambda: program.backward_input(pack, grad), repeats))
            w.append(time(lambda: program.backward_weight(pack, residual), repeats))
        else:
            b.append(time(lambda: program.backward(pack, grad), repeats))
            w.append(0.0)
    return Costs(F=f, B=b, W=w)


def stage_temps(trainer, probes) -> list[int]:
    """Per rank: its stages' largest backward working set or accumulation (see the module
    docstring); ``probes[rank]``: an `memory.AllocatorProbe` of the rank's device."""
    sch = trainer.schedule
    labels_spec = trainer._built_for[1]
    temps = [0] * sch.p
    for stage, row in enumerate(trainer.replicas):
        part = row[0]
        program = part.program
        rank = sch.stage_ranks[stage]
        out, pack = program.forward(_zeros(program.input_spec), _zeros(labels_spec) if program.is_last else None)
        grad = tf.nest.map_structure(tf.ones_like, out)
        work = profile_lib._backward_peak(program, pack, grad, probes[rank])
        weights = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in program.variables)
        temps[rank] = max(temps[rank], work, 2 * weights)
    return temps


def predict(trainer, repeats: int = 5, parallel: Optional[float] = None,
            costs: Optional[Costs] = None, probes=None) -> Prediction:
    """Simulate the trainer's schedule with its measured costs, its packs and its ledger's static
    bytes (per rank, given to the rank's first stage). ``parallel``: how many actions the
    devices run at once at full speed (`Costs.parallel`; None: a device per rank; about 1 where
    the ranks are logical CPUs of one machine, each action timed alone having used every core).
    ``costs``: stage costs measured before (`Prediction.costs`), so as not to measure again.
    ``probes``: one allocator probe per rank, to measure temporaries (`stage_temps`)."""
    costs = stage_costs(trainer, repeats) if costs is None else costs
    costs = dataclasses.replace(costs, parallel=parallel)
    sch = trainer.schedule
    static = [0] * sch.num_stages
    for r, entry in enumerate(trainer.ledger.report()):
        stages = sch.stages_of(r)
        if stages:
            static[stages[0]] = entry["weights"] + entry["optimizer"] + entry["grads"]
    result = simulate(sch, act_bytes=trainer.pack_bytes, weight_bytes=static, costs=costs,
                      residual_bytes=trainer.residual_bytes)
    temps = tuple(stage_temps(trainer, probes)) if probes is not None else ()
    return Prediction(costs, result, temps)
