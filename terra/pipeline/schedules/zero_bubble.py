"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the backward
is split into B (input gradient: on the critical path, sent upstream at once) and W (weight
gradient: needed only by the optimizer step), and the Ws fill what would be bubbles.

* `zb_h1`: 1F1B's order with each B split off its W; stage ``s`` runs ``p - s`` warm-up forwards
  (1F1B's ``p - s - 1`` plus the first steady one) and defers its first ``s`` Ws, so every rank
  holds at most ``p`` micro-batches (1F1B's peak, on stage 0) and the cool-down, where 1F1B's
  ranks wait for gradients, runs the deferred Ws. With F = B = W its step takes
  ``3m + p - 1`` units: bubble ``(p - 1) / 3m``, a third of 1F1B's.
* `zb_v`: two stages per rank in a V: rank ``r`` runs stage ``r`` on the way down and stage
  ``2p - 1 - r`` on the way up, so the last rank runs the middle two stages and rank 0 both the
  first and the loss. The per-rank order is that of torch.distributed.pipelining's
  ScheduleZBVZeroBubble: warm-up ``2(p - r) - 1`` down forwards, ``r`` down/up forward pairs,
  ``p - r`` up F-B-W triples, then down and up F-B-W in turn, and a cool-down whose deferred
  Ws fill the tail. With F = B = W (per stage) a rank idles only ``p - 1`` units (the time the
  first micro-batch needs to reach the last rank) for ``6m`` units of work once
  ``m >= 2p - 1``; its peak is ``2p`` stage activations, i.e. ``p`` of the undivided model part,
  as 1F1B's stage 0.
* `dualpipe_v`: DeepSeek's DualPipeV ("DualPipe cut in half", the DualPipe schedule of
  DeepSeek-V3 folded onto ``p`` ranks in the same V as ZB-V), as torch.distributed.pipelining's
  ScheduleDualPipeV and DeepSeek's reference ``dualpipev.py`` order it: the steady state pairs a
  forward of one stage with a *whole* backward (B with its W in the same action) of the other
  (in DualPipe those two overlap their computation with each other's communication; here they run
  one after the other), and only the ramp up and the ramp down split backwards into B and W, whose
  Ws then fill the ramp's gaps. So it keeps far fewer deferred Ws than ZB-V (at most ``p - r``
  on rank ``r`` instead of one per stage in the cool-down) at the price of a longer step.
"""
from __future__ import annotations

from terra.pipeline.actions import Action, B, F, W
from terra.pipeline.schedules.base import Schedule, check_positive, from_orders


def zb_h1_order(stage: int, p: int, m: int) -> list[Action]:
    warmup = min(p - stage, m)
    order = [Action(stage, F, i) for i in range(warmup)]
    for j in range(m):
        order.append(Action(stage, B, j))
        if j >= stage:
            order.append(Action(stage, W, j - stage))
        if warmup + j < m:
            order.append(Action(stage, F, warmup + j))
    order += [Action(stage, W, i) for i in range(max(m - stage, 0), m)]
    return order


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 over ``p`` ranks (one stage each) and ``m`` micro-batches (any m >= 1)."""
    check_positive(p=p, m=m)
    orders = [zb_h1_order(s, p, m) for s in range(p)]
    return from_orders("zb-h1", p, m, orders, stage_ranks=range(p), pipe_depth=p)


def zb_v_order(rank: int, p: int, m: int) -> list[Action]:
    """Rank's ZB-V order. It is generated for ``max(m, 2p - 1)`` micro-batches (the steady
    state needs that many in flight) and the extra ones are dropped."""
    n = max(m, 2 * p - 1)
    down, up = rank, 2 * p - 1 - rank
    count = {(s, k): 0 for s in (down, up) for k in (F, B, W)}
    deferred = {down: [], up: []}          # Bs whose W comes later, oldest first
    order: list[Action] = []

    def run(*actions, defer=False):
        """Append (stage, kind) actions; a W takes the oldest deferred B of its stage, if any."""
        for stage, kind in actions:
            mb = deferred[stage].pop(0) if kind is W and deferred[stage] else count[stage, kind]
            order.append(Action(stage, kind, mb))
            count[stage, kind] += 1
            if kind is B and defer:
                deferred[stage].append(mb)

    run(*[(down, F)] * (2 * (p - rank) - 1))
    run(*[(up, F), (down, F)] * rank)
    run(*[(up, F), (up, B), (up, W)] * (p - rank))
    while count[up, F] < count[down, F] or count[down, F] < n:
        if count[down, F] < n:
            run((down, F))
        run((down, B), (down, W), (up, F), (up, B), (up, W))
    run(*[(down, B), (up, B)] * rank, defer=True)
    for _ in range(p - rank):
        run((down, B), defer=True)
        run((down, W))
    run(*[(up, W)] * len(deferred[up]))
    run(*[(down, W)] * len(deferred[down]))
    return [a for a in order if a.microbatch < m]


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V over ``p`` ranks (stages ``r`` and ``2p - 1 - r`` on rank ``r``: ``2p`` model parts)
    and ``m`` micro-batches (any m >= 1; the bubble is the ramp alone from ``m = 2p - 1`` on)."""
    check_positive(p=p, m=m)
    orders = [zb_v_order(r, p, m) for r in range(p)]
    stage_ranks = list(range(p)) + list(reversed(range(p)))
    return from_orders("zb-v", p, m, orders, stage_ranks=stage_ranks, pipe_depth=2 * p, v=2)


def dualpipe_v_order(rank: int, p: int, m: int) -> list[Action]:
    """Rank's DualPipeV order: the eight steps of the reference implementation. It is generated
    for ``max(m, 2p)`` micro-batches (the reference requires that many) and the extra ones are
    dropped. A B marked zero-bubble gets a W later (one queue of deferred Ws per rank, oldest
    first, as the reference's WeightGradStore); any other B is a whole backward."""
    n = max(m, 2 * p)
    down, up = rank, 2 * p - 1 - rank
    count = {(s, k): 0 for s in (down, up) for k in (F, B)}
    deferred: list[tuple[int, int]] = []
    order: list[Action] = []

    def f(stage):
        order.append(Action(stage, F, count[stage, F]))
        count[stage, F] += 1

    def b(stage, split=False):
        mb = count[stage, B]
        order.append(Action(stage, B, mb))
        count[stage, B] += 1
        if split:
            deferred.append((stage, mb))

    def w():
        stage, mb = deferred.pop(0)
        order.append(Action(stage, W, mb))

    for _ in range(2 * (p - rank - 1)):      # 1: down forwards
        f(down)
    for _ in range(rank + 1):                # 2: down/up forward pairs
        f(down)
        f(up)
    for _ in range(p - rank - 1):            # 3: up B (split), a W, an up F
        b(up, split=True)
        w()
        f(up)
    for _ in range(n - 2 * p + rank + 1):    # 4: F down + B up, F up + B down
        f(down)
        b(up)
        f(up)
        b(down)
    for _ in range(p - rank - 1):            # 5: B up, then F up + B down
        b(up)
        f(up)
        b(down)
    split = False                            # 6: B up, B down; the second half split
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        b(up, split)
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        b(down, split)
    for _ in range(p - rank - 1):            # 7: a W, a down B (split)
        w()
        b(down, split=True)
    while deferred:                          # 8: the remaining Ws
        w()
    return [a for a in order if a.microbatch < m]


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV over ``p`` ranks (stages ``r`` and ``2p - 1 - r`` on rank ``r``, as ZB-V: ``2p``
    model parts) and ``m`` micro-batches (any m >= 1; the reference schedule wants ``m >= 2p``,
    below that the orders are cut from the ``2p`` one)."""
    check_positive(p=p, m=m)
    orders = [dualpipe_v_order(r, p, m) for r in range(p)]
    stage_ranks = list(range(p)) + list(reversed(range(p)))
    return from_orders("dualpipe-v", p, m, orders, stage_ranks=stage_ranks, pipe_depth=2 * p,
                       v=2)
