"""GPipe: every rank runs all forwards, then all backwards (peak memory m micro-batches)."""
from __future__ import annotations

from terra.pipeline.actions import Action, B, F
from terra.pipeline.schedules.base import Schedule, check_positive, from_orders


def gpipe(p: int, m: int) -> Schedule:
    """GPipe over ``p`` ranks (one stage each) and ``m`` micro-batches.

    Backwards run in micro-batch order, so ``gpipe(p, m)`` is exactly ``kfkb(p, m, k=m)``."""
    check_positive(p=p, m=m)
    orders = [[Action(s, F, i) for i in range(m)] + [Action(s, B, i) for i in range(m)]
              for s in range(p)]
    return from_orders("gpipe", p, m, orders, stage_ranks=range(p), pipe_depth=p)
