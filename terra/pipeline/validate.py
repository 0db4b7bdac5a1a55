"""Schedule validation: placement, coverage, dependencies, transfers and deadlock freedom.

`problems(schedule)` returns every violation as a `Problem` (rank, step, lane, action, message);
`validate(schedule)` raises `ScheduleError` when there is any, whose message lists them and prints
the rank x step grid with each offending action marked ``!`` (e.g. ``[2B3]!`` appears as
``2B3!``). Checks, in order:

* placement: F/B/W only in the compute lane, transfers only in the transfer lane, every action on
  the rank that runs its stage, stage and micro-batch ids in range;
* coverage: each (stage, F/B/W, micro-batch) at most once, and each micro-batch runs F and B on
  every stage of exactly one pipeline (Chimera: of one of its two pipelines); a W is optional
  (without it the B is the whole backward);
* dependencies (unit-time steps): F of stage s needs F of stage s-1 in an earlier step; B of
  stage s needs F of stage s and B of stage s+1 in earlier steps; W needs the B of its stage;
* EVICT/LOAD: an eviction happens after the forward step and is matched by a LOAD before the
  backward step; a LOAD follows an EVICT of the same activations; peers are other ranks (a
  split backward's W reads the same activations as its B, so they stay put from B to W);
* SEND/RECV (when the schedule has any): every cross-rank dependency has a SEND on the producer
  at or after the producing step and a matching RECV on the consumer after the SEND and at or
  before the consuming step, and every SEND/RECV is matched;
* deadlock: replaying each rank's compute order without the time grid (each rank blocks on its
  next action until its inputs exist) must finish; a cycle is reported with the waiting actions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from terra.pipeline.actions import (Action, B, COMPUTE_KINDS, EVICT, F, LOAD, RECV, SEND,
                                    TRANSFER_KINDS)
from terra.pipeline.schedules.base import Schedule, action_deps, format_grid


@dataclass(frozen=True, slots=True)
class Problem:
    """One violation, located at ``(rank, step)`` of ``lane`` ("compute" or "transfers")."""
    rank: Optional[int]
    step: Optional[int]
    action: Optional[Action]
    message: str
    lane: str = "compute"

    def __str__(self) -> str:
        where = "" if self.rank is None else f"rank {self.rank} step {self.step}: "
        what = "" if self.action is None else f"[{self.action}] "
        return f"{where}{what}{self.message}"


class ScheduleError(ValueError):
    """A schedule failed validation; `.problems` lists why, the message shows where."""

    def __init__(self, schedule: Schedule, problems: list[Problem]):
        self.schedule = schedule
        self.problems = problems
        marks = {}
        for pr in problems:
            if pr.rank is not None and pr.step is not None:
                key = (pr.rank, pr.step) if pr.lane == "compute" else (pr.rank, pr.step, "transfers")
                marks[key] = "!"
        shown = problems[:20]
        lines = [f"{schedule!r} is invalid ({len(problems)} problem(s)):"]
        lines += [f"  - {pr}" for pr in shown]
        if len(problems) > len(shown):
            lines.append(f"  ... and {len(problems) - len(shown)} more")
        lines.append(format_grid(schedule, marks=marks))
        super().__init__("\n".join(lines))


def validate(schedule: Schedule) -> Schedule:
    """Raise `ScheduleError` if `schedule` has any problem; return it unchanged otherwise."""
    found = problems(schedule)
    if found:
        raise ScheduleError(schedule, found)
    return schedule


def problems(schedule: Schedule) -> list[Problem]:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"expected a Schedule, got {type(schedule).__name__}")
    out: list[Problem] = []
    steps = _placement(schedule, out)
    _coverage(schedule, steps, out)
    _dependencies(schedule, steps, out)
    _evict_load(schedule, steps, out)
    _send_recv(schedule, steps, out)
    if not any(pr.rank is None or "never runs" in pr.message for pr in out):
        _deadlock(schedule, out)  # (missing actions would only show up as spurious waits)
    return out


# ------------------------------------------------------------------------------------ checks
def _placement(schedule: Schedule, out: list[Problem]) -> dict[Action, tuple[int, int]]:
    """Check lanes, ranks and id ranges; return {compute action: (rank, step)} (first occurrence)."""
    steps: dict[Action, tuple[int, int]] = {}
    for r in range(schedule.p):
        for t in range(schedule.steps):
            a = schedule.compute[r][t]
            if a is not None:
                if a.kind not in COMPUTE_KINDS:
                    out.append(Problem(r, t, a, f"{a.kind.name} belongs in the transfer lane"))
                elif _ids_ok(schedule, r, t, a, "compute", out):
                    if a in steps:
                        out.append(Problem(r, t, a, f"runs twice (also at rank {steps[a][0]} "
                                                    f"step {steps[a][1]})"))
                    else:
                        steps[a] = (r, t)
            for x in schedule.transfers[r][t]:
                if x.kind not in TRANSFER_KINDS:
                    out.append(Problem(r, t, x, f"{x.kind.name} belongs in the compute lane",
                                       "transfers"))
                else:
                    _ids_ok(schedule, r, t, x, "transfers", out)
    return steps


def _ids_ok(schedule, r, t, a, lane, out) -> bool:
    if a.stage >= schedule.num_stages:
        out.append(Problem(r, t, a, f"stage {a.stage} does not exist "
                                    f"(schedule has {schedule.num_stages} stages)", lane))
        return False
    if a.microbatch >= schedule.m:
        out.append(Problem(r, t, a, f"micro-batch {a.microbatch} out of range (m={schedule.m})", lane))
        return False
    if schedule.rank_of(a.stage) != r:
        out.append(Problem(r, t, a, f"stage {a.stage} runs on rank {schedule.rank_of(a.stage)}, "
                                    f"not rank {r}", lane))
        return False
    return True


def _coverage(schedule: Schedule, steps, out) -> None:
    depth, pipes = schedule.pipe_depth, schedule.num_stages // schedule.pipe_depth
    for mb in range(schedule.m):
        full, touched = [], []
        for pipe in range(pipes):
            stages = range(pipe * depth, (pipe + 1) * depth)
            have = [Action(s, k, mb) in steps for s in stages for k in (F, B)]
            if all(have):
                full.append(pipe)
            elif any(have):
                touched.append(pipe)
        if len(full) == 1 and not touched:
            continue
        if len(full) > 1:
            out.append(Problem(None, None, None, f"micro-batch {mb} runs through {len(full)} "
                                                 f"pipelines {full}; it must run through one"))
        for pipe in touched:
            stages = range(pipe * depth, (pipe + 1) * depth)
            missing = [str(Action(s, k, mb)) for s in stages for k in (F, B)
                       if Action(s, k, mb) not in steps]
            out.append(Problem(None, None, None, f"micro-batch {mb} is missing {missing}"))
        if not full and not touched:
            out.append(Problem(None, None, None, f"micro-batch {mb} never runs"))


def _dependencies(schedule: Schedule, steps, out) -> None:
    for a, (r, t) in steps.items():
        for d in action_deps(a, schedule.next_stage, schedule.prev_stage):
            if d not in steps:
                out.append(Problem(r, t, a, f"depends on {d}, which never runs"))
            elif steps[d][1] >= t:
                out.append(Problem(r, t, a, f"depends on {d} at step {steps[d][1]} "
                                            f"(must finish in an earlier step)"))


def _evict_load(schedule: Schedule, steps, out) -> None:
    for r in range(schedule.p):
        away: dict[tuple[int, int], int] = {}  # (stage, mb) -> eviction step
        for t in range(schedule.steps):
            for x in schedule.transfers[r][t]:
                if x.kind not in (EVICT, LOAD):
                    continue
                key = (x.stage, x.microbatch)
                f_at = steps.get(Action(x.stage, F, x.microbatch), (None, None))[1]
                b_at = steps.get(Action(x.stage, B, x.microbatch), (None, None))[1]
                if x.peer is not None and (x.peer == r or x.peer >= schedule.p):
                    out.append(Problem(r, t, x, f"peer rank {x.peer} must be another rank "
                                                f"in 0..{schedule.p - 1}", "transfers"))
                if x.kind is EVICT:
                    if key in away:
                        out.append(Problem(r, t, x, f"already evicted at step {away[key]}", "transfers"))
                    if f_at is None or f_at >= t:
                        out.append(Problem(r, t, x, "evicts activations before their forward "
                                                    f"finished (forward at step {f_at})", "transfers"))
                    if b_at is not None and b_at <= t:
                        out.append(Problem(r, t, x, f"evicts activations after their backward "
                                                    f"(step {b_at})", "transfers"))
                    away[key] = t
                else:
                    if key not in away:
                        out.append(Problem(r, t, x, "loads activations that were not evicted",
                                           "transfers"))
                    if b_at is not None and b_at <= t:
                        out.append(Problem(r, t, x, f"loads after the backward that needs it "
                                                    f"(step {b_at})", "transfers"))
                    away.pop(key, None)
        for (stage, mb), t in away.items():
            b_at = steps.get(Action(stage, B, mb), (None, None))[1]
            bad = Action(stage, B, mb)
            out.append(Problem(r, b_at if b_at is not None else t, bad if b_at is not None else None,
                               f"activations of stage {stage} micro-batch {mb} evicted at step {t} "
                               f"are never loaded back"))


def _send_recv(schedule: Schedule, steps, out) -> None:
    sends: dict[tuple[int, int, int], tuple[int, int, Action]] = {}
    recvs: dict[tuple[int, int, int], tuple[int, int, Action]] = {}
    for r in range(schedule.p):
        for t in range(schedule.steps):
            for x in schedule.transfers[r][t]:
                if x.kind not in (SEND, RECV):
                    continue
                if x.peer is None or x.peer not in (schedule.next_stage(x.stage),
                                                    schedule.prev_stage(x.stage)):
                    out.append(Problem(r, t, x, f"peer must be a neighbouring stage of {x.stage}, "
                                                f"got {x.peer}", "transfers"))
                    continue
                # Key by (producer stage, consumer stage, mb).
                key = (x.stage, x.peer, x.microbatch) if x.kind is SEND else (x.peer, x.stage, x.microbatch)
                table = sends if x.kind is SEND else recvs
                if key in table:
                    out.append(Problem(r, t, x, "duplicate transfer", "transfers"))
                table[key] = (r, t, x)
    if not sends and not recvs:
        return
    for a, (r, t) in steps.items():  # every cross-rank edge needs a SEND/RECV pair
        for d in action_deps(a, schedule.next_stage, schedule.prev_stage):
            if d.stage == a.stage or schedule.rank_of(d.stage) == r:
                continue
            key = (d.stage, a.stage, a.microbatch)
            d_step = steps.get(d, (None, None))[1]
            if key not in sends:
                out.append(Problem(r, t, a, f"input from stage {d.stage} is never sent"))
            elif d_step is not None and sends[key][1] < d_step:
                out.append(Problem(sends[key][0], sends[key][1], sends[key][2],
                                   f"sent before {d} produced it (step {d_step})", "transfers"))
            if key not in recvs:
                out.append(Problem(r, t, a, f"input from stage {d.stage} is never received"))
            else:
                rr, rt, rx = recvs[key]
                if rt > t:
                    out.append(Problem(rr, rt, rx, f"received after {a} needed it (step {t})",
                                       "transfers"))
                if key in sends and rt <= sends[key][1]:
                    out.append(Problem(rr, rt, rx, f"received in or before the step it is sent "
                                                   f"({sends[key][1]})", "transfers"))
    for key in sends.keys() - recvs.keys():
        r, t, x = sends[key]
        out.append(Problem(r, t, x, "has no matching RECV", "transfers"))
    for key in recvs.keys() - sends.keys():
        r, t, x = recvs[key]
        out.append(Problem(r, t, x, "has no matching SEND", "transfers"))


def _deadlock(schedule: Schedule, out) -> None:
    """Replay per-rank compute orders with blocking waits and no global clock."""
    orders = [schedule.compute_order(r) for r in range(schedule.p)]
    done: set[Action] = set()
    pos = [0] * schedule.p
    progress = True
    while progress:
        progress = False
        for r in range(schedule.p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                if not all(d in done for d in action_deps(a, schedule.next_stage, schedule.prev_stage)):
                    break
                done.add(a)
                pos[r] += 1
                progress = True
    for r in range(schedule.p):
        if pos[r] < len(orders[r]):
            a = orders[r][pos[r]]
            missing = [str(d) for d in action_deps(a, schedule.next_stage, schedule.prev_stage)
                       if d not in done]
            out.append(Problem(r, schedule.compute[r].index(a), a,
                               f"deadlock: rank {r} blocks here waiting for {', '.join(missing)}"))
