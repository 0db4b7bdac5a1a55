"""Memory of a pipeline: a byte ledger driven by the schedule, and real allocator peaks beside it.

The ledger is the source of truth because logical CPUs of one process share one allocator (and a
cross-device identity there shares the buffer). Per rank it counts weights (with the parts' other variables: statistics, seed states), optimizer state,
gradient accumulators, the activation packs the rank holds for its own stages and the packs it
accepted from its BPipe partner, with the schedule's semantics (`terra.pipeline.passes`): a pack
is held from the start of its F step through the end of its B step (of its W step where the
backward is split; there what B leaves for W, the output gradient and the intermediate
gradients, is held too, from the start of B through the end of W: ``residual``); an EVICT in step
``t`` is counted on the evictor through ``t`` and on the acceptor from ``t``; a LOAD in step ``t`` on the
evictor from ``t`` and on the acceptor through ``t``. Each step therefore applies its "start"
deltas, records peaks, then applies its "end" deltas. `schedule_ledger` replays a schedule without running anything; the executor
keeps a live `Ledger` with the same rules as ranks actually finish their steps.

Real allocator peaks come from `tf.config.experimental.get_memory_info` where a device has its own
allocator: a GPU, or a CPU in a process of its own with ``TF_CPU_ALLOCATOR_USE_BFC=true``
(`terra.pipeline.cluster` workers).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, asdict
from typing import Optional, Sequence

import tensorflow as tf

from terra.pipeline.actions import B, EVICT, F, LOAD, W

FIELDS = ("weights", "optimizer", "grads", "held", "accepted", "residual")


@dataclass(slots=True)
class RankMemory:
    """Bytes on one rank now, and the peaks seen so far (``packs`` counts activation packs)."""
    weights: int = 0
    optimizer: int = 0
    grads: int = 0
    held: int = 0
    accepted: int = 0
    residual: int = 0
    held_packs: int = 0
    accepted_packs: int = 0
    residual_packs: int = 0
    peak_activation: int = 0
    peak_packs: int = 0
    peak_held_packs: int = 0
    peak_total: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.grads + self.held + self.accepted + self.residual

    def as_dict(self) -> dict:
        return dict(asdict(self), total=self.total)


class Ledger:
    """Per-rank byte ledger; `apply` takes one rank's step deltas at once (thread-safe)."""

    def __init__(self, num_ranks: int):
        self.ranks = [RankMemory() for _ in range(num_ranks)]
        self._lock = threading.Lock()

    def set_static(self, rank: int, *, weights=0, optimizer=0, grads=0):
        with self._lock:
            r = self.ranks[rank]
            r.weights, r.optimizer, r.grads = weights, optimizer, grads
            self._update_peaks(r)

    def apply(self, deltas):
        """``deltas``: iterable of (rank, field, bytes, packs) applied together."""
        with self._lock:
            touched = set()
            for rank, name, nbytes, packs in deltas:
                r = self.ranks[rank]
                setattr(r, name, getattr(r, name) + nbytes)
                setattr(r, f"{name}_packs", getattr(r, f"{name}_packs") + packs)
                touched.add(rank)
            for rank in touched:
                self._update_peaks(self.ranks[rank])

    @staticmethod
    def _update_peaks(r: RankMemory):
        r.peak_activation = max(r.peak_activation, r.held + r.accepted)
        r.peak_packs = max(r.peak_packs, r.held_packs + r.accepted_packs)
        r.peak_held_packs = max(r.peak_held_packs, r.held_packs)
        r.peak_total = max(r.peak_total, r.total)

    def reset_peaks(self):
        with self._lock:
            for r in self.ranks:
                r.peak_activation = r.held + r.accepted
                r.peak_packs = r.held_packs + r.accepted_packs
                r.peak_held_packs = r.held_packs
                r.peak_total = r.total

    def report(self) -> list[dict]:
        with self._lock:
            return [r.as_dict() for r in self.ranks]


def step_deltas(rank: int, compute, transfers, stage_rank, pack_bytes,
                split=frozenset(), residual_bytes=None) -> tuple[list, list]:
    """(start, end) ledger deltas of one rank's schedule step (rules in the module docstring);
    ``split``: the (stage, micro-batch) pairs whose pack lives until their W (`Schedule.split`);
    ``residual_bytes[stage]``: what such a B leaves for its W (None: not counted)."""
    start, end = [], []
    if compute is not None:
        n = pack_bytes[compute.stage]
        r = residual_bytes[compute.stage] if residual_bytes is not None else 0
        split_b = (compute.stage, compute.microbatch) in split
        if compute.kind is F:
            start.append((rank, "held", n, 1))
        elif compute.kind is W or not split_b:
            end.append((rank, "held", -n, -1))
        if compute.kind is B and split_b and r:
            start.append((rank, "residual", r, 1))
        elif compute.kind is W and r:
            end.append((rank, "residual", -r, -1))
    for a in transfers:
        if a.kind not in (EVICT, LOAD):
            continue
        owner, peer, n = stage_rank[a.stage], a.peer, pack_bytes[a.stage]
        if peer is None:
            raise ValueError(f"{a}: EVICT/LOAD needs the acceptor rank as peer")
        if a.kind is EVICT:
            start.append((peer, "accepted", n, 1))
            end.append((owner, "held", -n, -1))
        else:
            start.append((owner, "held", n, 1))
            end.append((peer, "accepted", -n, -1))
    return start, end


def schedule_ledger(schedule, pack_bytes: Sequence[int], static: Optional[Sequence[dict]] = None,
                    residual_bytes: Optional[Sequence[int]] = None):
    """Replay ``schedule`` step by step (all ranks' deltas of a step together); returns the
    `Ledger`. ``pack_bytes[stage]`` is one micro-batch's pack size; ``static[rank]`` may give
    weights/optimizer/grads bytes; ``residual_bytes[stage]`` what a split B leaves for its W."""
    ledger = Ledger(schedule.p)
    split = schedule.split
    for rank, values in enumerate(static or []):
        ledger.set_static(rank, **values)
    for t in range(schedule.steps):
        start, end = [], []
        for rank in range(schedule.p):
            a, b = step_deltas(rank, schedule.compute[rank][t], schedule.transfers[rank][t],
                               schedule.stage_ranks, pack_bytes, split, residual_bytes)
            start += a
            end += b
        ledger.apply(start)
        ledger.apply(end)
    return ledger


def variable_bytes(variables) -> int:
    return sum(int(v.shape.num_elements()) * tf.as_dtype(v.dtype).size for v in variables)


# ----------------------------------------------------------------------------- allocators
def allocator_info(device: str) -> Optional[dict]:
    """``{'current', 'peak'}`` bytes of ``device``'s allocator, or None where TF keeps no stats
    (CPU without the BFC allocator, remote devices)."""
    try:
        info = dict(tf.config.experimental.get_memory_info(device))
    except (ValueError, RuntimeError, tf.errors.OpError):
        return None
    return None if not any(info.values()) else info  # all zeros: no stats kept


def reset_allocator_peak(device: str) -> bool:
    try:
        tf.config.experimental.reset_memory_stats(device)
        return True
    except (ValueError, RuntimeError, tf.errors.OpError):
        return False


class AllocatorProbe:
    """Reads one allocator: ``reset()`` starts a new peak, ``read()`` is ``{'current', 'peak'}``
    bytes. `local_probe` makes one for a device of this process; a cluster hands out its
    workers' (`LocalCluster.probe`)."""

    def __init__(self, reset, read):
        self.reset, self.read = reset, read


def local_probe(device: str) -> Optional[AllocatorProbe]:
    """A probe of GPU ``device``'s allocator, or None. In-process CPUs are not probed: logical CPUs
    share one allocator, and its stats exist only while something enables them (they read as
    zeros after a reset)."""
    spec = tf.DeviceSpec.from_string(device or "")
    if (spec.device_type or "").upper() != "GPU" or allocator_info(device) is None:
        return None
    return AllocatorProbe(lambda: reset_allocator_peak(device), lambda: allocator_info(device))
