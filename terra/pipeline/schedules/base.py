"""`Schedule`: a pipeline schedule as a rank x time-step grid, and the list scheduler that builds one.

A schedule has two lanes per rank, both indexed by time step:

* ``compute[r][t]``: the F, B or W action rank ``r`` runs in step ``t``, or ``None`` (a bubble).
  Every action takes exactly one step (unit time; `terra.pipeline.simulate` puts costs on them).
  A B is the whole backward unless the schedule also has the W of its (stage, micro-batch):
  then B is the input gradient and W the weight gradient (`Schedule.split`).
* ``transfers[r][t]``: a tuple of EVICT / LOAD / SEND / RECV actions rank ``r`` runs *alongside*
  its compute in step ``t`` (transfers overlap compute, as in BPipe). An EVICT in step ``t`` frees
  the evictor's copy at the end of ``t``; a LOAD in step ``t`` makes the activations available
  from step ``t + 1``.

Stages are global ids. ``stage_ranks[s]`` is the rank that runs stage ``s``; a pipeline is
``pipe_depth`` consecutive stage ids, so stage ``s`` feeds stage ``s + 1`` unless
``(s + 1) % pipe_depth == 0``. One plain pipeline: ``pipe_depth == p``; interleaved with ``v``
chunks: ``pipe_depth == p * v`` and stage ``c * p + r`` on rank ``r``; Chimera: two pipelines of
depth ``p``, stages ``p .. 2p-1`` the upward one. Each micro-batch runs through exactly one
pipeline.
"""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Sequence

from terra.pipeline.actions import Action, B, F, W, format_cell, parse_cell

Cell = Optional[Action]


def check_positive(**values):
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Schedule:
    """A pipeline schedule; see the module docstring for the meaning of each field."""
    name: str
    p: int
    m: int
    compute: tuple[tuple[Cell, ...], ...]
    stage_ranks: tuple[int, ...]
    pipe_depth: int
    v: int = 1
    transfers: tuple[tuple[tuple[Action, ...], ...], ...] = field(default=None)

    def __post_init__(self):
        check_positive(p=self.p, m=self.m, v=self.v, pipe_depth=self.pipe_depth)
        if len(self.compute) != self.p:
            raise ValueError(f"compute must have one row per rank ({self.p}), got {len(self.compute)}")
        steps = max((len(row) for row in self.compute), default=0)
        compute = tuple(tuple(row) + (None,) * (steps - len(row)) for row in self.compute)
        for r, row in enumerate(compute):
            for t, cell in enumerate(row):
                if cell is not None and not isinstance(cell, Action):
                    raise TypeError(f"compute[{r}][{t}] must be an Action or None, got {cell!r} "
                                    f"(use Action.parse for text)")
        transfers = self.transfers
        if transfers is None:
            transfers = tuple(((),) * steps for _ in range(self.p))
        else:
            if len(transfers) != self.p:
                raise ValueError(f"transfers must have one row per rank ({self.p}), got {len(transfers)}")
            longest = max((len(row) for row in transfers), default=0)
            if longest > steps:  # transfers after the last compute step extend the grid
                compute = tuple(row + (None,) * (longest - steps) for row in compute)
                steps = longest
            transfers = tuple(tuple(tuple(c) for c in row) + ((),) * (steps - len(row))
                              for row in transfers)
            for r, row in enumerate(transfers):
                for t, cell in enumerate(row):
                    if not all(isinstance(x, Action) for x in cell):
                        raise TypeError(f"transfers[{r}][{t}] must hold Actions, got {cell!r}")
        object.__setattr__(self, "compute", compute)
        object.__setattr__(self, "transfers", transfers)
        object.__setattr__(self, "stage_ranks", tuple(self.stage_ranks))
        if len(self.stage_ranks) % self.pipe_depth:
            raise ValueError(f"number of stages ({len(self.stage_ranks)}) must be a multiple of "
                             f"pipe_depth ({self.pipe_depth})")
        bad = [r for r in self.stage_ranks if not 0 <= r < self.p]
        if bad:
            raise ValueError(f"stage_ranks names ranks outside 0..{self.p - 1}: {bad}")

    # -------------------------------------------------------------------------------- shape
    @property
    def steps(self) -> int:
        return len(self.compute[0]) if self.compute else 0

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def __getitem__(self, rank: int) -> tuple[Cell, ...]:
        """``schedule[r]``: rank r's compute lane (the ``{rank: [Action | None]}`` view)."""
        return self.compute[rank]

    def __len__(self) -> int:
        return self.p

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def next_stage(self, stage: int) -> Optional[int]:
        """The stage fed by ``stage`` (None at the end of its pipeline)."""
        return None if (stage + 1) % self.pipe_depth == 0 else stage + 1

    def prev_stage(self, stage: int) -> Optional[int]:
        return None if stage % self.pipe_depth == 0 else stage - 1

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    def actions(self, rank: Optional[int] = None) -> Iterable[tuple[int, int, Action]]:
        """Every (rank, step, action), compute before transfers within a step."""
        ranks = range(self.p) if rank is None else (rank,)
        for r in ranks:
            for t in range(self.steps):
                if self.compute[r][t] is not None:
                    yield r, t, self.compute[r][t]
                for a in self.transfers[r][t]:
                    yield r, t, a

    def compute_order(self, rank: int) -> list[Action]:
        """Rank's F/B/W actions in execution order (bubbles dropped)."""
        return [a for a in self.compute[rank] if a is not None]

    @property
    def split(self) -> frozenset:
        """(stage, micro-batch) pairs whose backward is split: the schedule runs their W, so
        their B is the input gradient only and their activations live until the W."""
        return frozenset((a.stage, a.microbatch) for row in self.compute for a in row
                         if a is not None and a.kind is W)

    @property
    def has_transfers(self) -> bool:
        return any(cell for row in self.transfers for cell in row)

    def with_transfers(self, transfers, name: Optional[str] = None) -> "Schedule":
        return replace(self, transfers=transfers, name=self.name if name is None else name)

    # ------------------------------------------------------------------------------- printing
    def __repr__(self) -> str:
        extra = f", v={self.v}" if self.v != 1 else ""
        return (f"Schedule({self.name}, p={self.p}, m={self.m}{extra}, stages={self.num_stages}, "
                f"steps={self.steps})")

    def __str__(self) -> str:
        return format_grid(self)

    # ------------------------------------------------------------------------------------ CSV
    def to_csv(self) -> str:
        """CSV text: a ``#`` metadata line, a header, then one compute row and one transfer row
        per rank; cells hold action texts (several transfers joined by ``+``)."""
        out = io.StringIO()
        out.write(f"# name={self.name};p={self.p};m={self.m};v={self.v};"
                  f"pipe_depth={self.pipe_depth};stage_ranks={' '.join(map(str, self.stage_ranks))}\n")
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["rank", "lane"] + [str(t) for t in range(self.steps)])
        for r in range(self.p):
            writer.writerow([r, "compute"] + ["" if a is None else str(a) for a in self.compute[r]])
            writer.writerow([r, "transfers"] + [format_cell(c) for c in self.transfers[r]])
        return out.getvalue()

    @classmethod
    def from_csv(cls, text: str) -> "Schedule":
        lines = text.splitlines()
        if not lines or not lines[0].startswith("# "):
            raise ValueError("schedule CSV must start with a '# name=...;p=...' metadata line")
        meta = dict(item.split("=", 1) for item in lines[0][2:].split(";"))
        try:
            p, m, v, depth = (int(meta[k]) for k in ("p", "m", "v", "pipe_depth"))
            stage_ranks = tuple(int(x) for x in meta["stage_ranks"].split())
            name = meta["name"]
        except KeyError as e:
            raise ValueError(f"schedule CSV metadata lacks {e.args[0]!r}: {lines[0]!r}") from None
        compute: list[list[Cell]] = [[] for _ in range(p)]
        transfers: list[list[tuple[Action, ...]]] = [[] for _ in range(p)]
        rows = list(csv.reader(lines[1:]))
        for row in rows[1:]:
            if not row:
                continue
            rank, lane, cells = int(row[0]), row[1], row[2:]
            if lane == "compute":
                for c in cells:
                    parsed = parse_cell(c)
                    if len(parsed) > 1:
                        raise ValueError(f"rank {rank}: compute cell {c!r} holds more than one action")
                    compute[rank].append(parsed[0] if parsed else None)
            elif lane == "transfers":
                transfers[rank] = [parse_cell(c) for c in cells]
            else:
                raise ValueError(f"unknown lane {lane!r} in schedule CSV (expected compute/transfers)")
        return cls(name=name, p=p, m=m, v=v, pipe_depth=depth, stage_ranks=stage_ranks,
                   compute=tuple(map(tuple, compute)), transfers=tuple(map(tuple, transfers)))


# ---------------------------------------------------------------------------------- printing
def format_grid(schedule: Schedule, marks: Optional[dict] = None, transfers: bool = True,
                max_steps: Optional[int] = None) -> str:
    """Rank x step text grid. Each rank gets a compute row (``r0``) and, when the schedule has
    transfers, a transfer row (``  ~``) below it. ``marks`` maps ``(rank, step)`` to a suffix
    (e.g. ``"!"``) appended to the cell, used to point at an offending action. ``.`` is a bubble."""
    marks = marks or {}
    steps = schedule.steps if max_steps is None else min(schedule.steps, max_steps)
    show_transfers = transfers and (schedule.has_transfers
                                    or any(len(k) == 3 for k in marks))
    rows: list[tuple[str, list[str]]] = []
    for r in range(schedule.p):
        cells = []
        for t in range(steps):
            a = schedule.compute[r][t]
            text = "." if a is None else str(a)
            cells.append(text + marks.get((r, t), ""))
        rows.append((f"r{r}", cells))
        if show_transfers and (any(schedule.transfers[r]) or any(k[0] == r for k in marks if len(k) == 3)):
            rows.append(("  ~", [format_cell(schedule.transfers[r][t]) + marks.get((r, t, "transfers"), "")
                                 for t in range(steps)]))
    width = max([len(c) for _, cells in rows for c in cells] + [len(str(steps - 1)), 1])
    header = "step " + " ".join(str(t).rjust(width) for t in range(steps))
    lines = [header] + [f"{label:<4} " + " ".join(c.rjust(width) for c in cells) for label, cells in rows]
    if steps < schedule.steps:
        lines.append(f"... ({schedule.steps - steps} more steps)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ list scheduler
def action_deps(action: Action, next_stage, prev_stage) -> list[Action]:
    """What ``action`` waits for: F the previous stage's F; B its own F and the next stage's B
    (the input gradient, never the next stage's W); W its own B."""
    if action.kind is W:
        return [Action(action.stage, B, action.microbatch)]
    if action.kind is F:
        prev = prev_stage(action.stage)
        return [] if prev is None else [Action(prev, F, action.microbatch)]
    nxt = next_stage(action.stage)
    deps = [Action(action.stage, F, action.microbatch)]
    if nxt is not None:
        deps.append(Action(nxt, B, action.microbatch))
    return deps


def from_orders(name: str, p: int, m: int, orders: Sequence[Sequence[Action]],
                stage_ranks: Sequence[int], pipe_depth: int, v: int = 1) -> Schedule:
    """Turn per-rank execution orders into a time-step grid.

    Each rank runs its next action in the first step where all of its dependencies finished in an
    earlier step (F needs the previous stage's F; B needs the next stage's B and its own F; W
    its own B), so
    the grid is the as-soon-as-possible execution of the orders with unit-time actions. Raises
    ValueError if the orders deadlock (no rank can ever make progress)."""
    shape = Schedule(name=name, p=p, m=m, v=v, compute=((),) * p, stage_ranks=stage_ranks,
                     pipe_depth=pipe_depth)
    if len(orders) != p:
        raise ValueError(f"need one order per rank ({p}), got {len(orders)}")
    done: dict[Action, int] = {}
    pos = [0] * p
    rows: list[list[Cell]] = [[] for _ in range(p)]
    total = sum(len(o) for o in orders)
    t = 0
    while len(done) < total:
        started = []
        for r in range(p):
            if pos[r] >= len(orders[r]):
                rows[r].append(None)
                continue
            a = orders[r][pos[r]]
            if all(done.get(d, t) < t for d in action_deps(a, shape.next_stage, shape.prev_stage)):
                rows[r].append(a)
                started.append(a)
                pos[r] += 1
            else:
                rows[r].append(None)
        if not started:
            waiting = {r: str(orders[r][pos[r]]) for r in range(p) if pos[r] < len(orders[r])}
            raise ValueError(f"{name}: orders deadlock at step {t}; next actions per rank: {waiting}")
        for a in started:
            done[a] = t
        t += 1
    # trim trailing bubbles
    return replace(shape, compute=tuple(tuple(row) for row in rows))
