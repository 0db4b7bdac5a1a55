"""Ada-Grouper on the executor: a `PipelineTrainer` running kFkB whose k (and micro-batch size)
follows the network, chosen by `ada_grouper.Tuner` between steps.

Set-up measures what the cost model needs on the built stages themselves: for every micro-batch
size on the memory-limit curve, each stage's F and B run alone (`calibrate.stage_costs`), the
packs (activation bytes per sample) and the stage outputs (message bytes per sample); the ledger
gives the static bytes; and every candidate plan runs a few whole steps (nothing applied) to give
its step time on the network as it is during set-up (the tuner's nominal network). The model's variables are restored after those runs (Dropout's seed
state, BatchNorm's statistics), so training stays equal to one device whatever k is chosen:
every kFkB plan accumulates the same micro-batch gradients of the same global batch.
"""
from __future__ import annotations

import statistics
from typing import Optional

import numpy as np
import tensorflow as tf

from terra.pipeline import ada_grouper, calibrate
from terra.pipeline.executor import PipelineTrainer
from terra.pipeline.schedules.kfkb import kfkb


def _nbytes(spec) -> int:
    return sum(int(np.prod(s.shape.as_list())) * s.dtype.size for s in tf.nest.flatten(spec))


def _specs(x, y, b):
    spec = lambda t: tf.TensorSpec([b] + list(np.shape(t)[1:]), tf.convert_to_tensor(t).dtype)  # noqa: E731
    return tf.nest.map_structure(spec, x), spec(y)


class AdaptiveKFKB:
    """Train with kFkB, switching k between steps as `ada_grouper.Tuner` decides.

    ``trainer``: a `PipelineTrainer` with one part per rank (its schedule is replaced);
    ``x``, ``y``: a batch of the global size every step will have; ``budget``: bytes per rank;
    ``nominal_per_byte``: the network's time per byte when set-up runs; ``period``: steps between
    re-evaluations; ``parallel``: how many actions the ranks' devices run at once at full speed
    (`Costs.parallel`: about 1 for ranks sharing one machine's cores; None: a device per rank)."""

    def __init__(self, trainer: PipelineTrainer, x, y, *, budget: int, period: int = 3,
                 nominal_per_byte: float = 0.0, max_k: Optional[int] = None, repeats: int = 3,
                 settle: int = 2, min_gain: float = 0.1, nominal_repeats: int = 5,
                 parallel: Optional[float] = None):
        sch = trainer.schedule
        if sch.num_stages != sch.p:
            raise ValueError("Ada-Grouper runs kFkB: one model part per rank")
        self.trainer = trainer
        self.batch = int(np.shape(tf.nest.flatten(x)[0])[0])
        p = sch.p
        every = list({id(v): v for row in trainer.replicas for part in row
                      for v in part.variables + part.state}.values())
        saved = [v.numpy() for v in every]
        try:
            # Bytes per sample from the smallest micro-batch (one sample per micro-batch).
            probe_b = min(b for b in range(1, self.batch + 1) if self.batch % b == 0 and self.batch // b >= p)
            self._use(kfkb(p, self.batch // probe_b, 1), x, y, probe_b)
            act = [max(1, -(-n // probe_b)) for n in trainer.pack_bytes]
            msg = [_nbytes(row[0].program.output_spec) // probe_b for row in trainer.replicas]
            static = [0] * p
            for r, entry in enumerate(trainer.ledger.report()):
                static[r] = entry["weights"] + entry["optimizer"] + entry["grads"]
            self.candidates = ada_grouper.candidates(p, self.batch, act_bytes_per_sample=act,
                                                     static_bytes=static, budget=budget, max_k=max_k)
            if not self.candidates:
                raise ValueError(f"no kFkB plan fits {budget} B per rank at global batch {self.batch}")
            self._costs = {}
            self.nominal_seconds = {}
            for c in self.candidates:
                self._use(c.schedule, x, y, c.microbatch_size)
                if c.microbatch_size not in self._costs:
                    costs = calibrate.stage_costs(trainer, repeats)
                    self._costs[c.microbatch_size] = (list(costs.F), list(costs.B))
                times = []
                for i in range(nominal_repeats + 1):   # whole steps on this network, nothing applied
                    trainer.step(x, y, apply=False)
                    times.append(trainer.last_step_seconds)
                self.nominal_seconds[c.k] = statistics.median(times[1:])
        finally:
            for v, value in zip(every, saved):
                v.assign(value)
        self.tuner = ada_grouper.Tuner(self.candidates, self._costs.__getitem__, msg,
                                       nominal_per_byte=nominal_per_byte, period=period, settle=settle,
                                       nominal_seconds=self.nominal_seconds, min_gain=min_gain,
                                       parallel=parallel)
        trainer.set_schedule(self.tuner.current.schedule)
        self.switches = []

    def _use(self, schedule, x, y, b):
        self.trainer.set_schedule(schedule)
        self.trainer._build(*_specs(x, y, b))

    def step(self, x, y) -> float:
        """One training step with the current plan; the tuner may pick another for the next."""
        loss = self.trainer.step(x, y)
        new = self.tuner.observe(self.trainer.last_step_seconds, self.trainer.link_per_byte)
        if new is not None:
            self.trainer.set_schedule(new.schedule)
            self.switches.append((len(self.tuner.history), new.k))
        return loss

    @property
    def k(self) -> int:
        return self.tuner.current.k
