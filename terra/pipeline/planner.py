"""Where to cut a model into pipeline parts: the cut that minimizes the slowest part's time while
every part fits its device's memory, with the schedule's in-flight micro-batches in the memory
model. Pure data: it reads a `terra.pipeline.profile.Profile` and a `Schedule`, imports no TF.

Memory of part ``s`` (bytes): its weights, their gradient accumulators and ``optimizer_slots``
optimizer slots per weight (each distinct variable once, charged to the first part using it, where
the executor keeps it), its other variables, and its saved
activations per micro-batch times the most micro-batches of ``s`` its rank holds at once under the
schedule (`simulate(...).peak_stage_microbatches`: ``p - s`` packs for 1F1B, ``m`` for GPipe).
Temporaries: the part's new gradients and the accumulation's new sum (twice its weights), plus
the largest backward working set among its calls where the profile measured one with an
allocator (`CallProfile.temp_bytes`: on GPUs, on cluster workers); without an allocator only the
first term is known, and the plan says so. For one part per rank this is exact in the ledger's
terms (weights, optimizer, gradients, packs); temporaries are an estimate. Where a rank runs several parts
(interleaved, ZB-V) or accepts a BPipe partner's packs, the cut is chosen per part and every rank
is then checked by simulating the schedule with the parts' bytes (`simulate`), which also gives
the predicted step time and bubble.

The search is a dynamic program over contiguous cuts of the call order (exact for the bottleneck
objective), ties broken by fewer bytes crossing cuts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from terra.pipeline.schedules.base import Schedule
from terra.pipeline.simulate import Costs, simulate


class NoPlan(ValueError):
    """No cut of the model into the schedule's parts fits the memory budget."""


@dataclass(frozen=True)
class PartPlan:
    """Part ``index`` runs calls ``start .. stop - 1`` on rank ``rank``."""
    index: int
    rank: int
    start: int
    stop: int
    first: str
    last: str
    forward: float
    backward: float
    static_bytes: int
    act_bytes: int
    inflight: int
    message_bytes: int     # bytes of what it sends to the next part per micro-batch
    temp_bytes: int = 0    # temporaries at its backward's peak (see the module docstring)

    @property
    def time(self) -> float:
        return self.forward + self.backward

    @property
    def memory(self) -> int:
        """Bytes predicted for this part alone: static, its in-flight packs, temporaries."""
        return self.static_bytes + self.act_bytes * self.inflight + self.temp_bytes


@dataclass(frozen=True)
class Plan:
    """A cut of the model into parts for one schedule, with what the planner predicts."""
    schedule: str
    microbatches: int
    microbatch_size: int
    unit: str                          # "s" (measured seconds) or "FLOP"
    parts: tuple
    budget: Optional[int]
    rank_peak_bytes: tuple             # simulated per-rank peak of the ledger's terms (weights, optimizer, packs)
    step_time: Optional[float]
    bubble: Optional[float]
    alternatives: tuple                # (cut index, moved by, resulting bottleneck, fits)
    rank_temp_bytes: tuple = ()        # per rank: the largest temporaries of its parts
    temps_measured: bool = False       # backward working sets measured (else only accumulation)

    @property
    def rank_total_bytes(self) -> tuple:
        """Per rank: what its allocator should peak at (ledger terms plus temporaries)."""
        return tuple(a + b for a, b in zip(self.rank_peak_bytes, self.rank_temp_bytes or (0,) * len(self.rank_peak_bytes)))
    @property
    def cuts(self) -> tuple:
        """Call index where each part after the first starts."""
        return tuple(p.start for p in self.parts[1:])

    @property
    def bottleneck(self) -> float:
        return max(p.time for p in self.parts)

    def _t(self, x) -> str:
        return f"{x * 1e3:.2f} ms" if self.unit == "s" else f"{x / 1e6:.1f} MFLOP"

    def __str__(self) -> str:
        rows = [f"Plan({self.schedule}, {len(self.parts)} parts, m={self.microbatches} x "
                f"{self.microbatch_size}, cuts before calls {list(self.cuts)})",
                f"{'part':>4} {'rank':>4} {'calls':<34} {'F+B':>12} {'static B':>11} {'pack B':>10} "
                f"{'packs':>5} {'temp B':>10} {'memory B':>11} {'sends B':>9}"]
        for p in self.parts:
            calls = f"{p.start}..{p.stop - 1} {p.first}..{p.last}"
            rows.append(f"{p.index:>4} {p.rank:>4} {calls[:34]:<34} {self._t(p.time):>12} {p.static_bytes:>11} "
                        f"{p.act_bytes:>10} {p.inflight:>5} {p.temp_bytes:>10} {p.memory:>11} {p.message_bytes:>9}")
        rows.append(f"rank peaks (simulated, with temporaries): {list(self.rank_total_bytes)} B"
                    + (f"; budget {self.budget} B" if self.budget is not None else "")
                    + ("" if self.temps_measured else " (backward working sets not measured on this device)"))
        if self.step_time is not None:
            rows.append(f"predicted step {self._t(self.step_time)}, bubble {self.bubble:.2f}")
        return "\n".join(rows)

    def explain(self) -> str:
        """Why these cuts: the slowest part, what binds, and what moving each cut would do."""
        slow = max(self.parts, key=lambda p: p.time)
        lines = [str(self), "",
                 f"Part {slow.index} ({slow.first}..{slow.last}) is the slowest at {self._t(slow.time)}: "
                 f"the step cannot run faster than m x that plus the ramp."]
        if self.budget is not None:
            tight = max(self.parts, key=lambda p: p.memory)
            lines.append(f"Memory binds hardest on part {tight.index}: {tight.memory} of {self.budget} B "
                         f"({tight.inflight} micro-batch packs of {tight.act_bytes} B in flight).")
        for cut, moved, bottleneck, fits in self.alternatives:
            what = "over the memory budget" if not fits else f"slowest part {self._t(bottleneck)}"
            lines.append(f"  moving the cut before call {cut} by {moved:+d}: {what}")
        return "\n".join(lines)


def _scale(costs, start, stop, target):
    """Scale ``costs[start:stop]`` in place to add up to ``target`` (where both are positive)."""
    total = sum(costs[start:stop])
    if target > 0 and total > 0:
        costs[start:stop] = [c * target / total for c in costs[start:stop]]


def _costs(profile):
    """Per call (the loss last): forward and backward cost beyond a part's fixed cost (a noop's
    launch), the fixed cost pair, and the unit.

    Calls run alone cost more than inside one part; their times beyond a noop's are scaled to add
    up to what the model's halves cost beyond one (each half's calls to that half,
    `Profile.halves`), or where those were not measured to the whole model's. A part is then
    costed from the half its calls lie in: one half is predicted at exactly its measured time."""
    calls = list(profile.calls) + [profile.loss]
    if profile.measured:
        of, ob = profile.overhead
        fwd = [max(0.0, c.forward_s - of) for c in calls]
        bwd = [max(0.0, c.backward_s - ob) for c in calls]
        n = len(profile.calls)
        spans = getattr(profile, "halves", ())
        if not spans:
            wf, wb = getattr(profile, "whole", (0.0, 0.0))
            spans = ((0, n, wf, wb),)
        for start, stop, f, b in spans:
            stop = stop + 1 if stop == n else stop   # the last part holds the loss
            _scale(fwd, start, stop, f - of)
            _scale(bwd, start, stop, b - ob)
        return fwd, bwd, (of, ob), "s"
    fwd = [float(c.flops) for c in calls]
    return fwd, [2 * f for f in fwd], (0.0, 0.0), "FLOP"


class _Parts:
    """Costs of any contiguous run of calls ``a .. b - 1`` (the last part includes the loss)."""

    def __init__(self, profile, optimizer_slots: int):
        self.profile = profile
        self.n = len(profile.calls)
        self.fwd, self.bwd, self.overhead, self.unit = _costs(profile)
        self.slots = optimizer_slots
        # A variable used by several parts (tied weights) lives with, and is charged to, the
        # part holding its first user.
        self.first_use = {}
        for c in list(profile.calls) + [profile.loss]:
            for key, _ in c.params:
                self.first_use.setdefault(key, c.index)
        self.pf = [0.0]
        self.pb = [0.0]
        for f, b in zip(self.fwd, self.bwd):
            self.pf.append(self.pf[-1] + f)
            self.pb.append(self.pb[-1] + b)

    def _calls(self, a, b):
        calls = list(self.profile.calls[a:b])
        return calls + [self.profile.loss] if b == self.n else calls

    def time(self, a, b) -> tuple:
        stop = b + 1 if b == self.n else b
        of, ob = self.overhead
        return self.pf[stop] - self.pf[a] + of, self.pb[stop] - self.pb[a] + ob

    def memory(self, a, b) -> tuple:
        """(static bytes, activation bytes per micro-batch, temporaries)."""
        params, state, saved, values, work = {}, 0, 0, set(), 0
        for c in self._calls(a, b):
            params.update((key, size) for key, size in c.params if self.first_use[key] >= a)
            state += c.state_bytes
            saved += c.saved_bytes
            values.update(c.saved_values)
            work = max(work, getattr(c, "temp_bytes", 0))
        weights = sum(params.values())
        static = weights * (2 + self.slots) + state
        return static, saved + sum(self.profile.value_bytes[v] for v in values), work + 2 * weights

    def fits(self, s, a, b, inflight, budget) -> bool:
        static, act, temp = self.memory(a, b)
        return budget is None or static + act * inflight[s] + temp <= budget

    def message(self, b) -> int:
        if b >= self.n:
            return 0
        return sum(self.profile.value_bytes[v] for v in self.profile.boundaries[b])


def _search(parts: _Parts, k: int, inflight: Sequence[int], budget: Optional[int]):
    """Cuts 0 = c0 < c1 < ... < ck = n minimizing (max part time, bytes crossing cuts)."""
    n = parts.n
    if n < k:
        raise NoPlan(f"the model has {n} calls, fewer than the {k} parts the schedule needs")
    fits = {}

    def ok(s, a, b):
        if budget is None:
            return True
        key = (s, a, b)
        if key not in fits:
            fits[key] = parts.fits(s, a, b, inflight, budget)
        return fits[key]

    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    back = [[None] * (n + 1) for _ in range(k + 1)]
    best[0][0] = (0.0, 0)
    for s in range(1, k + 1):
        for b in range(s, n - (k - s) + 1):
            for a in range(s - 1, b):
                prev = best[s - 1][a]
                if prev == inf or not ok(s - 1, a, b):
                    continue
                t = sum(parts.time(a, b))
                cand = (max(prev[0], t), prev[1] + (parts.message(b) if b < n else 0))
                if cand < best[s][b]:
                    best[s][b], back[s][b] = cand, a
    if best[k][n] == inf:
        raise NoPlan(f"no cut of the {n} calls into {k} parts fits {budget} B per part "
                     f"(in-flight packs per part {list(inflight)}); raise the budget, use more "
                     f"stages, smaller micro-batches, or BPipe")
    cuts, b = [n], n
    for s in range(k, 0, -1):
        b = back[s][b]
        cuts.append(b)
    return cuts[::-1]


def plan(profile, schedule: Schedule, *, memory_budget: Optional[int] = None,
         optimizer_slots: int = 2, cuts: Optional[Sequence[int]] = None) -> Plan:
    """Cut ``profile``'s calls into ``schedule.pipe_depth`` parts (or take ``cuts``, the call
    index each part after the first starts at) and predict time and memory."""
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget <= 0):
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    if schedule.num_stages != schedule.pipe_depth:
        raise ValueError(f"schedule {schedule.name!r} runs {schedule.num_stages // schedule.pipe_depth} "
                         f"copies of the model; the planner cuts one (use PipelineTrainer for Chimera)")
    parts = _Parts(profile, optimizer_slots)
    k = schedule.pipe_depth
    inflight = list(simulate(schedule).peak_stage_microbatches.get(s, 0) for s in range(k))
    if cuts is None:
        bounds = _search(parts, k, inflight, memory_budget)
    else:
        cuts = list(cuts)
        bounds = [0] + cuts + [parts.n]
        if len(cuts) != k - 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cuts must be {k - 1} increasing call indices in 1..{parts.n - 1}, got {cuts}")
    names = [c.name for c in profile.calls]
    out = []
    for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
        f, bw = parts.time(a, b)
        static, act, temp = parts.memory(a, b)
        out.append(PartPlan(s, schedule.stage_ranks[s], a, b, names[a], names[b - 1], f, bw,
                            static, act, inflight[s], parts.message(b), temp))
    split = bool(schedule.split)
    costs = Costs(F=[p.forward for p in out], B=[p.backward / 2 if split else p.backward for p in out],
                  W=[p.backward / 2 if split else 0.0 for p in out])
    sim = simulate(schedule, act_bytes=[p.act_bytes for p in out], weight_bytes=[p.static_bytes for p in out],
                   costs=costs)
    alternatives = []
    for i in range(1, len(bounds) - 1):
        for d in (-1, 1):
            moved = list(bounds)
            moved[i] += d
            if not moved[i - 1] < moved[i] < moved[i + 1]:
                continue
            times = [sum(parts.time(a, b)) for a, b in zip(moved, moved[1:])]
            fits = all(parts.fits(s, a, b, inflight, memory_budget) for s, (a, b) in enumerate(zip(moved, moved[1:])))
            alternatives.append((bounds[i], d, max(times), fits))
    peaks = tuple(sim.peak_bytes) if sim.peak_bytes is not None else ()
    temps = tuple(max((p.temp_bytes for p in out if p.rank == r), default=0) for r in range(schedule.p))
    totals = [a + b for a, b in zip(peaks, temps)]
    if memory_budget is not None and totals and max(totals) > memory_budget:
        rank = max(range(len(totals)), key=totals.__getitem__)
        raise NoPlan(f"the best cut per part {bounds[1:-1]} needs {totals[rank]} B on rank {rank} "
                     f"under {schedule.name} (several parts or accepted packs on one rank), over the "
                     f"budget of {memory_budget} B")
    return Plan(schedule.name, schedule.m, profile.microbatch_size, parts.unit, tuple(out), memory_budget,
                peaks, sim.step_time, sim.bubble, tuple(alternatives), temps,
                bool(getattr(profile, "temps_measured", False)))
