"""Chimera (Li & Hoefler, SC'21): two pipelines running in opposite directions over the same ranks.

Stage ids: the *down* pipeline is stages ``0 .. p-1`` (stage ``i`` on rank ``i``), the *up*
pipeline is stages ``p .. 2p-1`` (stage ``p + i`` is the up pipeline's stage ``i``, on rank
``p - 1 - i``), so ``Schedule.pipe_depth == p``. Every rank holds two model replicas' stages
(weights twice); their gradients are all-reduced between replicas after the flush.

Basic unit (``p`` micro-batches, ``p`` even): micro-batches ``0 .. p/2-1`` go down, ``p/2 .. p-1``
go up. Each pipeline follows its own 1F1B order over its ``p/2`` micro-batches; a rank merges its
two stages' orders step by step, running whichever head is ready, backward first, else the
pipeline it did not serve last (this reproduces the per-device orders of the Chimera paper's
4-stage figure). For ``m > p`` the basic units are concatenated directly (unit ``u`` owns
micro-batches ``u p .. u p + p - 1``; the paper's "direct concatenation", intermediate bubbles
included); ``m`` must be a multiple of ``p``.
"""
from __future__ import annotations

from terra.pipeline.actions import Action, B
from terra.pipeline.schedules.base import Schedule, check_positive, action_deps, from_orders
from terra.pipeline.schedules.one_f_one_b import one_f_one_b_order


def _shift(order, stage_offset: int, mb_offset: int) -> list[Action]:
    return [Action(a.stage + stage_offset, a.kind, a.microbatch + mb_offset) for a in order]


def chimera_unit_orders(p: int) -> list[list[Action]]:
    """Per-rank orders of one basic unit (micro-batches ``0 .. p-1``)."""
    half = p // 2
    queues = [[one_f_one_b_order(r, p, half),                          # down pipeline, stage r
               _shift(one_f_one_b_order(p - 1 - r, p, half), p, half)]  # up pipeline, stage p-1-r
              for r in range(p)]
    nxt = lambda s: None if (s + 1) % p == 0 else s + 1
    prev = lambda s: None if s % p == 0 else s - 1
    done: dict[Action, int] = {}
    orders: list[list[Action]] = [[] for _ in range(p)]
    last_pipe = [1] * p  # so that a tie at the start goes to the down pipeline
    t = 0
    while any(q for qs in queues for q in qs):
        started = []
        for r in range(p):
            ready = [i for i, q in enumerate(queues[r])
                     if q and all(done.get(d, t) < t for d in action_deps(q[0], nxt, prev))]
            if not ready:
                continue
            ready.sort(key=lambda i: (queues[r][i][0].kind is not B, i == last_pipe[r]))
            pipe = ready[0]
            action = queues[r][pipe].pop(0)
            orders[r].append(action)
            last_pipe[r] = pipe
            started.append(action)
        if not started:  # cannot happen for two 1F1B pipelines; guard against an endless loop
            raise RuntimeError(f"chimera basic unit for p={p} deadlocked at step {t}")
        for a in started:
            done[a] = t
        t += 1
    return orders


def chimera(p: int, m: int) -> Schedule:
    check_positive(p=p, m=m)
    if p % 2:
        raise ValueError(f"chimera needs an even number of ranks p (two pipelines of p stages "
                         f"in opposite directions pair rank i with p-1-i), got p={p}")
    if m % p:
        raise ValueError(f"chimera needs m to be a multiple of p (basic units of p micro-batches "
                         f"are concatenated), got m={m}, p={p}")
    unit = chimera_unit_orders(p)
    orders = [[a for u in range(m // p) for a in _shift(unit[r], 0, u * p)] for r in range(p)]
    stage_ranks = list(range(p)) + [p - 1 - i for i in range(p)]
    return from_orders("chimera", p, m, orders, stage_ranks=stage_ranks, pipe_depth=p)
