"""Steady-state step time: eager vs tf.function vs Terra co-execution (with pipelined iterations,
and without: `overlap_iterations=False`) vs Terra "lazy evaluation".

    python -m benchmarks.coexec [--steps 30] [--warmup 8] [--quick] [--repeats 1]

Two programs written as eager training loops: a CNN (batch 32, 32x32x3, four conv layers) and a
small transformer encoder. All variants run in the same process: eager, tf.function and Terra
(default settings) take turns, a chunk of steps each, so their ratios come from the same minutes
on the shared machine; then Terra without overlap and Terra lazy, one after another (each from a
fresh `terra.reset()`: they change Terra's settings). `--repeats N` does that N times and pools
the steps. Reports medians and spread (p10/p90) of per-step wall time after warm-up, Terra's
stats (traces, fallbacks, stalls), and the cost of the variable snapshot a run takes where its
graph's writes cannot wait for the commit (terra/compiler/commit.py). Writes
benchmarks/results/coexec.json and coexec.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.fallback import Snapshot  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# ------------------------------------------------------------------------------------ programs
def cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.layers.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10)])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=(32,)).astype(np.int32)
    return model, (x, y)


class EncoderBlock(keras.layers.Layer):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(heads, d // heads)
        self.n1 = keras.layers.LayerNormalization()
        self.n2 = keras.layers.LayerNormalization()
        self.f1 = keras.layers.Dense(ff, activation="relu")
        self.f2 = keras.layers.Dense(d)

    def call(self, x):
        x = self.n1(x + self.att(x, x))
        return self.n2(x + self.f2(self.f1(x)))


def transformer():
    keras.utils.set_random_seed(0)
    inp = keras.layers.Input((16,), dtype="int32")
    h = keras.layers.Embedding(100, 32)(inp)
    h = EncoderBlock(32, 4, 64)(h)
    h = EncoderBlock(32, 4, 64)(h)
    out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inp, out)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 100, size=(16, 16)).astype(np.int32)
    y = rng.integers(0, 10, size=(16,)).astype(np.int32)
    return model, (x, y)


PROGRAMS = {"cnn": cnn, "transformer": transformer}


# ------------------------------------------------------------------------------------ variants
def make_step(model, opt, tape_cls):
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def variant(name, builder):
    model, (x, y) = builder()
    opt = keras.optimizers.Adam(1e-3)
    if name == "eager":
        step = make_step(model, opt, tf.GradientTape)
    elif name == "tf.function":
        step = tf.function(make_step(model, opt, tf.GradientTape))
    else:
        step = make_step(model, opt, tf.TerraGradientTape)
    return step, (x, y), model, opt


INTERLEAVED = ("eager", "tf.function", "terra")  # side by side, in chunks of CHUNK steps
CHUNK = 10


def _record(times, warm_s, steps):
    return {"median_ms": 1e3 * float(np.median(times)),
            "p10_ms": 1e3 * float(np.percentile(times, 10)),
            "p90_ms": 1e3 * float(np.percentile(times, 90)), "min_ms": 1e3 * float(np.min(times)),
            "warmup_s": warm_s, "steps": steps, "times_ms": [1e3 * t for t in times]}


def _snapshot_ms(model, opt):
    """What the variable snapshot a run without commit-gated writes takes costs (eager call)."""
    vars_ = [v.value if hasattr(v, "value") and not isinstance(v, tf.Variable) else v
             for v in list(model.variables) + list(opt.variables)]
    snap = Snapshot([getattr(v, "_value", v) for v in vars_])
    snap.take()
    t = time.perf_counter()
    for _ in range(10):
        snap.take()
    return 1e3 * (time.perf_counter() - t) / 10


def run_interleaved(prog, steps, warmup):
    """eager, tf.function and Terra (default settings) side by side: each warms up, then they
    take turns, CHUNK steps at a time, so that load changes on the shared machine hit all three
    alike and their ratios come from the same minutes (Terra's iteration is ended after each of
    its chunks)."""
    builder = PROGRAMS[prog]
    terra.reset()
    made = {name: variant(name, builder) for name in INTERLEAVED}
    warm, times = {}, {name: [] for name in INTERLEAVED}
    for name, (step, (x, y), _, _) in made.items():
        t = time.perf_counter()
        for _ in range(warmup):
            float(step(x, y))
        terra.end_iteration()
        warm[name] = time.perf_counter() - t
    before = terra.stats()
    done = 0
    while done < steps:
        n = min(CHUNK, steps - done)
        for name, (step, (x, y), _, _) in made.items():
            for _ in range(n):
                t = time.perf_counter()
                float(step(x, y))  # every variant materializes the loss once per step
                times[name].append(time.perf_counter() - t)
            if name == "terra":
                terra.end_iteration()
        done += n
    after = terra.stats()
    out = {name: _record(times[name], warm[name], steps) for name in INTERLEAVED}
    out["terra"]["stats"] = {k: (after[k] - before[k] if isinstance(after[k], (int, float))
                                 else after[k]) for k in after}
    out["terra"]["stats_total"] = after
    _, _, model, opt = made["terra"]
    out["terra"]["snapshot_ms"] = _snapshot_ms(model, opt)
    for name, rec in out.items():
        print(f"  {prog:12s} {name:14s} median {rec['median_ms']:8.2f} ms  "
              f"p10 {rec['p10_ms']:8.2f}  p90 {rec['p90_ms']:8.2f}", flush=True)
    terra.reset()
    return out


def run_rounds(prog, names, steps, warmup):
    """Each of `names` runs `warmup` then `steps` steps, one after another (each from a fresh
    `terra.reset()`: these change Terra's settings)."""
    builder = PROGRAMS[prog]
    out = {}
    for name in names:
        terra.reset()
        terra.config(coexecution=name != "terra (lazy)",
                     overlap_iterations=name != "terra (no overlap)")
        step, (x, y), model, opt = variant(name, builder)
        t_build = time.perf_counter()
        for _ in range(warmup):
            float(step(x, y))
        warm_s = time.perf_counter() - t_build
        before = terra.stats()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = step(x, y)
            float(loss)  # every variant materializes the loss once per step
            times.append(time.perf_counter() - t)
        after = terra.stats()
        terra.end_iteration()
        rec = _record(times, warm_s, steps)
        if name.startswith("terra"):
            rec["stats"] = {k: (after[k] - before[k] if isinstance(after[k], (int, float)) else after[k])
                            for k in after}
            rec["stats_total"] = after
        out[name] = rec
        print(f"  {prog:12s} {name:14s} median {rec['median_ms']:8.2f} ms  "
              f"p10 {rec['p10_ms']:8.2f}  p90 {rec['p90_ms']:8.2f}", flush=True)
    terra.config(coexecution=True, overlap_iterations=True)
    terra.reset()
    return out


def pool(recs):
    """One record from the same variant's records of several repeats (steps pooled)."""
    times = [t for r in recs for t in r["times_ms"]]
    out = dict(recs[-1])
    out.update(median_ms=float(np.median(times)), p10_ms=float(np.percentile(times, 10)),
               p90_ms=float(np.percentile(times, 90)), min_ms=float(np.min(times)),
               steps=len(times), times_ms=times,
               repeat_medians_ms=[r["median_ms"] for r in recs])
    if "stats" in recs[-1]:
        out["stats"] = {k: (sum(r["stats"][k] for r in recs) if isinstance(v, (int, float))
                            else v) for k, v in recs[-1]["stats"].items()}
    return out


def markdown(results, meta) -> str:
    lines = ["# Co-execution benchmark (benchmarks/coexec.py)", "",
             f"{meta['machine']}; TF {meta['tf']}; {meta['steps']} timed steps per variant after "
             f"{meta['warmup']} warm-up steps, in {meta.get('repeats', 1)} repeat(s); one "
             f"process; eager, tf.function and terra take turns, {CHUNK} steps at a time (their "
             f"ratios come from the same minutes), the other variants run after them.", "",
             "| program | variant | median ms | p10 | p90 | vs eager | vs tf.function |",
             "|---|---|---|---|---|---|---|"]
    for prog, res in results.items():
        e = res["eager"]["median_ms"]
        f = res["tf.function"]["median_ms"]
        for name, r in res.items():
            lines.append(f"| {prog} | {name} | {r['median_ms']:.2f} | {r['p10_ms']:.2f} | "
                         f"{r['p90_ms']:.2f} | {e / r['median_ms']:.2f}x | "
                         f"{r['median_ms'] / f:.2f} |")
    lines += ["", "Terra counters over the timed steps, ms per step (traces and fallbacks: whole "
              "run, last repeat; overlapped: iterations that ended without waiting for their "
              "graph):", "",
              "| program | variant | traces | fallbacks | overlapped | python exec | python stall | "
              "graph exec | graph stall | snapshot ms (eager call) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for prog, res in results.items():
        for name, r in res.items():
            if "stats" in r:
                s, n = r["stats"], r["steps"]
                lines.append(f"| {prog} | {name} | {r['stats_total']['traces']} | "
                             f"{r['stats_total']['fallbacks']} | "
                             f"{s.get('overlapped_iterations', 0)} | "
                             f"{1e3 * s['python_exec_s'] / n:.2f} | "
                             f"{1e3 * s['python_stall_s'] / n:.2f} | "
                             f"{1e3 * s['graph_exec_s'] / n:.2f} | "
                             f"{1e3 * s['graph_stall_s'] / n:.2f} | "
                             f"{r.get('snapshot_ms', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="10 steps, 5 warm-up")
    ap.add_argument("--programs", default="cnn,transformer")
    ap.add_argument("--repeats", type=int, default=1, help="run the variant sequence N times")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.quick:
        args.steps, args.warmup = 10, 5
    names = list(INTERLEAVED) + ["terra (no overlap)", "terra (lazy)"]
    results = {}
    for prog in args.programs.split(","):
        runs = [{**run_interleaved(prog, args.steps, args.warmup),
                 **run_rounds(prog, names[len(INTERLEAVED):], args.steps, args.warmup)}
                for _ in range(args.repeats)]
        results[prog] = {name: pool([r[name] for r in runs]) for name in names}
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "tf": tf.__version__,
            "steps": args.steps * args.repeats, "warmup": args.warmup,
            "repeats": args.repeats}
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "coexec.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    md = markdown(results, meta)
    with open(os.path.join(RESULTS, "coexec.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
