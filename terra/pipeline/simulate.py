"""Memory simulation of a schedule: which micro-batches' activations each rank holds at each step.

Counting rules (the executor's byte ledger uses the same ones):

* a rank holds the activations of (stage, micro-batch) from the step of its forward through the
  step of its backward, inclusive;
* an EVICT in step ``e`` and the matching LOAD in step ``l`` remove them from the evictor for the
  steps strictly between ``e`` and ``l``, and add them to the acceptor (the EVICT's ``peer``) for
  steps ``e .. l`` inclusive (a transfer occupies memory on both ends while it runs);
* bytes on a rank at a step = the weights of the stages it runs + ``act_bytes`` of every stage /
  micro-batch it holds (its own and the accepted ones).

Micro-batch counts are in units of one stage's activations (for interleaved schedules: one
chunk's; for Chimera: one replica stage's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from terra.pipeline.actions import B, EVICT, F, LOAD
from terra.pipeline.schedules.base import Schedule
from terra.pipeline.validate import Problem, problems

Bytes = Union[int, Mapping[int, int], None]


@dataclass(frozen=True, slots=True)
class SimResult:
    """What `simulate` found. Per-rank tuples are indexed by rank, ``held`` by [rank][step]."""
    schedule: Schedule
    held: tuple[tuple[int, ...], ...]          # micro-batches held (own + accepted) per rank, step
    accepted: tuple[tuple[int, ...], ...]      # of which accepted from an evictor
    peak_microbatches: tuple[int, ...]
    peak_accepted: tuple[int, ...]
    peak_stage_microbatches: dict              # {stage: max micro-batches of it held on its rank}
    evictions: int
    loads: int
    violations: tuple[Problem, ...]
    bytes: Optional[tuple[tuple[int, ...], ...]] = None   # per rank, step (if sizes were given)
    peak_bytes: Optional[tuple[int, ...]] = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def timeline(self, max_steps: Optional[int] = None) -> str:
        """Text grid: per rank its compute row, its transfer row (if any) and a ``#`` row with
        the number of micro-batches it holds at each step."""
        from terra.pipeline.visualize import timeline
        return timeline(self, max_steps=max_steps)

    def plot(self, path, title: Optional[str] = None) -> str:
        """Write a PNG (rank x time, F/B cells, evict/load marks, held counts); return path."""
        from terra.pipeline.visualize import plot
        return plot(self, path, title=title)

    def __repr__(self) -> str:
        extra = "" if self.peak_bytes is None else f", peak_bytes={list(self.peak_bytes)}"
        return (f"SimResult({self.schedule.name}, peak_microbatches={list(self.peak_microbatches)}, "
                f"peak_accepted={list(self.peak_accepted)}, evictions={self.evictions}, "
                f"violations={len(self.violations)}{extra})")


def _per_stage(value: Bytes, stages: int, name: str) -> Optional[list[int]]:
    if value is None:
        return None
    if isinstance(value, Mapping):
        missing = [s for s in range(stages) if s not in value]
        if missing:
            raise ValueError(f"{name} lacks stages {missing}")
        out = [value[s] for s in range(stages)]
    elif isinstance(value, (list, tuple)):
        if len(value) != stages:
            raise ValueError(f"{name} needs {stages} entries (one per stage), got {len(value)}")
        out = list(value)
    else:
        out = [value] * stages
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} entries must be non-negative ints (bytes), got {v!r}")
    return out


def simulate(schedule: Schedule, act_bytes: Bytes = None, weight_bytes: Bytes = None) -> SimResult:
    """Simulate memory of ``schedule``. ``act_bytes`` / ``weight_bytes``: bytes of one stage's
    activations for one micro-batch / of one stage's weights, as an int (all stages) or a
    per-stage sequence or mapping."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a Schedule, got {type(schedule).__name__}")
    violations = tuple(problems(schedule))
    p, T = schedule.p, schedule.steps
    acts = _per_stage(act_bytes, schedule.num_stages, "act_bytes")
    weights = _per_stage(weight_bytes, schedule.num_stages, "weight_bytes")
    if weights is not None and acts is None:
        acts = [0] * schedule.num_stages

    f_at, b_at = {}, {}
    for r, t, a in schedule.actions():
        if a.kind is F:
            f_at[(a.stage, a.microbatch)] = (r, t)
        elif a.kind is B:
            b_at[(a.stage, a.microbatch)] = (r, t)
    # away[(stage, mb)] = list of (evict step, load step, evictor, acceptor)
    away: dict[tuple[int, int], list] = {}
    open_evictions: dict[tuple[int, int], tuple[int, int, Optional[int]]] = {}
    evictions = loads = 0
    for r, t, x in schedule.actions():
        key = (x.stage, x.microbatch)
        if x.kind is EVICT:
            evictions += 1
            open_evictions[key] = (t, r, x.peer)
        elif x.kind is LOAD:
            loads += 1
            if key in open_evictions:
                e, er, peer = open_evictions.pop(key)
                away.setdefault(key, []).append((e, t, er, peer))
    for key, (e, er, peer) in open_evictions.items():   # never loaded: away until the end
        away.setdefault(key, []).append((e, T, er, peer))

    held = [[0] * T for _ in range(p)]
    accepted = [[0] * T for _ in range(p)]
    stage_held = {s: [0] * T for s in range(schedule.num_stages)}
    mem = [[0] * T for _ in range(p)] if acts is not None else None
    for key, (r, f) in f_at.items():
        b = b_at.get(key, (r, T - 1))[1]
        gaps = away.get(key, [])
        for t in range(f, b + 1):
            if any(e < t < l for e, l, _, _ in gaps):
                continue
            held[r][t] += 1
            stage_held[key[0]][t] += 1
            if mem is not None:
                mem[r][t] += acts[key[0]]
        for e, l, _, peer in gaps:
            if peer is None or not 0 <= peer < p:
                continue
            for t in range(e, min(l, T - 1) + 1):
                held[peer][t] += 1
                accepted[peer][t] += 1
                if mem is not None:
                    mem[peer][t] += acts[key[0]]
    if mem is not None and weights is not None:
        for s, r in enumerate(schedule.stage_ranks):
            for t in range(T):
                mem[r][t] += weights[s]

    return SimResult(
        schedule=schedule,
        held=tuple(map(tuple, held)),
        accepted=tuple(map(tuple, accepted)),
        peak_microbatches=tuple(max(row, default=0) for row in held),
        peak_accepted=tuple(max(row, default=0) for row in accepted),
        peak_stage_microbatches={s: max(row, default=0) for s, row in stage_held.items()},
        evictions=evictions,
        loads=loads,
        violations=violations,
        bytes=None if mem is None else tuple(map(tuple, mem)),
        peak_bytes=None if mem is None else tuple(max(row, default=0) for row in mem),
    )
