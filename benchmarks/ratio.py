"""Terra's step against tf.function's, each program and mode in processes of its own.

    python -m benchmarks.ratio [--programs cnn,transformer,resnet50,bert_qa,gpt2,dcgan,yolov3_like]
                               [--rounds 4] [--steps 50] [--warmup 15]

The harnesses that run every mode in one process (`make bench`, `benchmarks/coexec.py`) share
one TF runtime between the modes (thread pools, allocator, the other mode's graphs), and their
ratios moved by up to 0.15 between runs of the same code. Here every (program, mode) block is a
fresh interpreter that builds the program, warms it up and times its steps (`float(loss)` each,
as a user reading the loss); the two modes alternate within a round, in the opposite order the
next round, so a slow spell of the machine falls on both. Per program: the median over processes
of each process's median step, their ratio, the lowest and highest of the rounds' own ratios,
and the program thread's CPU per Terra step (`time.thread_time`, the skeleton's cost). Writes
benchmarks/results/ratio.json and .md.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODES = ("function", "terra")
DEFAULT_PROGRAMS = "cnn,transformer,resnet50,bert_qa,gpt2,dcgan,yolov3_like"


def child(program: str, mode: str, steps: int, warmup: int, intra_op: int = 0) -> dict:
    """One block in this process: build, warm up, time. Returns what the parent records.
    `intra_op` > 0: TF's intra-op thread pool size, set before TF's runtime starts."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    if intra_op:
        tf.config.threading.set_intra_op_parallelism_threads(intra_op)

    import terra
    from benchmarks.breakdown import Subject
    sub = Subject(program, tf.TerraGradientTape if mode == "terra" else tf.GradientTape,
                  compiled=mode == "function")
    for _ in range(warmup):
        float(sub.step())
    wall, cpu = [], []
    for _ in range(steps):
        c, t = time.thread_time(), time.perf_counter()
        float(sub.step())
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    out = {"wall_ms": [1e3 * w for w in wall], "cpu_ms": [1e3 * c for c in cpu]}
    if mode == "terra":
        terra.end_iteration()
        s = terra.stats()
        out["stats"] = {k: s[k] for k in ("traces", "fallbacks", "graph_builds")}
    return out


def run_block(program, mode, steps, warmup, intra_op=0, timeout=900) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.ratio", "--child", program, mode,
           "--steps", str(steps), "--warmup", str(warmup), "--intra-op", str(intra_op)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{program} {mode}: exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def summarize(blocks: dict) -> dict:
    """blocks: mode -> list of per-round child results (the same rounds for both modes)."""
    med = {m: [float(np.median(b["wall_ms"])) for b in blocks[m]] for m in MODES}
    rounds = [t / f for f, t in zip(med["function"], med["terra"])]
    f, t = float(np.median(med["function"])), float(np.median(med["terra"]))
    return {"function_ms": f, "terra_ms": t, "ratio": t / f,
            "round_ratios": rounds, "process_medians_ms": med,
            "terra_cpu_ms": float(np.median([np.median(b["cpu_ms"]) for b in blocks["terra"]])),
            "terra_stats": [b.get("stats") for b in blocks["terra"]]}


def markdown(results: dict, meta: dict) -> str:
    lines = ["# Terra / tf.function, each block in a process of its own (benchmarks/ratio.py)", "",
             f"{meta['machine']}; TF {meta['tf']}; {meta['rounds']} rounds; per process "
             f"{meta['warmup']} warm-up and {meta['steps']} timed steps; the two modes alternate "
             "within a round, in the other order the next round; TF's intra-op threads: "
             f"{meta.get('intra_op') or 'its default'}.", "",
             "| program | tf.function ms | Terra ms | Terra / tf.function | rounds' ratios, "
             "lowest-highest | Terra program-thread CPU ms per step |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lo, hi = min(r["round_ratios"]), max(r["round_ratios"])
        lines.append(f"| {name} | {r['function_ms']:.2f} | {r['terra_ms']:.2f} | "
                     f"{r['ratio']:.2f} | {lo:.2f}-{hi:.2f} | {r['terra_cpu_ms']:.2f} |")
    lines += ["", "Step times are the median over processes of each process's median step."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", default=DEFAULT_PROGRAMS)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=15)
    ap.add_argument("--intra-op", type=int, default=0,
                    help="TF's intra-op threads in both modes' processes (0: TF's default)")
    ap.add_argument("--out", default=RESULTS, help="folder for ratio.json and .md")
    ap.add_argument("--child", nargs=2, metavar=("PROGRAM", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.warmup < 0 or args.intra_op < 0:
        ap.error("--rounds and --steps must be positive, --warmup and --intra-op not negative")
    if args.child:
        program, mode = args.child
        if mode not in MODES:
            ap.error(f"mode {mode!r}: choose from {', '.join(MODES)}")
        print(json.dumps(child(program, mode, args.steps, args.warmup, args.intra_op)),
              flush=True)
        return
    programs = args.programs.split(",")
    blocks = {p: {m: [] for m in MODES} for p in programs}
    for r in range(args.rounds):
        for p in programs:
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                blocks[p][m].append(run_block(p, m, args.steps, args.warmup, args.intra_op))
            got = blocks[p]
            print(f"round {r + 1} {p:12s} tf.function "
                  f"{np.median(got['function'][-1]['wall_ms']):8.2f} ms  terra "
                  f"{np.median(got['terra'][-1]['wall_ms']):8.2f} ms", flush=True)
    results = {p: summarize(blocks[p]) for p in programs}
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "tf": importlib.metadata.version("tensorflow"),
            "rounds": args.rounds, "steps": args.steps, "warmup": args.warmup,
            "intra_op": args.intra_op,
            "date": time.strftime("%Y-%m-%d")}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ratio.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "blocks": blocks}, f)
    md = markdown(results, meta)
    with open(os.path.join(args.out, "ratio.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
