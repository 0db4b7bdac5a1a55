"""Where the skeleton's CPU goes, step section by step section, and what a TF op costs right after
the program's thread has waited for the graph.

    python -m benchmarks.skeleton [--steps 300] [--repeats 3]

Two measurements, both of the program's own thread (`time.thread_time`: CPU, not wall time, so
waits for the graph do not count):

1. Sections of a step. benchmarks/coexec.py's CNN and transformer, written as the eager loop
   they are (`tape`, `model(x)`, the loss, `tape.gradient`, `model.trainable_variables`,
   `apply_gradients`), each section timed, eager and Terra alternating by process. Under Terra,
   `model.trainable_variables` is the user's own Python (Keras walks the model's layers): it runs
   as it does eagerly, the part of the skeleton no co-execution can skip. The tape's entry
   ends the previous iteration (its commit, the wait for the previous run, the next run's start).
   A second, instrumented Terra run counts the feed channels' puts (an eager queue op each) and
   their CPU.
2. One op after a wait. A thread that sleeps, then runs one op: a FIFOQueue enqueue (what a
   feed put is), an AddV2 of two scalars, forty NumPy adds, a Python loop. On the machine these
   numbers come from, a TF op after the thread slept costs several times its cost in a tight
   loop; the skeleton's puts come after such waits every step.

Writes benchmarks/results/skeleton.json and skeleton.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SECTIONS = ("tape entry", "model(x)", "loss", "tape exit", "trainable_variables", "gradient",
            "apply_gradients")
SLEEPS_MS = (0.0, 0.5, 1.0, 2.0, 5.0)


# --------------------------------------------------------------------------- step sections
def _sections(prog: str, mode: str, steps: int, warmup: int, instrument: bool) -> dict:
    """Per-section thread CPU of `steps` steps (run in a process of its own: `main` spawns it)."""
    import keras
    import tensorflow as tf

    import terra
    from benchmarks import coexec

    model, (x, y) = coexec.PROGRAMS[prog]()
    opt = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tape_cls = tf.TerraGradientTape if mode == "terra" else tf.GradientTape
    clock = time.thread_time
    acc = np.zeros(len(SECTIONS))
    puts = {"n": 0, "cpu": 0.0}
    if instrument:
        from terra.compiler import channels
        put = channels.FeedChannel.put

        def timed_put(self, value, timeout=None):
            t = clock()
            try:
                return put(self, value, timeout)
            finally:
                puts["n"] += 1
                puts["cpu"] += clock() - t
        channels.FeedChannel.put = timed_put

    def step(record):
        t0 = clock()
        with tape_cls() as tape:
            t1 = clock()
            out = model(x, training=True)
            t2 = clock()
            loss = loss_fn(y, out)
            t3 = clock()
        t4 = clock()
        tv = model.trainable_variables
        t5 = clock()
        grads = tape.gradient(loss, tv)
        t6 = clock()
        opt.apply_gradients(zip(grads, tv))
        t7 = clock()
        if record:
            acc[:] += np.diff([t0, t1, t2, t3, t4, t5, t6, t7])
        return loss

    for _ in range(warmup):
        step(False)
    if mode == "terra":
        terra.end_iteration()
    puts["n"], puts["cpu"] = 0, 0.0
    c0, w0 = clock(), time.perf_counter()
    for _ in range(steps):
        step(True)
    if mode == "terra":
        terra.end_iteration()
    c1, w1 = clock(), time.perf_counter()
    out = {"sections_us": {k: 1e6 * v / steps for k, v in zip(SECTIONS, acc)},
           "thread_cpu_us": 1e6 * (c1 - c0) / steps, "wall_ms": 1e3 * (w1 - w0) / steps}
    if instrument:
        out["puts_per_step"] = puts["n"] / steps
        out["put_cpu_us"] = 1e6 * puts["cpu"] / max(1, puts["n"])
    if mode == "terra":
        s = terra.stats()
        out["counts"] = {k: s[k] for k in ("traces", "fallbacks", "graph_builds")}
    return out


def _spawn(*args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.skeleton", "--child", *map(str, args)]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    for line in res.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"benchmarks.skeleton child {args} failed:\n{res.stderr[-3000:]}")


# --------------------------------------------------------------------------- op after a wait
def _after_wait(reps: int) -> dict:
    import tensorflow as tf
    from tensorflow.python.ops import gen_data_flow_ops

    queue = tf.queue.FIFOQueue(reps * len(SLEEPS_MS) * 4 + 16, [tf.float32], shapes=[[]])
    token = tf.constant(1.0)
    a = tf.constant(1.0)
    arr = np.ones(16, np.float32)

    def enqueue():
        gen_data_flow_ops.queue_enqueue_v2(handle=queue.queue_ref, components=[token])

    def add():
        tf.raw_ops.AddV2(x=a, y=a)

    def numpy_adds():
        for _ in range(40):
            np.add(arr, arr)

    def python_loop():
        s = 0
        for i in range(300):
            s += i
        return s

    work = {"FIFOQueue enqueue (a feed put)": enqueue, "AddV2 of two scalars": add,
            "40 NumPy adds": numpy_adds, "Python loop (300 adds)": python_loop}
    out = {}
    for name, fn in work.items():
        for _ in range(20):
            fn()
        row = {}
        for sleep_ms in SLEEPS_MS:
            cpu = []
            for _ in range(reps):
                if sleep_ms:
                    time.sleep(sleep_ms / 1e3)
                t = time.thread_time()
                fn()
                cpu.append(time.thread_time() - t)
            row[str(sleep_ms)] = 1e6 * float(np.median(cpu))
        out[name] = row
    return out


# --------------------------------------------------------------------------- report
def to_markdown(res: dict) -> str:
    lines = ["# The skeleton's CPU by step section, and a TF op after a wait "
             "(benchmarks/skeleton.py)", "",
             f"{res['machine']}; TF {res['tf']}; {res['date']}; program thread's CPU "
             f"(`time.thread_time`); {res['steps']} steps after {res['warmup']} warm-up steps "
             f"per process, {res['repeats']} process(es) per variant, eager and Terra "
             "alternating; medians over processes.", "",
             "## Sections of a step, microseconds of the program thread's CPU per step", "",
             "| program | variant | " + " | ".join(SECTIONS) + " | whole step | wall ms |",
             "|---|---|" + "---|" * (len(SECTIONS) + 2)]
    for prog, modes in res["sections"].items():
        for mode, runs in modes.items():
            med = {k: float(np.median([r["sections_us"][k] for r in runs])) for k in SECTIONS}
            cpu = float(np.median([r["thread_cpu_us"] for r in runs]))
            wall = float(np.median([r["wall_ms"] for r in runs]))
            lines.append(f"| {prog} | {mode} | " + " | ".join(f"{med[k]:.0f}" for k in SECTIONS)
                         + f" | {cpu:.0f} | {wall:.2f} |")
    lines += ["", "Feed puts under Terra (instrumented run, one process per program):", "",
              "| program | puts per step | CPU per put, us | puts' CPU per step, us |",
              "|---|---|---|---|"]
    for prog, r in res["puts"].items():
        lines.append(f"| {prog} | {r['puts_per_step']:.1f} | {r['put_cpu_us']:.0f} | "
                     f"{r['puts_per_step'] * r['put_cpu_us']:.0f} |")
    lines += ["", "## One op right after the thread slept, median microseconds of CPU", "",
              "| work | " + " | ".join(f"after {s:g} ms" if s else "no sleep" for s in SLEEPS_MS)
              + " |", "|---|" + "---|" * len(SLEEPS_MS)]
    for name, row in res["after_wait"].items():
        lines.append(f"| {name} | " + " | ".join(f"{row[str(s)]:.1f}" for s in SLEEPS_MS) + " |")
    if res.get("reading"):
        lines += ["", "#### Reading this run", "", res["reading"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reps", type=int, default=300, help="ops per sleep length")
    ap.add_argument("--child", nargs=5, metavar=("PROG", "MODE", "STEPS", "WARMUP", "INSTR"))
    args = ap.parse_args(argv)
    if args.child:
        prog, mode, steps, warmup, instr = args.child
        print("RESULT " + json.dumps(_sections(prog, mode, int(steps), int(warmup),
                                                instr == "1")))
        return 0
    import tensorflow as tf
    res = {"machine": f"{platform.machine()} {os.cpu_count()} cores",
           "tf": tf.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
           "sections": {}, "puts": {}}
    for prog in ("cnn", "transformer"):
        res["sections"][prog] = {"eager": [], "terra": []}
        for k in range(args.repeats):
            for mode in (("eager", "terra") if k % 2 == 0 else ("terra", "eager")):
                res["sections"][prog][mode].append(
                    _spawn(prog, mode, args.steps, args.warmup, 0))
        res["puts"][prog] = _spawn(prog, "terra", args.steps, args.warmup, 1)
    res["after_wait"] = _after_wait(args.reps)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "skeleton.json"), "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
    md = to_markdown(res)
    with open(os.path.join(RESULTS, "skeleton.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
