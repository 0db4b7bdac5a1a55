"""A random branch among Keras heads: the site graph against path graphs, and eager.

    python -m benchmarks.site_graph_heads [--rounds 2] [--steps 300] [--widths 64,512]

The program: a Sequential trunk of two Dense layers of width w, then one of three Sequential
heads (Dense 8/16/24 + Dense 1), Adam, `float(loss)` per step. The head is chosen by Python's
`random` before the trunk runs ("early": a path graph's restart costs nothing, the run is held
until Python has told the paths apart) or from a value of the trunk Python reads ("late": a
restart recomputes the trunk). Modes: eager, Terra with path graphs (`site_graph=False`),
Terra with the site graph (`site_graph=True`: a switch is a Case-Select put), and Terra's default
(`site_graph="auto"`: the site graph once restarts have thrown away runs Python read). Every (config, mode) block is
a fresh interpreter; modes alternate within a round, in the opposite order the next round. Per
block: the median step over the last 2/3 of the steps; per (config, mode): the median over the
rounds and the rounds' range, with Terra's counts. Writes
benchmarks/results/site_graph_heads.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("eager", "path", "site", "auto")
SETTING = {"path": False, "site": True, "auto": "auto"}
COUNTS = ("traces", "fallbacks", "graph_builds", "case_switches", "path_switches")


def child(mode: str, width: int, late: bool, steps: int) -> dict:
    """One block in this process; returns its step times and Terra's counts."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import random

    import keras
    import tensorflow as tf

    import terra
    if mode != "eager":
        terra.config(site_graph=SETTING[mode])
    keras.utils.set_random_seed(3)
    dense = keras.layers.Dense
    trunk = keras.Sequential([dense(width, activation="tanh"), dense(width, activation="tanh")])
    heads = [keras.Sequential([dense(8 * (j + 1), activation="relu"), dense(1)])
             for j in range(3)]
    inp = keras.Input((32,))
    for h in heads:
        h(trunk(inp))
    variables = trunk.trainable_variables + [v for h in heads for v in h.trainable_variables]
    opt = keras.optimizers.Adam(0.01)
    opt.build(variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    y = rng.normal(size=(64, 1)).astype(np.float32)
    rnd = random.Random(1)
    tape = tf.GradientTape if mode == "eager" else tf.TerraGradientTape
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        with tape() as g:
            h = trunk(x)
            k = int(float(tf.reduce_sum(h)) * 1000) % 3 if late else rnd.randrange(3)
            loss = tf.reduce_mean((heads[k](h) - y) ** 2)
        grads = g.gradient(loss, variables)
        opt.apply_gradients([(d, v) for d, v in zip(grads, variables) if d is not None])
        float(loss)
        times.append(time.perf_counter() - t)
    out = {"median_ms": 1e3 * float(np.median(times[steps // 3:]))}
    if mode != "eager":
        terra.end_iteration()
        s = terra.stats()
        out["stats"] = {k: s[k] for k in COUNTS}
    return out


def _block(mode, width, late, steps) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.site_graph_heads", "--child",
           json.dumps([mode, width, late, steps])]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--widths", default="64,512")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    configs = [(w, late) for w in map(int, args.widths.split(",")) for late in (False, True)]
    blocks = {}
    for r in range(args.rounds):
        for w, late in configs:
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                blocks.setdefault((w, late, mode), []).append(_block(mode, w, late, args.steps))
    rows = []
    for w, late in configs:
        row = {"width": w, "choice": "late" if late else "early"}
        for mode in MODES:
            ms = [b["median_ms"] for b in blocks[(w, late, mode)]]
            row[mode] = {"median_ms": float(np.median(ms)), "min_ms": min(ms), "max_ms": max(ms),
                         "stats": blocks[(w, late, mode)][-1].get("stats")}
        rows.append(row)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "rounds": args.rounds,
            "steps": args.steps, "python": platform.python_version(),
            "cpus": os.cpu_count()}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "site_graph_heads.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = ["## A random branch among Keras heads: path graphs, site graph, auto "
             "(benchmarks/site_graph_heads.py)", "",
             f"Random branch among Keras heads ({meta['date']}, {meta['cpus']} CPUs, "
             f"{args.rounds} rounds of {args.steps} steps; median ms of the last 2/3 of the "
             f"steps, median [range] over rounds; `python -m benchmarks.site_graph_heads`)", "",
             "| w | choice | eager | path graphs | site graph | auto | site / path | "
             "auto / path | counts path (case / restarts, builds) | counts site | "
             "counts auto |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(m):
        return f"{m['median_ms']:.2f} [{m['min_ms']:.2f}-{m['max_ms']:.2f}]"

    def counts(m):
        s = m["stats"]
        return f"{s['case_switches']} / {s['path_switches']}, {s['graph_builds']}"
    for row in rows:
        lines.append(f"| {row['width']} | {row['choice']} | {cell(row['eager'])} | "
                     f"{cell(row['path'])} | {cell(row['site'])} | {cell(row['auto'])} | "
                     f"{row['site']['median_ms'] / row['path']['median_ms']:.2f} | "
                     f"{row['auto']['median_ms'] / row['path']['median_ms']:.2f} | "
                     f"{counts(row['path'])} | {counts(row['site'])} | "
                     f"{counts(row['auto'])} |")
    with open(os.path.join(RESULTS, "site_graph_heads.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
