"""Passes over schedules (pure functions: Schedule in, new Schedule out).

* `add_evict_load`: BPipe activation balancing. Rank ``r < (p-1)/2`` (evictor) moves saved
  activations to rank ``p-1-r`` (acceptor) so that no rank holds more than ``mu_opt``
  micro-batches. On a plain 1F1B schedule it runs BPipe's Algorithm 2 with
  ``mu_opt = ceil((p+2)/2)``; on anything else (interleaved, kFkB, Chimera, hand-made) it runs
  the general form: Belady's rule (when the evictor would exceed ``mu_opt`` at step ``t``, evict
  at step ``t-1`` the saved micro-batch whose backward is furthest in the future; load it in the
  step before that backward; a split backward's W runs on the loaded activations, which stay
  until it), with ``mu_opt = max over pairs ceil((mu(e) + mu(a) + 1) / 2)``,
  which is ``p v + 1`` for interleaved 1F1B (BPipe appendix A) and ``ceil((p+2)/2)`` for 1F1B.
* `add_send_recv`: a SEND/RECV pair for every dependency between stages on different ranks
  (activations forward, input gradients backward).

Transfers go to the rank's transfer lane (see `terra.pipeline.schedules.base`): an EVICT in step
``t`` is counted on the evictor through ``t`` and on the acceptor from ``t``; a LOAD in step
``t`` is counted on the evictor from ``t`` and on the acceptor through ``t``. The acceptor's side
is implied by the ``peer`` field (it gets no action of its own). A SEND in step ``t`` is posted
when that step's compute finishes; a RECV in step ``t`` completes before that step's compute.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from terra.pipeline.actions import Action, B, EVICT, F, LOAD, RECV, SEND, W
from terra.pipeline.schedules.base import Schedule, action_deps
from terra.pipeline.schedules.one_f_one_b import one_f_one_b_order

_TRANSFER_ORDER = {RECV: 0, LOAD: 1, EVICT: 2, SEND: 3}


# ------------------------------------------------------------------------------------ pairing
def pairs(p: int) -> list[tuple[int, int]]:
    """(evictor, acceptor) rank pairs: ``(r, p-1-r)`` for ``r < (p-1)/2``; for odd ``p`` the
    middle rank has no partner."""
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int, got {p!r}")
    return [(r, p - 1 - r) for r in range(p // 2)]


def items(schedule: Schedule, rank: int) -> dict[tuple[int, int], tuple[int, int, int]]:
    """{(stage, micro-batch): (forward step, backward step, last step)} for the activations
    ``rank`` saves. The last step is the W's where the backward is split (W reads what B read),
    the B's otherwise; the activations must be resident from the B on."""
    at = {F: {}, B: {}, W: {}}
    for t, a in enumerate(schedule.compute[rank]):
        if a is not None:
            at[a.kind][(a.stage, a.microbatch)] = t
    return {key: (f, at[B][key], at[W].get(key, at[B][key]))
            for key, f in at[F].items() if key in at[B]}


def live_counts(schedule: Schedule, rank: int) -> list[int]:
    """Micro-batches ``rank`` holds at each step with no transfers: forward step .. last step."""
    counts = [0] * schedule.steps
    for f, _, end in items(schedule, rank).values():
        for t in range(f, end + 1):
            counts[t] += 1
    return counts


def mu_opt(schedule: Schedule) -> int:
    """BPipe's balanced target: ``max over pairs ceil((mu(e) + mu(a) + 1) / 2)``, where mu is a
    rank's peak without transfers (and the bare peak of an unpaired middle rank)."""
    peaks = [max(live_counts(schedule, r), default=0) for r in range(schedule.p)]
    target = max([math.ceil((peaks[e] + peaks[a] + 1) / 2) for e, a in pairs(schedule.p)], default=0)
    if schedule.p % 2:
        target = max(target, peaks[schedule.p // 2])
    return max(target, 1)


def is_plain_1f1b(schedule: Schedule) -> bool:
    """True for the grid `one_f_one_b(p, m)` builds (Algorithm 2's input)."""
    if schedule.pipe_depth != schedule.p or schedule.num_stages != schedule.p:
        return False
    return all(schedule.compute_order(s) == one_f_one_b_order(s, schedule.p, schedule.m)
               for s in range(schedule.p))


# ------------------------------------------------------------------------------- Algorithm 2
def algorithm2(compute: list[Optional[Action]], p: int, s: int, m: int) -> dict[int, list[tuple]]:
    """BPipe's transfer scheduling (Algorithm 2) for evictor stage ``s`` of a 1F1B schedule.

    ``compute`` is the stage's computation schedule C (its compute lane, bubbles as None).
    Returns {step: [("evict" | "load", micro-batch)]}. One reading differs from the printed
    pseudo-code: line 22 evicts ``C_{i-3}.idx``, which is a bubble at the warm-up/steady
    boundary (for Figure 4.2, i = 9 gives C_6, a bubble, while the text says micro-batch 3 is
    evicted); we take the most recent forward before step ``i-2``, which is ``C_{i-3}`` whenever
    that is a forward and micro-batch 3 in the figure's case."""
    mu = math.ceil((p + 2) / 2)
    n_evict = min(p - s, m) - mu
    evicted: set[int] = set()
    plan: dict[int, list[tuple]] = {}
    if n_evict <= 0:
        return plan
    for i, c in enumerate(compute):
        if c is None:
            continue
        if c.kind is F:
            if mu - 1 <= c.microbatch < mu - 1 + n_evict:           # warm-up phase
                plan.setdefault(i, []).append(("evict", compute[i - 1].microbatch))
                evicted.add(compute[i - 1].microbatch)
        elif c.microbatch in evicted:                                # steady or cooldown phase
            plan.setdefault(i - 1, []).append(("load", c.microbatch))
            evicted.discard(c.microbatch)
            before = compute[i - 1]
            if before is not None and before.kind is F:              # steady phase
                victim = next(a.microbatch for a in reversed(compute[:i - 2])
                              if a is not None and a.kind is F)
                plan.setdefault(i - 2, []).append(("evict", victim))
                evicted.add(victim)
    return plan


# ------------------------------------------------------------------------------------- Belady
class Infeasible(ValueError):
    """No eviction plan keeps a pair within the capacity."""


def belady(schedule: Schedule, rank: int, capacity: int,
           acceptor: Optional[int] = None) -> dict[int, list[tuple]]:
    """General eviction plan for ``rank``: {step: [("evict" | "load", (stage, micro-batch))]}.

    Walk the steps; when the rank would hold more than ``capacity`` micro-batches at step ``t``,
    evict at ``t-1`` the saved one whose backward is furthest away (ties: the latest forward) and
    load it in the step before its backward. Candidates must have been saved before ``t-1`` and
    be needed after ``t+1`` (otherwise evicting them frees nothing at ``t``). With ``acceptor``
    given, a candidate is skipped if holding it would push the acceptor (its own activations
    plus those accepted so far) over ``capacity`` at some step of the transfer; this only matters
    for schedules whose pairs are less complementary than 1F1B's (e.g. kFkB with odd k)."""
    spans = items(schedule, rank)
    accepting = live_counts(schedule, acceptor) if acceptor is not None else None
    starts: dict[int, list] = {}
    for key, (f, _, _) in spans.items():
        starts.setdefault(f, []).append(key)
    returns: dict[int, list] = {}            # load step -> keys coming back
    held: set = set()
    evicted: set = set()
    plan: dict[int, list[tuple]] = {}
    for t in range(schedule.steps):
        held.update(starts.get(t, ()))
        held.update(returns.get(t, ()))
        held.difference_update([k for k in held if spans[k][2] < t])
        excess = len(held) - capacity
        while excess > 0:
            candidates = [k for k in held if k not in evicted
                          and spans[k][0] <= t - 2 and spans[k][1] >= t + 2]
            if accepting is not None:
                candidates = [k for k in candidates
                              if max(accepting[t - 1:spans[k][1]]) < capacity]
            if not candidates:
                raise Infeasible(f"{schedule.name}: rank {rank} cannot stay within {capacity} "
                                 f"micro-batches at step {t} (holds {len(held)}: {sorted(held)}); "
                                 f"no saved micro-batch can be away at that step"
                                 + ("" if acceptor is None else f" without rank {acceptor} "
                                                                f"exceeding {capacity}"))
            victim = max(candidates, key=lambda k: (spans[k][1], spans[k][0]))
            evict_at, load_at = t - 1, spans[victim][1] - 1
            evicted.add(victim)
            held.discard(victim)
            returns.setdefault(load_at, []).append(victim)
            plan.setdefault(evict_at, []).append(("evict", victim))
            plan.setdefault(load_at, []).append(("load", victim))
            if accepting is not None:
                for u in range(evict_at, load_at + 1):
                    accepting[u] += 1
            excess -= 1
    return plan


# ----------------------------------------------------------------------------------- the pass
def add_evict_load(schedule: Schedule, capacity: Optional[int] = None,
                   method: str = "auto") -> Schedule:
    """BPipe activation balancing (see the module docstring); the result's name records the
    capacity used, e.g. ``bpipe(mu=3, 1f1b)``.

    ``capacity`` overrides ``mu_opt`` (raises `Infeasible` if it cannot be met). Without it the
    target is ``mu_opt`` (``ceil((p+2)/2)`` on plain 1F1B), raised one by one only where no plan
    meets it: kFkB loads a whole group of ``k`` micro-batches back before its backwards, so the
    one-micro-batch buffer in ``mu_opt`` is not always enough there (e.g. p=6, m=24, k=3 needs
    12, not 11). ``method``: ``"auto"`` (Algorithm 2 on plain 1F1B at ``ceil((p+2)/2)``, Belady
    otherwise), ``"algorithm2"`` or ``"belady"``."""
    if any(x.kind in (EVICT, LOAD) for row in schedule.transfers for cell in row for x in cell):
        raise ValueError(f"{schedule!r} already has EVICT/LOAD actions")
    if method not in ("auto", "algorithm2", "belady"):
        raise ValueError(f"method must be 'auto', 'algorithm2' or 'belady', got {method!r}")
    plain = is_plain_1f1b(schedule)
    paper_mu = math.ceil((schedule.p + 2) / 2)
    if method == "algorithm2" and (not plain or capacity not in (None, paper_mu)):
        raise ValueError("Algorithm 2 applies to a plain 1F1B schedule with mu_opt = "
                         "ceil((p+2)/2) only; use method='belady'")
    if capacity is not None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        targets = [capacity]
    else:
        start = paper_mu if plain else mu_opt(schedule)
        top = max(max(live_counts(schedule, r), default=0) for r in range(schedule.p))
        targets = list(range(start, max(start, top) + 1))
    for target in targets:
        use_alg2 = method == "algorithm2" or (method == "auto" and plain and target == paper_mu)
        try:
            transfers = _evict_load_plan(schedule, target, use_alg2)
        except Infeasible:
            if target == targets[-1]:
                raise
            continue
        return replace(schedule, name=f"bpipe(mu={target}, {schedule.name})",
                       transfers=_sorted(transfers))
    raise AssertionError("unreachable")


def _evict_load_plan(schedule: Schedule, capacity: int, use_alg2: bool) -> list:
    transfers = [list(map(list, row)) for row in schedule.transfers]
    for evictor, acceptor in pairs(schedule.p):
        if use_alg2:
            plan = {t: [(kind, (evictor, mb)) for kind, mb in todo] for t, todo in
                    algorithm2(list(schedule.compute[evictor]), schedule.p, evictor, schedule.m).items()}
        else:
            plan = belady(schedule, evictor, capacity, acceptor)
        for t, todo in plan.items():
            for kind, (stage, mb) in todo:
                transfers[evictor][t].append(
                    Action(stage, EVICT if kind == "evict" else LOAD, mb, peer=acceptor))
    return transfers


def add_send_recv(schedule: Schedule) -> Schedule:
    """Add SEND (on the producer, in the producing step) and RECV (on the consumer, in the
    consuming step) for every dependency between stages on different ranks."""
    if any(x.kind in (SEND, RECV) for row in schedule.transfers for cell in row for x in cell):
        raise ValueError(f"{schedule!r} already has SEND/RECV actions")
    where = {a: (r, t) for r, t, a in schedule.actions() if a.is_compute}
    transfers = [list(map(list, row)) for row in schedule.transfers]
    for a, (r, t) in where.items():
        for d in action_deps(a, schedule.next_stage, schedule.prev_stage):
            if d.stage == a.stage or d not in where:
                continue
            dr, dt = where[d]
            if dr == r:
                continue
            transfers[dr][dt].append(Action(d.stage, SEND, a.microbatch, peer=a.stage))
            transfers[r][t].append(Action(a.stage, RECV, a.microbatch, peer=d.stage))
    return replace(schedule, transfers=_sorted(transfers))


def _sorted(transfers) -> tuple:
    return tuple(tuple(tuple(sorted(cell, key=lambda x: (_TRANSFER_ORDER[x.kind], x.stage,
                                                          x.microbatch))) for cell in row)
                 for row in transfers)
