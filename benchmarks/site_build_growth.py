"""What each site graph build costs as a site gains paths, beside the new path's own graph.

    python -m benchmarks.site_build_growth [--steps 45] [--size bench]

sdpoint (a downsampling point drawn with Python's `random` every step) with `site_graph=True`:
each newly compiled path first gets its own path graph, then the site graph is built again over
every compiled path (terra/runtime/site_graph.py: the TraceGraph is extended by the new trace,
but lowering and instantiation redo the whole site). For every build: the paths it covers, the
records they hold, the seconds of lowering (merge, lowering, the concrete function) and of its
first instantiation (Grappler, executor), and for the path graphs the same two. A build whose
cost grows with the site's size, not with the new path's ops, is what "Builds off the critical
path" (issue "Dynamic programs at graph speed", Deliver 2) asks to change; this measures where
it stands. Writes benchmarks/results/site_build_growth.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run(steps: int, size: str) -> dict:
    """Run sdpoint under `site_graph=True` for `steps` steps, timing every graph build."""
    import tensorflow as tf

    import terra
    from benchmarks.programs import sdpoint
    from terra.runtime import graph_runner, path_graph, site_graph

    builds, by_fn = [], {}

    def timed_init(cls, kind):
        init = cls.__init__

        def wrapper(self, *args, **kwargs):
            t = time.perf_counter()
            init(self, *args, **kwargs)
            row = {"kind": kind, "lower_s": time.perf_counter() - t, "instantiate_s": None}
            if kind == "site graph":
                row["paths"] = len(self.paths)
                row["records"] = sum(len(t.records) for t in self.traces)
                row["merged"] = self.merged_traces
            else:
                row["paths"] = 1
                row["records"] = len(self.path.trace.records) if getattr(self, "path", None) \
                    is not None else len(args[0].trace.records)
            builds.append(row)
            by_fn[id(self.concrete)] = row
        return init, wrapper

    instantiate = graph_runner.GraphRunner._instantiate

    def timed_instantiate(self, warm):
        t = time.perf_counter()
        try:
            return instantiate(self, warm)
        finally:
            row = by_fn.get(id(warm.fn))
            if row is not None and row["instantiate_s"] is None:
                row["instantiate_s"] = time.perf_counter() - t

    patched = [(site_graph.SiteGraph, *timed_init(site_graph.SiteGraph, "site graph")),
               (path_graph.PathGraph, *timed_init(path_graph.PathGraph, "path graph"))]
    old = terra.config(site_graph=True)
    try:
        for cls, _, wrapper in patched:
            cls.__init__ = wrapper
        graph_runner.GraphRunner._instantiate = timed_instantiate
        prog = sdpoint.build(tf.TerraGradientTape, size=size)
        t0 = time.perf_counter()
        for i in range(steps):
            prog.step(i)
        terra.end_iteration()
        wall = time.perf_counter() - t0
        s = terra.stats()
    finally:
        for cls, init, _ in patched:
            cls.__init__ = init
        graph_runner.GraphRunner._instantiate = instantiate
        terra.config(**old)
    return {"builds": builds, "wall_s": wall, "steps": steps, "size": size,
            "counts": {k: s[k] for k in ("traces", "fallbacks", "graph_builds",
                                         "case_switches", "path_switches")}}


def markdown(res: dict, meta: dict) -> str:
    lines = ["# Site graph builds as a site gains paths (benchmarks/site_build_growth.py)", "",
             f"{meta['machine']}; TF {meta['tf']}; {meta['date']}; sdpoint at size "
             f"{res['size']}, `site_graph=True`, {res['steps']} steps in {res['wall_s']:.1f} s; "
             "counts over the run: " + ", ".join(f"{k} {v}" for k, v in res["counts"].items())
             + ".", "",
             "Every build in order. lower: merge, lowering and the concrete function (Python, on "
             "the program's thread); instantiate: the first instantiation of its function "
             "(Grappler and the executor); n/a: not instantiated before the run ended.", "",
             "| # | graph | paths | records | lower s | instantiate s | total s |",
             "|---|---|---|---|---|---|---|"]
    for k, b in enumerate(res["builds"], 1):
        inst = b["instantiate_s"]
        total = b["lower_s"] + (inst or 0.0)
        lines.append(f"| {k} | {b['kind']} | {b['paths']} | {b['records']} | {b['lower_s']:.2f} | "
                     f"{'n/a' if inst is None else f'{inst:.2f}'} | {total:.2f} |")
    site = [b for b in res["builds"] if b["kind"] == "site graph"]
    own = [b for b in res["builds"] if b["kind"] == "path graph"]
    if site and own:
        per_path = sum(b["lower_s"] for b in own) / len(own)
        lines += ["", f"A path graph's lowering: {per_path:.2f} s on average over {len(own)}. "
                  "The site graph's, by the paths it covers: " + ", ".join(
                      f"{b['paths']} paths {b['lower_s']:.2f} s" for b in site) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--size", default="bench")
    args = ap.parse_args(argv)
    import tensorflow as tf
    res = run(args.steps, args.size)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "tf": tf.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "site_build_growth.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, **res}, f, indent=1)
    md = markdown(res, meta)
    with open(os.path.join(RESULTS, "site_build_growth.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
