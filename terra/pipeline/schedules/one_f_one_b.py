"""1F1B (PipeDream-flush / Megatron non-interleaved): warm up with ``p - s - 1`` forwards, then
alternate one forward and one backward, then drain the backwards. Stage ``s`` holds at most
``min(p - s, m)`` micro-batches of activations: the imbalance BPipe removes."""
from __future__ import annotations

from terra.pipeline.actions import Action, B, F
from terra.pipeline.schedules.base import Schedule, check_positive, from_orders


def one_f_one_b_order(stage: int, p: int, m: int) -> list[Action]:
    """Execution order of ``stage`` in 1F1B (the computation schedule C of BPipe's Algorithm 2)."""
    warmup = min(p - stage - 1, m)
    order = [Action(stage, F, i) for i in range(warmup)]
    for j in range(m - warmup):
        order += [Action(stage, F, warmup + j), Action(stage, B, j)]
    order += [Action(stage, B, i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B over ``p`` ranks (one stage each) and ``m`` micro-batches (any m >= 1)."""
    check_positive(p=p, m=m)
    orders = [one_f_one_b_order(s, p, m) for s in range(p)]
    return from_orders("1f1b", p, m, orders, stage_ranks=range(p), pipe_depth=p)
