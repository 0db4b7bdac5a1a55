"""Where each (data, pipeline, tensor) rank runs: standard vs pair-adjacent assignment (BPipe §4.2.5).

GPUs are numbered node by node (global GPU ``g`` is GPU ``g % gpus_per_node`` of node
``g // gpus_per_node``). Both assignments honour the priority tensor > pipeline > data: tensor
ranks of one (data, pipeline) rank are consecutive GPUs (their collectives stay inside a node
whenever ``tensor`` divides ``gpus_per_node``), then pipeline, then data parallelism outermost.

* `standard`: pipeline stages in order, ``g = (d * P + s) * T + t``. For 16 stages on two 8-GPU
  nodes every evictor/acceptor pair (s, P-1-s) straddles the two nodes (Figure 4.4a).
* `pair_adjacent`: the pipeline slots are ordered ``0, P-1, 1, P-2, ...`` so that each pair sits
  on adjacent GPU blocks, ``g = (d * P + slot(s)) * T + t`` (Figures 4.4b and 4.5: 4 stages, 2-way
  tensor, 2-way data on two 8-GPU nodes gives node 0 = PP 0 0 3 3 1 1 2 2 for DP 0, node 1 the
  same for DP 1). For odd P the unpaired middle stage takes the last slot.

Sizes must tile the nodes: ``data * pipeline * tensor`` a multiple of ``gpus_per_node`` and
``tensor`` dividing ``gpus_per_node`` or a multiple of it; otherwise ValueError.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from terra.pipeline.passes import pairs


@dataclass(frozen=True, slots=True)
class Placement:
    """``devices[(d, s, t)] = (node, gpu)``; ``gpu`` is the index inside the node."""
    name: str
    data: int
    pipeline: int
    tensor: int
    gpus_per_node: int
    devices: dict

    @property
    def num_nodes(self) -> int:
        return self.data * self.pipeline * self.tensor // self.gpus_per_node

    def device(self, data: int, pipeline: int, tensor: int = 0) -> tuple[int, int]:
        key = (data, pipeline, tensor)
        if key not in self.devices:
            raise ValueError(f"no rank (data={data}, pipeline={pipeline}, tensor={tensor}) in a "
                             f"{self.data}x{self.pipeline}x{self.tensor} placement")
        return self.devices[key]

    def gpu_table(self) -> list[list[tuple[int, int, int]]]:
        """[node][gpu] -> (data, pipeline, tensor) rank running there."""
        table = [[None] * self.gpus_per_node for _ in range(self.num_nodes)]
        for rank, (node, gpu) in self.devices.items():
            table[node][gpu] = rank
        return table

    def pair_links(self) -> list[tuple[int, int, int, bool]]:
        """(data, tensor, evictor stage, same node?) for every BPipe pair and replica."""
        out = []
        for d in range(self.data):
            for t in range(self.tensor):
                for e, a in pairs(self.pipeline):
                    out.append((d, t, e, self.devices[(d, e, t)][0] == self.devices[(d, a, t)][0]))
        return out

    @property
    def intra_node_pairs(self) -> float:
        """Fraction of evictor/acceptor links that stay inside a node (1.0 if there are none)."""
        links = self.pair_links()
        return 1.0 if not links else sum(same for *_, same in links) / len(links)

    def __str__(self) -> str:
        lines = [f"{self.name}: data={self.data} pipeline={self.pipeline} tensor={self.tensor} "
                 f"gpus_per_node={self.gpus_per_node}"]
        for node, row in enumerate(self.gpu_table()):
            cells = " ".join(f"DP{d}/PP{s}/TP{t}" for d, s, t in row)
            lines.append(f"node {node}: {cells}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Placement({self.name}, d={self.data}, p={self.pipeline}, t={self.tensor}, "
                f"gpus_per_node={self.gpus_per_node})")


def _check(data, pipeline, tensor, gpus_per_node):
    for name, value in (("data", data), ("pipeline", pipeline), ("tensor", tensor),
                        ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    total = data * pipeline * tensor
    if total % gpus_per_node:
        raise ValueError(f"data*pipeline*tensor = {data}*{pipeline}*{tensor} = {total} GPUs do not "
                         f"fill whole nodes of {gpus_per_node}")
    if gpus_per_node % tensor and tensor % gpus_per_node:
        raise ValueError(f"tensor={tensor} must divide gpus_per_node={gpus_per_node} or be a "
                         f"multiple of it (a tensor group must not straddle a node partially)")


def _build(name, data, pipeline, tensor, gpus_per_node, slot: Callable[[int], int]) -> Placement:
    _check(data, pipeline, tensor, gpus_per_node)
    devices = {}
    for d in range(data):
        for s in range(pipeline):
            for t in range(tensor):
                g = (d * pipeline + slot(s)) * tensor + t
                devices[(d, s, t)] = (g // gpus_per_node, g % gpus_per_node)
    return Placement(name, data, pipeline, tensor, gpus_per_node, devices)


def standard(data: int = 1, pipeline: int = 1, tensor: int = 1, gpus_per_node: int = 8) -> Placement:
    return _build("standard", data, pipeline, tensor, gpus_per_node, lambda s: s)


def pair_slot(stage: int, pipeline: int) -> int:
    """Slot of ``stage`` in the pair-adjacent order 0, P-1, 1, P-2, ... (middle stage last)."""
    partner = pipeline - 1 - stage
    if stage < partner:
        return 2 * stage
    if stage > partner:
        return 2 * partner + 1
    return pipeline - 1


def pair_adjacent(data: int = 1, pipeline: int = 1, tensor: int = 1,
                  gpus_per_node: int = 8) -> Placement:
    return _build("pair_adjacent", data, pipeline, tensor, gpus_per_node,
                  lambda s: pair_slot(s, pipeline))


# ------------------------------------------------------------------- devices of one pipeline
def host(device: str) -> tuple:
    """(job, replica, task) of a TF device name: the process, hence the host, it lives in (a name
    without them is the local process's)."""
    fields = dict(re.findall(r"/(job|replica|task):([^/]+)", device or ""))
    return (fields.get("job", "localhost"), fields.get("replica", "0"), fields.get("task", "0"))


def rank_devices(devices, balance=None) -> list:
    """Rank r's device, from ``devices`` listed host by host: with BPipe the pair-adjacent order
    (rank ``s`` on slot `pair_slot` ``(s, p)``), so each evictor/acceptor pair ``(s, p-1-s)`` gets
    adjacent devices, on one host whenever a host holds an even number of them; the given order
    otherwise. Build part ``r`` on ``rank_devices(...)[r]`` and pass the same list as the
    trainer's ``devices``."""
    devices = list(devices)
    if balance is None:
        return devices
    if balance != "bpipe":
        raise ValueError(f"balance must be None or 'bpipe', got {balance!r}")
    return [devices[pair_slot(r, len(devices))] for r in range(len(devices))]


def split_pairs(devices, pairs) -> list:
    """The (evictor, acceptor) rank pairs whose devices are on different hosts."""
    return [(e, a) for e, a in pairs if host(devices[e]) != host(devices[a])]
