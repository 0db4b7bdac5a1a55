"""kFkB (Ada-Grouper): 1F1B over groups of ``k`` consecutive micro-batches.

Ada-Grouper builds kFkB by merging ``k`` copies of the 1F1B plan: stage ``s`` warms up with
``p - s - 1`` groups of forwards, then alternates ``k`` forwards and ``k`` backwards (early
backward between groups), then drains. ``k = 1`` is 1F1B and ``k = m`` is GPipe, exactly (same
grid). Stage ``s`` holds at most ``k * min(p - s, m / k)`` micro-batches: larger ``k`` overlaps
more communication with compute at the cost of memory.

``m`` must be a multiple of ``k`` (groups are indivisible schedule units in Ada-Grouper; a ragged
last group would make it a different plan), otherwise ValueError.
"""
from __future__ import annotations

from terra.pipeline.actions import Action
from terra.pipeline.schedules.base import Schedule, check_positive, from_orders
from terra.pipeline.schedules.one_f_one_b import one_f_one_b_order


def kfkb_order(stage: int, p: int, m: int, k: int) -> list[Action]:
    """Stage's kFkB order: its 1F1B order over ``m / k`` groups, each group expanded into its
    ``k`` micro-batches."""
    return [Action(a.stage, a.kind, a.microbatch * k + j)
            for a in one_f_one_b_order(stage, p, m // k) for j in range(k)]


def kfkb(p: int, m: int, k: int) -> Schedule:
    check_positive(p=p, m=m, k=k)
    if m % k:
        raise ValueError(f"kfkb needs m to be a multiple of k (groups of k micro-batches are "
                         f"indivisible), got m={m}, k={k}; divisors of m: "
                         f"{[d for d in range(1, m + 1) if m % d == 0]}")
    orders = [kfkb_order(s, p, m, k) for s in range(p)]
    return from_orders(f"kfkb(k={k})", p, m, orders, stage_ranks=range(p), pipe_depth=p)
