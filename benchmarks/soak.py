"""Soak and faults: a long run with branch changes, shape changes, injected op errors and
interrupts, eager against Terra in one process; reports memory and thread growth, step-time
drift and equality with eager.

    python -m benchmarks.soak [--steps 5000] [--quick]

The program is a small Keras MLP trained with SGD whose every step draws from a seeded NumPy
generator: a Python-random branch (an extra L2 term on 30% of the steps), a batch of 12 rows
instead of 16 on every 7th step (another feed shape, another path), an out-of-range label on
every 97th step inside a `try` around the forward (the `except` trains on the plain loss), and
a `KeyboardInterrupt` raised in the tape body on every 331st step and caught around the step
(the step is skipped). Eager and Terra run the same program from the same seed, one after the
other; their losses, caught errors, interrupted steps, optimizer iterations and weights are
compared exactly. For Terra: resident memory (from /proc/self/statm) and the process's thread
count after the warm-up (the first 10% of the steps) and at the end, and the median step time
of each tenth of the run (drift: last tenth over the second). Writes benchmarks/results/
soak.json and soak.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
_TABLE = tf.constant([1.0, 2.0, 3.0])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def program(Tape, steps, probe=None):
    """The soak program; `probe(step)` is called after every step (Terra's measurements)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.01)
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    xs = rng.normal(size=(64, 16, 8)).astype("float32")
    losses, caught, interrupted = [], [], []
    for step in range(steps):
        rows = 12 if step % 7 == 6 else 16
        x = tf.constant(xs[step % 64, :rows])
        y = rng.integers(0, 3, rows)
        if step % 97 == 96:
            y[0] = 7
        y = tf.constant(y, dtype=tf.int32)
        extra = rng.random() < 0.3
        try:
            with Tape() as tape:
                logits = model(x, training=True)
                try:
                    loss = lossf(y, logits) + tf.reduce_mean(tf.gather(_TABLE, y)) * 0.0
                except tf.errors.InvalidArgumentError as e:
                    caught.append((step, type(e).__name__))
                    loss = tf.reduce_mean(logits ** 2)
                if extra:
                    loss = loss + 1e-3 * tf.add_n([tf.reduce_sum(w ** 2)
                                                   for w in model.trainable_variables])
                if step % 331 == 330:
                    raise KeyboardInterrupt
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        except KeyboardInterrupt:
            interrupted.append(step)
            continue
        losses.append(float(loss))
        if probe is not None:
            probe(step)
    return {"losses": losses, "caught": caught, "interrupted": interrupted,
            "iterations": int(opt.iterations), "weights": [w.numpy() for w in model.weights]}


def _equal(a, b) -> bool:
    return (a["losses"] == b["losses"] and a["caught"] == b["caught"] and
            a["interrupted"] == b["interrupted"] and a["iterations"] == b["iterations"] and
            all(np.array_equal(x, y) for x, y in zip(a["weights"], b["weights"])))


def measure(steps):
    terra.reset()   # an iteration left open by earlier work would record the eager reference run
    t = time.perf_counter()
    eager = program(tf.GradientTape, steps)
    eager_s = time.perf_counter() - t
    terra.reset()
    warm = max(1, steps // 10)
    marks, times = {}, []
    last = [time.perf_counter()]

    def probe(step):
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now
        if step + 1 >= warm and "warm" not in marks:
            marks["warm"] = (_rss_bytes(), _threads())

    t = time.perf_counter()
    got = program(tf.TerraGradientTape, steps, probe)
    terra.end_iteration()
    terra_s = time.perf_counter() - t
    marks["end"] = (_rss_bytes(), _threads())
    stats = terra.stats()
    tenth = max(1, len(times) // 10)
    deciles = [statistics.median(times[i:i + tenth]) * 1e3
               for i in range(0, tenth * 10, tenth) if times[i:i + tenth]]
    (rss0, th0), (rss1, th1) = marks.get("warm", marks["end"]), marks["end"]
    return {
        "steps": steps, "equal_to_eager": _equal(eager, got),
        "losses_compared": len(eager["losses"]), "caught_errors": len(got["caught"]),
        "interrupts": len(got["interrupted"]),
        "eager_s": eager_s, "terra_s": terra_s,
        "rss_after_warmup_mb": rss0 / 2**20, "rss_end_mb": rss1 / 2**20,
        "rss_growth_pct": 100.0 * (rss1 - rss0) / rss0,
        "threads_after_warmup": th0, "threads_end": th1,
        "step_ms_by_tenth": deciles,
        "drift": deciles[-1] / deciles[1] if len(deciles) > 2 else None,
        "terra": {k: stats[k] for k in ("traces", "graph_builds", "graph_reuses", "fallbacks",
                                        "path_switches", "iterations")},
    }


def markdown(r, meta) -> str:
    rows = [
        ("equal to eager (losses, caught errors, interrupts, iterations, weights)",
         "yes" if r["equal_to_eager"] else "**no**"),
        ("steps / losses compared / caught op errors / interrupts",
         f"{r['steps']} / {r['losses_compared']} / {r['caught_errors']} / {r['interrupts']}"),
        ("whole run: eager s / Terra s", f"{r['eager_s']:.1f} / {r['terra_s']:.1f}"),
        ("RSS after warm-up -> end (MiB)",
         f"{r['rss_after_warmup_mb']:.0f} -> {r['rss_end_mb']:.0f} "
         f"({r['rss_growth_pct']:+.1f}%)"),
        ("threads after warm-up -> end", f"{r['threads_after_warmup']} -> {r['threads_end']}"),
        ("median step ms per tenth of the run",
         " ".join(f"{x:.2f}" for x in r["step_ms_by_tenth"])),
        ("drift (last tenth / second tenth)",
         "-" if r["drift"] is None else f"x{r['drift']:.2f}"),
        ("Terra counts", ", ".join(f"{k} {v}" for k, v in r["terra"].items())),
    ]
    out = [f"# Soak: {r['steps']} steps with branch and shape changes, op errors and interrupts",
           "", f"{meta['date']}, {meta['machine']}; TF {meta['tf']}, Keras {meta['keras']}. "
           "One run (benchmarks/soak.py says what the program does).", "",
           "| measure | value |", "|---|---|"]
    out += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--quick", action="store_true", help="600 steps")
    ap.add_argument("--out", default=RESULTS, help="directory for soak.json and soak.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps = 600
    if args.steps < 20:
        ap.error("--steps must be >= 20")
    r = measure(args.steps)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "tf": tf.__version__,
            "keras": keras.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump({"meta": meta, "result": r}, f, indent=2)
    md = markdown(r, meta)
    with open(os.path.join(args.out, "soak.md"), "w") as f:
        f.write(md)
    print(md)
    return 0 if r["equal_to_eager"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
