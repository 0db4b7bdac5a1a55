"""Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): each rank holds ``v`` model chunks.

Rank ``r`` runs stages ``r, r + p, ..., r + (v-1) p`` (global stage ``c * p + r`` is chunk ``c``
on rank ``r``); one micro-batch passes ``p * v`` stages. Each rank walks its forwards chunk by
chunk in groups of ``p`` micro-batches (k-th forward: chunk ``(k // p) % v``, micro-batch
``(k // (p v)) p + k % p``; backwards the same with chunks reversed), warms up with
``(p - r - 1) * 2 + (v - 1) * p`` forwards, then alternates one forward and one backward. Before
its first backward rank ``r`` holds ``p (v - 1) + 2 (p - r - 1) + 1`` chunk activations (the
``mu(s)`` of BPipe's appendix), counted in units of one chunk's activations.
"""
from __future__ import annotations

from terra.pipeline.actions import Action, B, F
from terra.pipeline.schedules.base import Schedule, check_positive, from_orders


def interleaved_order(rank: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v

    def action(k: int, kind) -> Action:
        group = (k // p) % v
        chunk = group if kind is F else v - 1 - group
        return Action(chunk * p + rank, kind, (k // (p * v)) * p + k % p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [action(k, F) for k in range(warmup)]
    for j in range(total - warmup):
        order += [action(warmup + j, F), action(j, B)]
    order += [action(k, B) for k in range(total - warmup, total)]
    return order


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B over ``p`` ranks with ``v`` chunks each and ``m`` micro-batches.

    ``m`` must be a multiple of ``p``: the order visits micro-batches in groups of ``p`` per chunk,
    so a partial group would skip micro-batches in one chunk and repeat them in another."""
    check_positive(p=p, m=m, v=v)
    if m % p:
        raise ValueError(f"interleaved_1f1b needs m to be a multiple of p (micro-batches run in "
                         f"groups of p per model chunk), got m={m}, p={p}")
    orders = [interleaved_order(r, p, m, v) for r in range(p)]
    return from_orders(f"interleaved(v={v})", p, m, orders,
                       stage_ranks=[s % p for s in range(p * v)], pipe_depth=p * v, v=v)
