"""The physical limit of a program whose step reads tensors mid-step: `fasterrcnn_like`.

    python -m benchmarks.limits [--steps 20] [--warmup 4]

Its step is three parts in a row: the backbone and RPN forward (graph), then numpy post-processing
of the materialized proposals (IoU matching, NMS: Python, on the program's thread), then the RoI
head, the losses, the backward and the update (graph). The numpy part needs the forward's
values and the backward needs the numpy part's results, and the next step's forward needs this
step's update: nothing of one step can overlap another part of it or of the next step, so no
executor runs a step faster than

    graph alone + numpy alone

where *graph alone* is one `tf.function` step with the numpy results given as inputs (every op
of the step's graph, forward and backward, with TF's own Grappler) and *numpy alone* is the
post-processing on materialized values. Both are measured here, in one process, beside the eager
step and Terra's step: the best speed-up over eager any co-execution can reach on this machine
is eager / (graph alone + numpy alone).

Medians over the timed steps with p10/p90. Writes benchmarks/results/limits.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from benchmarks import programs as bench_programs  # noqa: E402
from benchmarks.breakdown import summary  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
NAME = "fasterrcnn_like"


def _timed(fn, n):
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return times


def _step_fn(program):
    return lambda i: float(program.train_step(*program.batch(i)))


def _materialized(program, n):
    """The forward's values the numpy part reads, for batches 0..n-1 (from the eager model)."""
    out = []
    b = program.c["batch"]
    for i in range(n):
        images, gt_boxes, gt_classes = program.batch(i)
        feat = program.backbone(images, training=True)
        obj, deltas = program.rpn(feat, training=True)
        obj = tf.reshape(obj, (b, -1))
        deltas = tf.reshape(deltas, (b, -1, 4))
        props = tf.clip_by_value(program.anchors[None] + 0.1 * deltas, 0.0, 1.0)
        out.append((props.numpy(), obj.numpy(), gt_boxes.numpy(), gt_classes.numpy()))
    return out


def _graph_step(program):
    """One `tf.function` step of every op of the program's step, the numpy results as inputs."""
    b = program.c["batch"]

    @tf.function
    def step(images, pos, box_targets, roi_boxes, box_idx, roi_labels):
        with tf.GradientTape() as tape:
            feat = program.backbone(images, training=True)
            obj, deltas = program.rpn(feat, training=True)
            obj = tf.reshape(obj, (b, -1))
            deltas = tf.reshape(deltas, (b, -1, 4))
            loss = program.loss(feat, obj, deltas, pos, box_targets, roi_boxes, box_idx,
                                roi_labels)
        params = program.params()
        program.optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss
    return step


def run(steps, warmup, size="bench"):
    n = len(bench_programs.build(NAME, tf.GradientTape, seed=0, size=size).batches)
    out = {}
    eager = bench_programs.build(NAME, tf.GradientTape, seed=0, size=size)
    first = float(eager.train_step(*eager.batch(0)))  # (a warm-up step; checks the graph's)
    step = _step_fn(eager)
    _timed(step, warmup)
    out["eager"] = summary(_timed(step, steps))

    probe = bench_programs.build(NAME, tf.GradientTape, seed=0, size=size)
    values = _materialized(probe, n)
    targets = [probe.post_process(*v) for v in values]
    post = lambda i: probe.post_process(*values[i % n])  # noqa: E731
    _timed(post, warmup)
    out["numpy alone"] = summary(_timed(post, steps))

    g = bench_programs.build(NAME, tf.GradientTape, seed=0, size=size)
    fn = _graph_step(g)
    feeds = [(g.batch(i)[0], *(tf.constant(t) for t in targets[i])) for i in range(n)]
    # the graph computes the program's step: its first loss is eager's first (Grappler may
    # reorder a sum: about an ulp)
    out["graph first loss"] = {"graph": float(fn(*feeds[0])), "eager": first}
    graph = lambda i: float(fn(*feeds[i % n]))  # noqa: E731
    _timed(graph, warmup)
    out["graph alone"] = summary(_timed(graph, steps))

    terra.reset()
    t = bench_programs.build(NAME, tf.TerraGradientTape, seed=0, size=size)
    step = _step_fn(t)
    _timed(step, warmup)
    out["terra"] = summary(_timed(step, steps))
    terra.end_iteration()
    out["terra stats"] = {k: v for k, v in terra.stats().items() if k in
                          ("traces", "fallbacks", "graph_builds")}
    terra.reset()

    limit = out["graph alone"]["median_ms"] + out["numpy alone"]["median_ms"]
    e = out["eager"]["median_ms"]
    out["limit"] = {"step_ms": limit, "best_speedup": e / limit,
                    "terra_speedup": e / out["terra"]["median_ms"],
                    "terra_over_limit": out["terra"]["median_ms"] / limit}
    return out


def markdown(res, meta) -> str:
    rows = ["| part | median ms | p10 ms | p90 ms |", "|---|---|---|---|"]
    for k in ("eager", "graph alone", "numpy alone", "terra"):
        s = res[k]
        rows.append(f"| {k} | {s['median_ms']:.1f} | {s['p10_ms']:.1f} | {s['p90_ms']:.1f} |")
    lim = res["limit"]
    st = res["terra stats"]
    return "\n".join([
        f"# `{NAME}`: the physical limit of a step that reads tensors mid-step "
        "(benchmarks/limits.py)", "",
        f"{meta['date']} · TF {meta['tf']} · {meta['machine']} · {meta['steps']} timed steps "
        f"after {meta['warmup']} warm-up steps per variant, one process, one after another.", "",
        *rows, "",
        f"- limit = graph alone + numpy alone = **{lim['step_ms']:.1f} ms**: the best speed-up "
        f"over eager any co-execution reaches here is **x{lim['best_speedup']:.2f}**.",
        f"- Terra: x{lim['terra_speedup']:.2f} over eager, {lim['terra_over_limit']:.2f} x the "
        f"limit ({st.get('traces')} traces, {st.get('fallbacks')} fallbacks, "
        f"{st.get('graph_builds')} graph builds, warm-up included).", ""])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--size", default="bench", choices=bench_programs.SIZES)
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    res = run(args.steps, args.warmup, args.size)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tf": tf.__version__,
            "machine": f"{platform.machine()} {os.cpu_count()} cores", "steps": args.steps,
            "warmup": args.warmup, "size": args.size}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "limits.json"), "w") as f:
        json.dump({"meta": meta, "results": res}, f, indent=1)
    md = markdown(res, meta)
    with open(os.path.join(args.out, "limits.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
