"""PNG charts of a result set (matplotlib, Agg): Figure 3.10, Tables 3.1-3.3, Figure 3.11.
Terra charts say "unavailable" (with the reason) until the runtime reports data."""
import os
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from . import modes as modes_mod  # noqa: E402
from . import report  # noqa: E402

STATUS_COLOR = {"ok": "#8fd18f", "wrong": "#f2b35f", "failed": "#ee7b7b", "unavailable": "#dddddd",
                "unchecked": "#c9c9f0"}


def _label(m):
    return modes_mod.MODES[m].label if m in modes_mod.MODES else m


def _placeholder(path, title, text):
    fig, ax = plt.subplots(figsize=(7, 2.2))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.45, text, ha="center", va="center", wrap=True, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _terra_reason(results):
    for pr in results["programs"].values():
        r = pr["modes"].get("terra")
        if r and r["status"] == "unavailable":
            return r["reason"]
    return "Terra modes were not run"


def speedup(results, path):
    summ, progs = report.summarize(results), list(results["programs"])
    others = [m for m in report.mode_names(results) if m != "eager"]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(progs)), 4.2))
    w = 0.8 / max(1, len(others))
    for k, m in enumerate(others):
        for j, p in enumerate(progs):
            r, t = results["programs"][p]["modes"].get(m), summ[p].get(m)
            x = j + (k - (len(others) - 1) / 2) * w
            if r is None:
                continue
            if t is None or "speedup" not in t:
                if r["status"] == "failed":
                    ax.text(x, 0.05, "x", ha="center", color="#c00000", fontsize=11, fontweight="bold")
                continue
            err = [[t["speedup"] - t["speedup_p25"]], [t["speedup_p75"] - t["speedup"]]]
            ax.bar(x, t["speedup"], w, yerr=err, capsize=2, color=f"C{k}",
                   hatch="//" if r["status"] != "ok" else None, alpha=0.45 if r["status"] != "ok" else 1.0,
                   label=_label(m) if j == 0 or not ax.get_legend_handles_labels()[1].count(_label(m)) else None)
    ax.axhline(1.0, ls=":", color="k")
    ax.set_xticks(range(len(progs)), progs, rotation=30, ha="right")
    ax.set_ylabel("speed-up over TF eager")
    ax.set_title("Training speed-up (Figure 3.10); hatched = wrong result, x = failed")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    if uniq:
        ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def coverage(results, path):
    progs = list(results["programs"])
    cols = [m for m in report.mode_names(results) if m != "eager"]
    fig, ax = plt.subplots(figsize=(12, 0.3 * len(progs) + 0.6))
    ax.axis("off")
    cells, colors = [], []
    for p in progs:
        ms = results["programs"][p]["modes"]
        row = [report.STATUS_TEXT.get(ms[m]["status"], "") if m in ms else "" for m in cols]
        fn_reason = next((f"{_label(m)}: {ms[m]['reason']}" for m in ("function", "function_xla")
                          if m in ms and ms[m]["reason"]), "")
        cells.append(row + [re.sub(r"\[[^\]]{40,}\]", "", fn_reason)[:170]])
        colors.append([STATUS_COLOR.get(ms[m]["status"], "white") if m in ms else "white" for m in cols] + ["white"])
    tab = ax.table(cellText=cells, cellColours=colors, rowLabels=progs, colLabels=[_label(m) for m in cols] + ["reason (AutoGraph)"],
                   loc="center", cellLoc="left")
    tab.auto_set_font_size(False)
    tab.set_fontsize(7)
    tab.auto_set_column_width(list(range(len(cols) + 1)))
    ax.set_title("Coverage (Table 3.1): ok / WRONG (silent mismatch) / FAILED (exception) / n/a")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def traces(results, path):
    progs = [p for p in results["programs"] if (results["programs"][p]["modes"].get("terra") or {}).get("terra_stats")]
    title = "Terra traces and fallbacks (Table 3.3)"
    if not progs:
        return _placeholder(path, title, f"unavailable: {_terra_reason(results)}")
    get = lambda p, k: report.terra_count(results["programs"][p]["modes"]["terra"], k)
    fig, ax = plt.subplots(figsize=(max(7, len(progs)), 3.6))
    x = np.arange(len(progs))
    ax.bar(x - 0.2, [get(p, "traces") for p in progs], 0.4, label="collected traces")
    ax.bar(x + 0.2, [get(p, "fallbacks") for p in progs], 0.4, label="fallbacks")
    ax.set_xticks(x, progs, rotation=30, ha="right")
    ax.legend()
    ax.set_title(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


TIMELINE_PROGRAMS = ("sdpoint", "gpt2", "fasterrcnn_like")
TIMELINE_MODES = ("eager", "function", "terra")


def timeline(results, path):
    """Step time against step number (warm-up included) for the dynamic programs, with the
    steps in which Terra traced, built a graph or fell back marked."""
    progs = [p for p in TIMELINE_PROGRAMS if p in results["programs"]]
    title = "Step time per step: where the time goes (traces, builds, fallbacks marked)"
    if not progs:
        return _placeholder(path, title, "none of " + ", ".join(TIMELINE_PROGRAMS) + " was run")
    fig, axes = plt.subplots(len(progs), 1, figsize=(9, 2.8 * len(progs)), squeeze=False)
    for ax, p in zip(axes[:, 0], progs):
        ms = results["programs"][p]["modes"]
        for color, m in zip(("C0", "C1", "C2"), TIMELINE_MODES):
            r = ms.get(m)
            if not r or not (r.get("warmup_s") or r.get("step_s")):
                continue
            pts = report.step_timeline(r)
            ax.plot([i for i, _ in pts], [t * 1e3 for _, t in pts], lw=1, color=color, label=_label(m)
                    + ("" if r["status"] == "ok" else f" ({report.STATUS_TEXT[r['status']]})"))
            if m == "terra":
                at = dict(pts)
                events = (r.get("terra_stats") or {}).get("events") or []
                for k, (marker, name, style) in enumerate((
                        ("x", "trace", {"color": "C3"}), ("^", "graph build", {"color": "C4"}),
                        ("o", "fallback", {"facecolors": "none", "edgecolors": "k"}))):
                    xs = [e[0] for e in events if e[k + 1] and e[0] in at]
                    ax.scatter(xs, [at[i] * 1e3 for i in xs], marker=marker, s=30, zorder=3,
                               label=name, **style)
        ax.set_yscale("log")
        ax.set_ylabel("ms")
        ax.set_title(p, fontsize=10)
        ax.legend(fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("step (warm-up included)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def breakdown(results, path):
    rs = {p: results["programs"][p]["modes"].get("terra") for p in results["programs"]}
    progs = [p for p, r in rs.items() if report.terra_per_step(r, "graph_exec_s") is not None]
    title = "Per-step breakdown of Terra (Figure 3.11)"
    if not progs:
        return _placeholder(path, title, f"unavailable: {_terra_reason(results)}")
    fig, ax = plt.subplots(figsize=(8, 0.7 * len(progs) + 1.5))
    for j, p in enumerate(progs):
        v = {k: (report.terra_per_step(rs[p], k) or 0.0) * 1e3 for k, _ in report.BREAKDOWN}
        for y, (ka, kb) in ((2 * j, ("python_exec_s", "python_stall_s")), (2 * j + 1, ("graph_exec_s", "graph_stall_s"))):
            ax.barh(y, v[ka], color="C0" if ka.startswith("python") else "C2", label=None)
            ax.barh(y, v[kb], left=v[ka], color="C3", alpha=0.6)
    ax.set_yticks(range(2 * len(progs)), [f"{p} {r}" for p in progs for r in ("Python", "Graph")], fontsize=8)
    ax.set_xlabel("ms per step (exec; red: stall)")
    ax.invert_yaxis()
    ax.set_title(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def lazy(results, path):
    summ = report.summarize(results)
    progs = [p for p in results["programs"] if all((summ[p].get(m) or {}).get("speedup") for m in ("terra", "terra_lazy"))]
    title = "Terra vs Terra with co-execution disabled (Table 3.2)"
    if not progs:
        return _placeholder(path, title, f"unavailable: {_terra_reason(results)}")
    fig, ax = plt.subplots(figsize=(max(6, len(progs)), 3.6))
    x = np.arange(len(progs))
    for k, m in enumerate(("terra", "terra_lazy")):
        ax.bar(x + (k - 0.5) * 0.4, [summ[p][m]["speedup"] for p in progs], 0.4, label=_label(m))
    ax.axhline(1.0, ls=":", color="k")
    ax.set_xticks(x, progs, rotation=30, ha="right")
    ax.set_ylabel("speed-up over TF eager")
    ax.legend()
    ax.set_title(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


CHARTS = (("fig3_10_speedup.png", speedup), ("table3_1_coverage.png", coverage),
          ("table3_3_traces.png", traces), ("fig3_11_breakdown.png", breakdown), ("table3_2_lazy.png", lazy),
          ("step_timeline.png", timeline))


def write_charts(results, out_dir):
    paths = []
    for name, fn in CHARTS:
        path = os.path.join(out_dir, name)
        fn(results, path)
        paths.append(path)
    return paths
