"""Simulation of a schedule: which micro-batches' activations each rank holds at each step, and
how long the step takes under a cost model.

Counting rules (the executor's byte ledger uses the same ones):

* a rank holds the activations of (stage, micro-batch) from the step of its forward through the
  step of its backward, inclusive (through its W where the backward is split: W reads them);
* an EVICT in step ``e`` and the matching LOAD in step ``l`` remove them from the evictor for the
  steps strictly between ``e`` and ``l``, and add them to the acceptor (the EVICT's ``peer``) for
  steps ``e .. l`` inclusive (a transfer occupies memory on both ends while it runs);
* bytes on a rank at a step = the weights of the stages it runs + ``act_bytes`` of every stage /
  micro-batch it holds (its own and the accepted ones).

Micro-batch counts are in units of one stage's activations (for interleaved schedules: one
chunk's; for Chimera: one replica stage's).

Time (`Costs`): the grid's steps only fix each rank's order, as on the executor. Each rank runs
its compute actions in that order, each as soon as the rank is free and its inputs are there: an
F, B or W costs ``Costs.F`` / ``B`` / ``W`` of its stage, and a B whose backward is not split
costs ``B + W``; an input from another rank arrives ``per_byte * message_bytes`` after it was
produced (``message_bytes[s]``: stage ``s``'s output per micro-batch, which is also the size of
the input gradient it gets back; ``per_byte``: one number, or one per link between two ranks).
Transfer-lane actions (SEND/RECV, EVICT/LOAD) overlap compute and cost nothing here. ``step_time`` is when the last action ends; a rank's bubble is its idle
time over its compute time, ``(step_time - busy) / busy`` (the Zero Bubble paper's measure), and
``bubble`` the largest over ranks. With the default unit costs, 1F1B's bubble is
``(p - 1) / m``, ZB-H1's ``(p - 1) / 3m`` and ZB-V's ``(p - 1) / 6m`` (the ramp alone).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

from terra.pipeline.actions import Action, B, EVICT, F, LOAD, W
from terra.pipeline.schedules.base import Schedule, action_deps
from terra.pipeline.validate import Problem, problems

Bytes = Union[int, Mapping[int, int], None]
Cost = Union[float, Sequence[float], Mapping[int, float]]


@dataclass(frozen=True, slots=True)
class Costs:
    """Per-action times for `simulate`. ``F``, ``B``, ``W``: a number (every stage) or one per
    stage (sequence or mapping); an unsplit backward costs ``B + W``. ``per_byte``: time per
    byte between two ranks, one number for every link or ``{(rank, rank): time}`` per link (either
    order; a link the schedule uses must be there); ``message_bytes``: bytes of each stage's
    output per micro-batch (an int for every stage, or one per stage). ``parallel``: how many
    actions the ranks' devices run at once at full speed (None: every rank has its own device);
    with ``n`` actions running, each then progresses at ``min(1, parallel / n)`` of its speed
    alone (ranks sharing cores, as logical CPUs on one machine do: an action timed alone already
    used every core, so there ``parallel`` is about 1)."""
    F: Cost = 1
    B: Cost = 1
    W: Cost = 1
    per_byte: Union[float, Mapping[tuple, float]] = 0.0
    message_bytes: Bytes = 0
    parallel: Optional[float] = None

    def per_stage(self, stages: int) -> dict:
        """{kind: [time per stage]}, and "bytes": [message bytes per stage]."""
        out = {kind: _per_stage_value(value, stages, f"Costs.{kind.name}")
               for kind, value in ((F, self.F), (B, self.B), (W, self.W))}
        out["bytes"] = _per_stage(self.message_bytes, stages, "Costs.message_bytes")
        if self.parallel is not None and (isinstance(self.parallel, bool) or not isinstance(
                self.parallel, (int, float)) or not self.parallel > 0):
            raise ValueError(f"Costs.parallel must be a positive number or None, got "
                             f"{self.parallel!r}")
        links = self.per_byte.values() if isinstance(self.per_byte, Mapping) else [self.per_byte]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in links):
            raise ValueError(f"Costs.per_byte must be a non-negative number or a mapping "
                             f"(rank, rank) -> non-negative number, got {self.per_byte!r}")
        return out

    def link(self, a: int, b: int) -> float:
        """Time per byte between ranks ``a`` and ``b``."""
        if not isinstance(self.per_byte, Mapping):
            return self.per_byte
        for key in ((a, b), (b, a)):
            if key in self.per_byte:
                return self.per_byte[key]
        raise ValueError(f"Costs.per_byte has no link between ranks {a} and {b}")


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
    step_time: Optional[float] = None          # None if the schedule deadlocks
    rank_bubble: Optional[tuple[float, ...]] = None   # per rank: idle time / compute time
    busy: Optional[tuple[float, ...]] = None   # per rank: compute time
    times: Optional[dict] = None               # {compute Action: (start, end)}

    @property
    def bubble(self) -> Optional[float]:
        """The largest rank's idle time over its compute time (see the module docstring)."""
        return None if self.rank_bubble is None else max(self.rank_bubble, default=0.0)

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


def _per_stage_value(value: Cost, stages: int, name: str) -> list[float]:
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
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{name} entries must be non-negative numbers, got {v!r}")
    return out


def timing(schedule: Schedule, costs: Optional[Costs] = None):
    """Event-driven replay of each rank's compute order (rules in the module docstring).
    Returns ({action: (start, end)}, step_time, busy per rank), or None if it deadlocks."""
    costs = costs or Costs()
    table = costs.per_stage(schedule.num_stages)
    split = schedule.split
    orders = [schedule.compute_order(r) for r in range(schedule.p)]

    def cost(a: Action) -> float:
        if a.kind is B and (a.stage, a.microbatch) not in split:
            return table[B][a.stage] + table[W][a.stage]
        return table[a.kind][a.stage]

    if costs.parallel is not None:
        return _shared_timing(schedule, costs, table, orders, cost)

    times: dict[Action, tuple[float, float]] = {}
    free = [0.0] * schedule.p
    pos = [0] * schedule.p
    progress = True
    while progress:
        progress = False
        for r in range(schedule.p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                deps = action_deps(a, schedule.next_stage, schedule.prev_stage)
                if not all(d in times for d in deps):
                    break
                ready = [times[d][1] + _arrival(costs, table, schedule, d, a, r) for d in deps]
                start = max([free[r]] + ready)
                times[a] = (start, start + cost(a))
                free[r] = times[a][1]
                pos[r] += 1
                progress = True
    if any(pos[r] < len(orders[r]) for r in range(schedule.p)):
        return None
    busy = tuple(sum(cost(a) for a in orders[r]) for r in range(schedule.p))
    return times, max((end for _, end in times.values()), default=0.0), busy


def _shared_timing(schedule: Schedule, costs: Costs, table, orders, cost):
    """`timing` with the ranks sharing ``costs.parallel`` devices' worth of compute: a time-ordered
    replay in which the running actions progress at ``min(1, parallel / running)`` each."""
    p, cap = schedule.p, float(costs.parallel)
    times: dict[Action, tuple[float, float]] = {}
    pos = [0] * p
    free = [0.0] * p
    running: dict[int, list] = {}   # rank -> [action, start, work left]
    now, eps = 0.0, 1e-12

    def ready_at(r):
        """When rank r's next action may start (None: a dependency has not finished)."""
        a = orders[r][pos[r]]
        deps = action_deps(a, schedule.next_stage, schedule.prev_stage)
        if not all(d in times for d in deps):
            return None
        return max([free[r]] + [times[d][1] + _arrival(costs, table, schedule, d, a, r)
                                for d in deps])

    while True:
        waits = []
        for r in range(p):
            if r in running or pos[r] >= len(orders[r]):
                continue
            t = ready_at(r)
            if t is None:
                continue
            if t <= now + eps:
                running[r] = [orders[r][pos[r]], now, cost(orders[r][pos[r]])]
            else:
                waits.append(t)
        if not running and not waits:
            break
        rate = min(1.0, cap / len(running)) if running else 0.0
        step = min([w - now for w in waits] +
                   [left / rate for _, _, left in running.values()] if rate else
                   [w - now for w in waits])
        now += step
        for r in list(running):
            entry = running[r]
            entry[2] -= rate * step
            if entry[2] <= eps:
                a, start, _ = running.pop(r)
                times[a] = (start, now)
                free[r] = now
                pos[r] += 1
    if any(pos[r] < len(orders[r]) for r in range(p)):
        return None
    busy = tuple(sum(cost(a) for a in orders[r]) for r in range(p))
    return times, max((end for _, end in times.values()), default=0.0), busy


def _arrival(costs: Costs, table, schedule: Schedule, dep: Action, action: Action, rank: int) -> float:
    """Time from ``dep``'s end until its output (or input gradient) is on ``action``'s rank."""
    source = schedule.rank_of(dep.stage)
    if source == rank:
        return 0.0
    return costs.link(source, rank) * table["bytes"][min(dep.stage, action.stage)]


def simulate(schedule: Schedule, act_bytes: Bytes = None, weight_bytes: Bytes = None,
             costs: Optional[Costs] = None, residual_bytes: Bytes = None) -> SimResult:
    """Simulate memory and time of ``schedule``. ``act_bytes`` / ``weight_bytes``: bytes of one
    stage's activations for one micro-batch / of one stage's weights, as an int (all stages) or
    a per-stage sequence or mapping. ``residual_bytes``: what a split B leaves for its W (the
    output and intermediate gradients), held on the rank from B's step through W's. ``costs``: a
    `Costs` (default: F = B = W = 1, no transfer time)."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a Schedule, got {type(schedule).__name__}")
    violations = tuple(problems(schedule))
    p, T = schedule.p, schedule.steps
    acts = _per_stage(act_bytes, schedule.num_stages, "act_bytes")
    weights = _per_stage(weight_bytes, schedule.num_stages, "weight_bytes")
    residuals = _per_stage(residual_bytes, schedule.num_stages, "residual_bytes")
    if (weights is not None or residuals is not None) and acts is None:
        acts = [0] * schedule.num_stages

    f_at, b_at = {}, {}   # b_at: the last step that reads the activations (B, or W if split)
    split_b, w_at = {}, {}  # a split B's step and its W's
    for r, t, a in schedule.actions():
        if a.kind is F:
            f_at[(a.stage, a.microbatch)] = (r, t)
        elif a.kind is W or (a.kind is B and (a.stage, a.microbatch) not in b_at):
            b_at[(a.stage, a.microbatch)] = (r, t)
        if a.kind is B and (a.stage, a.microbatch) in schedule.split:
            split_b[(a.stage, a.microbatch)] = (r, t)
        elif a.kind is W:
            w_at[(a.stage, a.microbatch)] = t
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
    if mem is not None and residuals is not None:
        for key, (r, b) in split_b.items():
            for t in range(b, w_at.get(key, T - 1) + 1):
                mem[r][t] += residuals[key[0]]
    if mem is not None and weights is not None:
        for s, r in enumerate(schedule.stage_ranks):
            for t in range(T):
                mem[r][t] += weights[s]

    timed = timing(schedule, costs)
    times, step_time, busy = timed if timed is not None else (None, None, None)
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
        step_time=step_time,
        rank_bubble=None if busy is None else tuple(
            (step_time - b) / b if b else 0.0 for b in busy),
        busy=busy,
        times=times,
    )
