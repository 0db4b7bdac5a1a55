"""A random head after a mid-step read: eager, path graphs, the site graph and "auto".

    python -m benchmarks.read_then_branch [--steps 150] [--rounds 2]

The program: two 32-filter convolutions and a global average pool on a 32x32x3 batch of 32, a
`float()` read of the loss (a logging check), then one of three Dense heads chosen by Python's
`random`, SGD. With path graphs each change of head cancels a run that has computed the trunk
for the read, and the restart computes it again; with the site graph the head is a Case-Select
put. "auto" (`site_graph`'s default) takes the site graph once the restarts have thrown away as
much graph time as its build costs. A fixed head gives the step without any switch. Each block
is a fresh process; modes alternate within a round, in the opposite order the next round.
Reported per mode: the median step of the last third of the steps (median over rounds, and
the rounds' range), Terra's counts, and the iteration at which "auto" took the site graph.
Writes benchmarks/results/read_then_branch.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("eager", "path", "site", "auto", "fixed")
SETTING = {"path": False, "site": True, "auto": "auto", "fixed": "auto"}
COUNTS = ("traces", "fallbacks", "graph_builds", "case_switches", "path_switches")


def child(mode: str, steps: int) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import random

    import keras
    import tensorflow as tf

    import terra
    if mode != "eager":
        terra.config(site_graph=SETTING[mode])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                              keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    model(tf.zeros((1, 32, 32, 3)))
    heads = [keras.layers.Dense(10) for _ in range(3)]
    for h in heads:
        h(tf.zeros((1, 10)))
    opt = keras.optimizers.SGD(0.01)
    opt.build(model.trainable_variables + [v for h in heads for v in h.trainable_variables])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tape_cls = tf.GradientTape if mode == "eager" else tf.TerraGradientTape
    pick = random.Random(0)
    logged = []
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        with tape_cls() as tape:
            logits = model(x, training=True)
            base = loss_fn(y, logits)
            logged.append(float(base))  # the mid-step read
            k = 0 if mode == "fixed" else pick.randrange(3)
            loss = base + 0.1 * tf.reduce_mean(tf.square(heads[k](logits)))
        variables = model.trainable_variables + heads[k].trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        float(loss)
        times.append(time.perf_counter() - t)
    out = {"median_ms": 1e3 * float(np.median(times[-(steps // 3):]))}
    if mode != "eager":
        terra.end_iteration()
        s = terra.stats()
        out["stats"] = {k: s[k] for k in COUNTS}
        took = [line for line in terra.explain().splitlines() if "the site takes a site graph" in line]
        out["auto_at"] = int(took[0].split(" iteration ")[1].split(":")[0]) if took else None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    blocks: dict = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            cmd = [sys.executable, "-m", "benchmarks.read_then_branch", "--child",
                   json.dumps([mode, args.steps])]
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
            blocks[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    lines = [f"A random head after a mid-step read ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"{os.cpu_count()} CPUs, {args.rounds} rounds of {args.steps} steps; median ms of "
             f"the last third of the steps, median [range] over rounds; "
             f"`python -m benchmarks.read_then_branch`)", ""]
    eager = float(np.median([b["median_ms"] for b in blocks["eager"]]))
    for mode in MODES:
        ms = [b["median_ms"] for b in blocks[mode]]
        med = float(np.median(ms))
        line = f"{mode:6s} {med:7.2f} [{min(ms):.2f}-{max(ms):.2f}]  x{eager / med:.2f} of eager"
        last = blocks[mode][-1]
        if "stats" in last:
            line += "  " + ", ".join(f"{k} {v}" for k, v in last["stats"].items())
        if mode == "auto":
            line += f"; site graph taken at iterations {[b['auto_at'] for b in blocks[mode]]}"
        lines.append(line)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "read_then_branch.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
