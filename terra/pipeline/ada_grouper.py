"""Ada-Grouper: choose k of kFkB (and the micro-batch size that goes with it) for the network the
pipeline has now, and change it between steps as the network changes. Pure data.

**Candidates on the memory-limit curve** (the paper's Section 4.2). For a fixed global batch, a
larger group ``k`` keeps more micro-batches in flight (``k * min(p - s, m / k)`` on stage ``s``),
so it fits only with smaller micro-batches. For each ``k`` the largest micro-batch size ``b``
whose peak fits the budget is the candidate; smaller ``b`` with the same ``k`` under-uses memory
and is pruned, larger ``b`` does not fit. Peaks come from `simulate` with the stages' bytes per
sample (activations scale with ``b``; weights, optimizer state and gradients do not).

**Cost model.** A candidate's step time is `simulate`'s, with ``F``/``B`` per stage as a function
of the micro-batch size (``costs(b)``: small micro-batches run below peak efficiency) and the
network as a time per byte between ranks.

**Online tuning** (`Tuner`). Between steps the tuner is told the measured step time of the plan
it runs and, where the transport times its messages, the link's measured time per byte; that is
the network, and the tuner re-chooses from it at once. Without it, every ``period`` steps it infers the network's time per byte that makes the cost model
give the recent median step time for the current plan (bisection: the step time grows with the
per-byte time), re-estimates every candidate under that network, and switches to the best if it is predicted to be at least ``min_gain`` faster (a
margin against switching back and forth on timing noise).
The first ``settle`` steps after the start and after each switch are not used (a new plan's first
step warms up). The first ``period`` used steps calibrate a factor between measured and modelled
time on the network given as nominal (a machine whose ranks share cores runs slower than the model by a roughly
constant factor), so the inferred network reflects a change of the network, not of the model. A
plan measured faster than its nominal time corrects that time (the network cannot be faster than
nominal; the nominal measurement was high).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from terra.pipeline.schedules.kfkb import kfkb
from terra.pipeline.simulate import Costs, simulate


@dataclass(frozen=True)
class Candidate:
    """kFkB with group ``k`` over ``microbatches`` micro-batches of ``microbatch_size``."""
    k: int
    microbatch_size: int
    microbatches: int
    peak_bytes: tuple

    @property
    def schedule(self):
        return kfkb(len(self.peak_bytes), self.microbatches, self.k)

    def __str__(self):
        return f"k={self.k} b={self.microbatch_size} m={self.microbatches} peak={max(self.peak_bytes)} B"


def _scaled(per_sample: Sequence[int], b: int) -> list[int]:
    return [int(a) * b for a in per_sample]


def candidates(p: int, batch: int, *, act_bytes_per_sample: Sequence[int], static_bytes: Sequence[int],
               budget: int, max_k: Optional[int] = None) -> list[Candidate]:
    """The memory-limit curve: for each k, the largest micro-batch size (dividing ``batch``, with
    ``batch / b`` a multiple of ``k`` and at least ``p``) whose simulated per-rank peak fits
    ``budget``; dominated points pruned. Sorted by k."""
    if batch < 1 or budget < 1:
        raise ValueError(f"batch and budget must be positive, got {batch}, {budget}")
    if len(act_bytes_per_sample) != p or len(static_bytes) != p:
        raise ValueError(f"need one activation size and one static size per stage ({p})")
    sizes = [b for b in range(batch, 0, -1) if batch % b == 0]
    curve = []
    for k in range(1, (max_k or batch) + 1):
        for b in sizes:
            m = batch // b
            if m % k or m < p:
                continue
            sim = simulate(kfkb(p, m, k), act_bytes=_scaled(act_bytes_per_sample, b), weight_bytes=list(static_bytes))
            if max(sim.peak_bytes) <= budget:
                curve.append(Candidate(k, b, m, tuple(sim.peak_bytes)))
                break
    return curve


def estimate(candidate: Candidate, costs: Callable[[int], tuple], message_bytes_per_sample: Sequence[int],
             per_byte: float, parallel: Optional[float] = None) -> float:
    """Modelled step time of ``candidate``: ``costs(b)`` gives per-stage ``(F, B)`` lists for
    micro-batch size ``b``; messages scale with ``b``; ``parallel``: `Costs.parallel` (ranks that
    share compute; None: a device per rank)."""
    f, bw = costs(candidate.microbatch_size)
    sim = simulate(candidate.schedule, costs=Costs(F=list(f), B=list(bw), W=0.0, per_byte=per_byte,
                                                   message_bytes=_scaled(message_bytes_per_sample,
                                                                         candidate.microbatch_size),
                                                   parallel=parallel))
    return sim.step_time


def best(cands: Sequence[Candidate], costs, message_bytes_per_sample, per_byte) -> Candidate:
    """The candidate with the least modelled step time (ties: smaller k, it holds less memory)."""
    return min(cands, key=lambda c: (estimate(c, costs, message_bytes_per_sample, per_byte), c.k))


@dataclass
class Tuner:
    """Online choice of k: `observe` each step's time; every ``period`` steps it re-estimates the
    network and may return a new candidate to run from the next step.

    A candidate's step time on this machine is taken as its time on the nominal network (measured:
    ``nominal_seconds[k]``; else the model's times a factor calibrated on the first steps of the
    first plan) plus what the model says the network adds over nominal. Waiting on the wire costs
    no CPU, so the network's share is added, not scaled with the machine's slowness."""
    cands: Sequence[Candidate]
    costs: Callable[[int], tuple]
    message_bytes_per_sample: Sequence[int]
    nominal_per_byte: float = 0.0
    period: int = 3
    max_per_byte: float = 1.0
    settle: int = 0            # observations ignored after the start and after each switch (warm-up)
    nominal_seconds: Optional[dict] = None   # k -> measured step seconds on the nominal network
    min_gain: float = 0.0      # switch only for a predicted step at least this fraction shorter
    parallel: Optional[float] = None   # ranks sharing compute (`Costs.parallel`); None: a device per rank
    current: Candidate = None
    per_byte: float = None
    factor: Optional[float] = None
    history: list = field(default_factory=list)     # (step, k, measured seconds, inferred per byte)
    _recent: list = field(default_factory=list)
    _skip: int = 0
    _model_cache: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.cands:
            raise ValueError("no candidate fits the memory budget")
        if self.period < 1:
            raise ValueError(f"period must be at least 1, got {self.period}")
        self.per_byte = self.nominal_per_byte
        self._skip = self.settle
        if self.nominal_seconds is not None and all(c.k in self.nominal_seconds for c in self.cands):
            self.factor = 1.0   # nothing left to calibrate
        if self.current is None:
            self.current = self.best(self.per_byte) if self.factor is not None else \
                best(self.cands, self.costs, self.message_bytes_per_sample, self.per_byte)

    def _model(self, candidate, per_byte):
        key = (candidate.k, candidate.microbatch_size, per_byte)
        if key not in self._model_cache:
            self._model_cache[key] = estimate(candidate, self.costs, self.message_bytes_per_sample, per_byte,
                                              self.parallel)
        return self._model_cache[key]

    def predicted(self, candidate, per_byte) -> float:
        """Seconds a step of ``candidate`` should take here on a network of ``per_byte``."""
        nominal = self._model(candidate, self.nominal_per_byte)
        if self.nominal_seconds is not None and candidate.k in self.nominal_seconds:
            base = self.nominal_seconds[candidate.k]
        else:
            base = self.factor * nominal
        return base + self._model(candidate, per_byte) - nominal

    def best(self, per_byte) -> Candidate:
        return min(self.cands, key=lambda c: (self.predicted(c, per_byte), c.k))

    def _infer(self, seconds: float) -> float:
        """The per-byte time at which the current plan's predicted time matches ``seconds``."""
        lo, hi = self.nominal_per_byte, self.max_per_byte
        if self.predicted(self.current, lo) >= seconds:
            return lo
        if self.predicted(self.current, hi) <= seconds:
            return hi
        for _ in range(40):
            mid = (lo + hi) / 2
            if self.predicted(self.current, mid) < seconds:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def observe(self, seconds: float, per_byte: Optional[float] = None) -> Optional[Candidate]:
        """Record one step of the current plan; returns the plan to switch to, or None.

        ``per_byte``: the link's seconds per byte measured over this step's messages, where the
        transport times them. It is taken as the network at once, and the choice made from it
        this step: a step's time tells the network only through the model of one plan (after a
        period of steps, and poorly where that plan barely waits on the wire), a timed message
        tells it directly."""
        step = len(self.history)
        measured = per_byte is not None and self.factor is not None
        if measured:
            self.per_byte = max(self.nominal_per_byte, min(float(per_byte), self.max_per_byte))
        self.history.append((step, self.current.k, seconds, self.per_byte))
        if self._skip > 0:
            self._skip -= 1
            return self._choose() if measured else None
        self._recent.append(seconds)
        if len(self._recent) < self.period:
            return self._choose() if measured else None
        median = statistics.median(self._recent)
        self._recent = []
        if self.factor is None:   # the first period calibrates model against machine
            self.factor = median / self._model(self.current, self.nominal_per_byte)
            return None
        if (self.nominal_seconds is not None and (not measured or self.per_byte == self.nominal_per_byte)
                and median < self.predicted(self.current, self.nominal_per_byte)):
            # Faster than its nominal time: that measurement was high (noise), not the network low.
            self.nominal_seconds[self.current.k] = median
        if not measured:
            self.per_byte = self._infer(median)
        return self._choose()

    def _choose(self) -> Optional[Candidate]:
        self._model_cache = {k: v for k, v in self._model_cache.items() if k[2] in (self.per_byte, self.nominal_per_byte)}
        choice = self.best(self.per_byte)
        if choice == self.current or (self.predicted(choice, self.per_byte)
                                      > (1 - self.min_gain) * self.predicted(self.current, self.per_byte)):
            return None
        self.current = choice
        self._skip = self.settle
        return choice
