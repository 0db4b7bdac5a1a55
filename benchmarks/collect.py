"""Collect the latest benchmark reports into benchmarks/RESULTS.md.

Each harness writes its own markdown next to its JSON in benchmarks/results/ (with the machine,
versions and date of its run); this stitches them into one page, in a fixed order, so that the
page always shows exactly what the last runs measured. Usage: `python -m benchmarks.collect`.
"""
from __future__ import annotations

import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# (report file, the command that produces it)
SECTIONS = (
    ("results.md", "make bench  (python -m benchmarks.run)"),
    ("dynamic/results.md", "python -m benchmarks.run --programs sdpoint,gpt2,fasterrcnn_like "
     "--modes eager,function,terra --steps 100 --out benchmarks/results/dynamic"),
    ("coexec.md", "python -m benchmarks.coexec"),
    ("ratio.md", "make bench-ratio (python -m benchmarks.ratio)"),
    ("breakdown.md", "make bench-breakdown (python -m benchmarks.breakdown)"),
    ("limits.md", "make bench-limits (python -m benchmarks.limits)"),
    ("skeleton.md", "python -m benchmarks.skeleton"),
    ("site_graph_heads.md", "python -m benchmarks.site_graph_heads"),
    ("site_build_growth.md", "python -m benchmarks.site_build_growth"),
    ("hook_overhead.md", "python -m benchmarks.hook_overhead"),
    ("latency.md", "make bench-latency (python -m benchmarks.latency)"),
    ("pipeline.md", "python benchmarks/pipeline.py"),
    ("ada_grouper.md", "make bench-ada-grouper (python benchmarks/ada_grouper.py)"),
    ("ada_grouper_cluster.md", "unshare -rn sh -c 'ip link set lo up && python benchmarks/ada_grouper.py --cluster'"),
    ("real.md", "make bench-real  (python -m benchmarks.real)"),
    ("fit.md", "make bench-fit  (python -m benchmarks.fit)"),
    ("soak.md", "make bench-soak  (python -m benchmarks.soak)"),
)


def _demote(markdown: str) -> str:
    """Shift every heading one level down so each report nests under its section."""
    out = []
    for line in markdown.splitlines():
        out.append("#" + line if line.startswith("#") else line)
    return "\n".join(out)


def collect(results_dir: str = RESULTS) -> str:
    parts = ["# Benchmark results",
             "",
             "The latest run of each benchmark, as its harness wrote it (each section names its "
             "machine, versions and date). Regenerate with `python -m benchmarks.collect` after "
             "running them. Collected on: "
             f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}.",
             ""]
    missing = []
    for name, command in SECTIONS:
        path = os.path.join(results_dir, name)
        if not os.path.exists(path):
            missing.append(f"- `{name}`: not run yet (`{command}`)")
            continue
        with open(path, encoding="utf-8") as f:
            body = f.read().strip()
        rel = os.path.relpath(path, HERE)
        parts += [f"<!-- from {rel}, produced by: {command} -->", _demote(body), ""]
    if missing:
        parts += ["## Not run yet", "", *missing, ""]
    return "\n".join(parts)


def main(argv=None) -> int:
    text = collect()
    out = os.path.join(HERE, "RESULTS.md")
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
