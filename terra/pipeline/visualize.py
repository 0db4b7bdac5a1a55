"""Text timeline and PNG plot of a simulated schedule (rank x time, evict/load marks)."""
from __future__ import annotations

import os
from typing import Optional

from terra.pipeline.actions import B, EVICT, F, LOAD, format_cell


def timeline(result, max_steps: Optional[int] = None) -> str:
    """The schedule's grid with, under each rank, a ``#`` row: micro-batches held at each step
    (own plus accepted; see `terra.pipeline.simulate`)."""
    schedule = result.schedule
    steps = schedule.steps if max_steps is None else min(schedule.steps, max_steps)
    out = [("step", [str(t) for t in range(steps)])]
    for r in range(schedule.p):
        out.append((f"r{r}", ["." if a is None else str(a) for a in schedule.compute[r][:steps]]))
        if any(schedule.transfers[r]):
            out.append(("  ~", [format_cell(c) for c in schedule.transfers[r][:steps]]))
        out.append(("  #", [str(n) for n in result.held[r][:steps]]))
    width = max(len(c) for _, cells in out for c in cells)
    lines = [f"{label:<4} " + " ".join(c.rjust(width) for c in cells) for label, cells in out]
    if steps < schedule.steps:
        lines.append(f"... ({schedule.steps - steps} more steps)")
    lines.append("peak micro-batches per rank: " + " ".join(map(str, result.peak_microbatches))
                 + f"; evictions: {result.evictions}")
    return "\n".join(lines)


_COLORS = {F: "#4C72B0", B: "#55A868"}


def plot(result, path, title: Optional[str] = None) -> str:
    """Rank x time chart: F (blue) and B (green) boxes labelled with micro-batch (and stage when a
    rank runs several), red down-triangles for EVICT and orange up-triangles for LOAD above the
    box, and the held count as a thin line under each rank. Written with the Agg backend."""
    import matplotlib
    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    schedule = result.schedule
    T, p = schedule.steps, schedule.p
    fig = Figure(figsize=(max(6.0, 0.35 * T + 1.5), 0.9 * p + 1.2))
    ax = fig.add_subplot(1, 1, 1)
    multi = schedule.num_stages > p
    peak = max(max(result.peak_microbatches, default=1), 1)
    for r in range(p):
        y = p - 1 - r
        for t, a in enumerate(schedule.compute[r]):
            if a is None:
                continue
            ax.add_patch(_rect(t, y, _COLORS[a.kind], matplotlib))
            label = f"{a.stage}:{a.microbatch}" if multi else str(a.microbatch)
            ax.text(t + 0.5, y + 0.5, label, ha="center", va="center", fontsize=6, color="white")
        for t, cell in enumerate(schedule.transfers[r]):
            for j, x in enumerate(cell):
                if x.kind is EVICT:
                    ax.plot(t + 0.3 + 0.2 * j, y + 0.92, marker="v", color="#C44E52", markersize=4)
                elif x.kind is LOAD:
                    ax.plot(t + 0.3 + 0.2 * j, y + 0.92, marker="^", color="#DD8452", markersize=4)
        xs = [t + 0.5 for t in range(T)]
        ys = [y + 0.05 + 0.25 * n / peak for n in result.held[r]]
        ax.plot(xs, ys, color="black", linewidth=0.6)
    ax.set_xlim(0, T)
    ax.set_ylim(0, p)
    ax.set_yticks([p - 1 - r + 0.5 for r in range(p)])
    ax.set_yticklabels([f"rank {r} (peak {result.peak_microbatches[r]})" for r in range(p)],
                       fontsize=7)
    ax.set_xlabel("time step")
    ax.set_title(title or f"{schedule.name}: p={p}, m={schedule.m}, evictions={result.evictions}",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    return str(path)


def _rect(t, y, color, matplotlib):
    return matplotlib.patches.Rectangle((t + 0.04, y + 0.1), 0.92, 0.8, facecolor=color,
                                        edgecolor="none")
