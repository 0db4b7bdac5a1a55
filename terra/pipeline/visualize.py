"""Text timeline and PNG plot of a simulated schedule (rank x time, evict/load marks)."""
from __future__ import annotations

import os
from typing import Optional

from terra.pipeline.actions import B, EVICT, F, LOAD, RECV, SEND, W, format_cell


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


_COLORS = {F: "#4C72B0", B: "#55A868", W: "#8172B3"}


def plot(result, path, title: Optional[str] = None) -> str:
    """Rank x time chart: F (blue), B (green) and W (purple) boxes labelled with micro-batch (and
    stage when a rank runs several), red down-triangles for EVICT and orange up-triangles for LOAD (with the
    micro-batch) above the box, and the held count as a step line under each rank. Rendered on
    an Agg canvas directly, so pyplot's global backend is left alone."""
    import matplotlib
    import matplotlib.lines
    import matplotlib.patches
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    schedule = result.schedule
    T, p = schedule.steps, schedule.p
    fig = Figure(figsize=(max(6.0, 0.35 * T + 1.5), 0.9 * p + 1.5))
    FigureCanvasAgg(fig)  # render with Agg without touching pyplot's global backend
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
            ax.text(t + 0.5, y + 0.6, label, ha="center", va="center", fontsize=6, color="white")
        for t, cell in enumerate(schedule.transfers[r]):
            moves = [x for x in cell if x.kind in (EVICT, LOAD)]
            for j, x in enumerate(moves):
                marker, color = ("v", "#C44E52") if x.kind is EVICT else ("^", "#DD8452")
                ax.plot(t + 0.25 + 0.3 * j, y + 0.93, marker=marker, color=color, markersize=4)
                ax.text(t + 0.45 + 0.3 * j, y + 0.93, str(x.microbatch), fontsize=5, va="center",
                        color=color)
            messages = [x for x in cell if x.kind in (SEND, RECV)]
            for j, x in enumerate(messages):   # below the cell: > sends, < receives
                marker = ">" if x.kind is SEND else "<"
                ax.plot(t + 0.2 + 0.2 * (j % 4), y + 0.2, marker=marker, color="#666666", markersize=3)
        xs = [t + 0.5 for t in range(T)]
        ys = [y + 0.04 + 0.26 * n / peak for n in result.held[r]]
        ax.step(xs, ys, where="mid", color="black", linewidth=0.7)
    split = bool(schedule.split)
    handles = [matplotlib.patches.Patch(color=_COLORS[F], label="forward"),
               matplotlib.patches.Patch(color=_COLORS[B], label="input grad" if split else "backward")]
    if split:
        handles.append(matplotlib.patches.Patch(color=_COLORS[W], label="weight grad"))
    handles += [matplotlib.lines.Line2D([], [], marker="v", color="#C44E52", linestyle="", label="evict"),
                matplotlib.lines.Line2D([], [], marker="^", color="#DD8452", linestyle="", label="load"),
                matplotlib.lines.Line2D([], [], marker=">", color="#666666", linestyle="", label="send / recv"),
                matplotlib.lines.Line2D([], [], color="black", linewidth=0.7, label="held")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=len(handles),
              fontsize=7, frameon=False)
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
    return matplotlib.patches.Rectangle((t + 0.04, y + 0.34), 0.92, 0.52, facecolor=color,
                                        edgecolor="none")
