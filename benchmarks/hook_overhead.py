"""Per-op cost of eager execution, the idle hook, recording, and the replayed graph.

    python -m benchmarks.hook_overhead [--quick]

A chain of N ops (`y = op(y, x)` in a Python loop) is timed R times per variant; the per-op
figure is the chain time / N, reported as median and spread (min / max over repeats). Also times
one small Keras training step eagerly and while recording. Writes
benchmarks/results/hook_overhead.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.compiler import compile_trace  # noqa: E402
from terra.tracing import Recorder, hook  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _chain(op, x, y, n):
    for _ in range(n):
        y = op(y, x)
    return y


def _stats(samples_us):
    return {"median_us": statistics.median(samples_us), "min_us": min(samples_us),
            "max_us": max(samples_us), "repeats": len(samples_us)}


def _time(fn, n_ops, repeats):
    fn()  # warm up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) / n_ops * 1e6)
    return _stats(out)


def bench_case(name, op, shape, n, repeats):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=shape).astype("float32") * 1e-3)
    y0 = tf.constant(rng.normal(size=shape).astype("float32") * 1e-3)
    res = {"eager": _time(lambda: _chain(op, x, y0, n), n, repeats)}
    hook.install()
    try:
        res["eager, hook installed (idle)"] = _time(lambda: _chain(op, x, y0, n), n, repeats)
    finally:
        hook.uninstall()

    def recording(track_loops):
        def run():
            with Recorder(track_loops=track_loops):
                _chain(op, x, y0, n)
        return run
    res["recording (hook + location + loop tracking)"] = _time(recording(True), n, repeats)
    res["recording without loop tracking"] = _time(recording(False), n, repeats)

    with Recorder() as rec:
        out = _chain(op, x, y0, n)
    fn = compile_trace(rec.trace, [rec.ref_of(out)])
    feeds = list(rec.trace.feed_values)
    res["replayed graph"] = _time(lambda: fn(feeds), n, repeats)
    return {"case": name, "ops_per_chain": n, "variants": res}


def bench_keras_step(repeats):
    import keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = tf.random.stateless_normal((32, 32), seed=(1, 2))
    y = tf.zeros((32,), tf.int32)

    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    step()
    with Recorder() as rec:
        step()
    n = len(rec.trace)

    def recording(track_loops):
        def run():
            with Recorder(track_loops=track_loops):
                step()
        return run
    res = {"eager": _time(step, 1, repeats),
           "recording (hook + location + loop tracking)": _time(recording(True), 1, repeats),
           "recording without loop tracking": _time(recording(False), 1, repeats)}
    fn = compile_trace(rec.trace)
    feeds = list(rec.trace.feed_values)
    res["replayed graph"] = _time(lambda: fn(feeds), 1, repeats)
    for v in res.values():  # per step, in ms
        for k in ("median_us", "min_us", "max_us"):
            v[k.replace("_us", "_ms")] = v.pop(k) / 1e3
    return {"case": f"Keras MLP training step (32x32 -> 64 -> 10, Adam; {n} ops)",
            "variants": res}


def bench_skip(n, repeats):
    """Skip mode's cost per op: a training step of 2n elementwise ops on a 2x2 value under the
    tape (`h = h * 0.999 + 0.001`), compiled and co-executed by Terra, against eager and
    tf.function. The graph's share is about a microsecond an op (replayed graph, above): the
    rest is the program's thread matching each op. Written as operators, the ops are matched
    straight from the placeholder (runtime/python_runner.py `_OPERATORS`); written as
    `tf.multiply` / `tf.add` calls, the same ops (one path, one graph) first take TF's API route
    (dispatch, conversion of the number)."""
    import keras
    import terra
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(2, 2)).astype("float32"))
    x = tf.constant(rng.normal(size=(2, 2)).astype("float32"))
    opt = keras.optimizers.SGD(1e-4)

    def operators(h):
        return h * 0.999 + 0.001

    def api(h):
        return tf.add(tf.multiply(h, 0.999), 0.001)

    def step(Tape, arith):
        with Tape() as tape:
            h = x * w
            for _ in range(n):
                h = arith(h)
            loss = tf.reduce_sum(h)
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

    def timed(Tape, arith, warmup=6):
        for _ in range(warmup):
            step(Tape, arith)
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step(Tape, arith)
            out.append((time.perf_counter() - t0) / (2 * n) * 1e6)
        return _stats(out)

    res = {"eager": timed(tf.GradientTape, operators)}
    function = tf.function(step)
    res["tf.function"] = _time(lambda: function(tf.GradientTape, operators), 2 * n, repeats)
    terra.reset()
    before = terra.stats()
    res["Terra, operators"] = timed(tf.TerraGradientTape, operators)
    res["Terra, tf.multiply / tf.add"] = timed(tf.TerraGradientTape, api, warmup=2)
    terra.end_iteration()
    after = terra.stats()
    counts = {k: after[k] - before[k] for k in ("traces", "fallbacks", "graph_builds")}
    terra.reset()
    return {"case": f"skip mode: h * 0.999 + 0.001 under the tape, 2x2, Terra compiled "
                    f"(traces / fallbacks / builds {counts['traces']} / {counts['fallbacks']} / "
                    f"{counts['graph_builds']})", "ops_per_chain": 2 * n, "variants": res}


def to_markdown(results) -> str:
    lines = ["# Hook overhead", "",
             f"TF {results['tf']}, Python {results['python']}, {results['machine']}. "
             "Per-op microseconds: median (min-max) over repeats; noisy shared machine.", ""]
    for case in results["cases"]:
        lines += [f"## {case['case']} ({case['ops_per_chain']} ops per chain)", "",
                  "| variant | median us/op | min | max |", "|---|---|---|---|"]
        for k, v in case["variants"].items():
            lines.append(f"| {k} | {v['median_us']:.2f} | {v['min_us']:.2f} | {v['max_us']:.2f} |")
        lines.append("")
    step = results["keras_step"]
    lines += [f"## {step['case']}", "", "| variant | median ms/step | min | max |",
              "|---|---|---|---|"]
    for k, v in step["variants"].items():
        lines.append(f"| {k} | {v['median_ms']:.2f} | {v['min_ms']:.2f} | {v['max_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer ops and repeats")
    args = p.parse_args(argv)
    n, repeats = (50, 5) if args.quick else (200, 15)
    results = {"tf": tf.__version__, "python": platform.python_version(),
               "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start",
               "cases": [bench_case("add 2x2", tf.add, (2, 2), n, repeats),
                         bench_case("matmul 256x256", tf.matmul, (256, 256), n, repeats)],
               "keras_step": bench_keras_step(repeats)}
    results["cases"].append(bench_skip(n, repeats))
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "hook_overhead.json"), "w") as f:
        json.dump(results, f, indent=2)
    md = to_markdown(results)
    with open(os.path.join(RESULTS, "hook_overhead.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
