"""A many-path program's steady state: the site graph (switch-cases fused or not) against path
graphs and eager, on the same compiled paths, in one process.

    python -m benchmarks.site_graph_steady [--warmup 100] [--chunks 6] [--steps 15]

`sdpoint` (bench size: a random block resizes the feature map) first runs `--warmup` steps with
the site graph on, so its paths are compiled and their graphs built; then two site graphs are
built over the same paths, one lowered with switch-case fusion (compiler/fuse.py, the default)
and one without, and chunks of `--steps` timed steps (after 3 untimed) run on each of: the
fused site graph, the unfused one, the path graphs alone (`site_graph` off), and an eager twin
of the program, in an order that turns around every chunk. Builds are not in these numbers
(`benchmarks/results/site_graph_builds_sdpoint.txt` has the whole run). Per mode: the median
step, the 10th-90th percentiles and Terra's counts over the timed chunks. Writes
benchmarks/results/site_graph_steady.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("site", "site_unfused", "path", "eager")
COUNTS = ("traces", "fallbacks", "graph_builds", "case_switches", "path_switches")


def run(warmup: int, chunks: int, steps: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    import terra
    from benchmarks.programs import sdpoint
    from terra.runtime.session import SESSION
    from terra.runtime.site_graph import SiteGraph

    old = terra.config(site_graph=True)
    prog = sdpoint.build(tf.TerraGradientTape, size="bench")
    twin = sdpoint.build(tf.GradientTape, size="bench")
    i = 0
    for _ in range(warmup):
        prog.step(i)
        i += 1
    terra.end_iteration()
    sites = [s for s in SESSION.sites.values() if s.site_graph is not None]
    if len(sites) != 1:
        raise RuntimeError(f"expected one site with a site graph after warm-up, got "
                           f"{len(sites)}:\n{terra.explain()}")
    site = sites[0]
    graphs = {"site": SiteGraph(site.site_graph.paths),
              "site_unfused": SiteGraph(site.site_graph.paths, fuse=0)}
    described = {m: g.describe().splitlines()[0] for m, g in graphs.items()}
    times = {m: [] for m in MODES}
    counts = {m: dict.fromkeys(COUNTS, 0) for m in MODES if m != "eager"}
    for c in range(chunks):
        for mode in (MODES if c % 2 == 0 else MODES[::-1]):
            if mode == "eager":
                for _ in range(3):
                    twin.step(i)
                    i += 1
                for _ in range(steps):
                    t = time.perf_counter()
                    twin.step(i)
                    times[mode].append(time.perf_counter() - t)
                    i += 1
                continue
            terra.config(site_graph=mode != "path")
            site.site_graph = graphs.get(mode)
            for _ in range(3):
                prog.step(i)
                i += 1
            terra.end_iteration()
            before = terra.stats()
            for _ in range(steps):
                t = time.perf_counter()
                prog.step(i)
                times[mode].append(time.perf_counter() - t)
                i += 1
            terra.end_iteration()
            after = terra.stats()
            for k in COUNTS:
                counts[mode][k] += after[k] - before[k]
    terra.config(**old)
    rows = {}
    for mode, ts in times.items():
        ms = 1e3 * np.asarray(ts)
        rows[mode] = {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
                      "p90_ms": float(np.percentile(ms, 90)), "steps": len(ts),
                      "graph": described.get(mode), "stats": counts.get(mode)}
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--steps", type=int, default=15)
    args = ap.parse_args(argv)
    rows = run(args.warmup, args.chunks, args.steps)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "warmup": args.warmup,
            "chunks": args.chunks, "steps": args.steps, "python": platform.python_version(),
            "cpus": os.cpu_count()}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "site_graph_steady.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    path = rows["path"]["median_ms"]
    lines = [f"sdpoint steady state ({meta['date']}, {meta['cpus']} CPUs; {args.warmup} warm-up "
             f"steps, then {args.chunks} chunks of {args.steps} timed steps per mode, order "
             f"turned around each chunk; `python -m benchmarks.site_graph_steady`)", "",
             "| mode | median ms | p10-p90 | / path graphs | counts (case / restarts, fallbacks, "
             "builds) |", "|---|---|---|---|---|"]
    for mode in MODES:
        r = rows[mode]
        s = r["stats"]
        cnt = (f"{s['case_switches']} / {s['path_switches']}, {s['fallbacks']}, "
               f"{s['graph_builds']}") if s else ""
        lines.append(f"| {mode} | {r['median_ms']:.1f} | {r['p10_ms']:.1f}-{r['p90_ms']:.1f} | "
                     f"{r['median_ms'] / path:.2f} | {cnt} |")
    lines += [""] + [f"- {m}: {rows[m]['graph']}" for m in ("site", "site_unfused")]
    with open(os.path.join(RESULTS, "site_graph_steady.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
