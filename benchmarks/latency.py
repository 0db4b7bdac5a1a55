"""Round-trip latency of a feed -> graph -> fetch cycle, and of cancelling a blocked graph.

    python -m benchmarks.latency [--trips 1000] [--repeats 3]

A `tf.while_loop` graph dequeues a feed, adds one, enqueues a fetch, n times; Python puts a value
and gets the answer. Variants: `poll` is `FetchChannel.get` through `GraphRunner.fetch`
(bounded, interruptible: polls `size()`), with a timed and an untimed feed; `blocking` is a raw
eager `queue.dequeue()` (unbounded: the lower bound polling is compared with). Then
`GraphRunner.cancel()` of a graph blocked on a feed. The first 5% of each run's round trips are
dropped as warm-up. Targets (docs/runtime.md, "Channels"): a polled round trip under 0.5 ms
median, a cancel under 20 ms. Writes benchmarks/results/latency.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.compiler.channels import FeedChannel, FetchChannel  # noqa: E402
from terra.runtime.graph_runner import GraphRunner  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
VARIANTS = (("poll", True), ("poll", False), ("blocking", False))


def round_trip_us(n, mode="poll", timed=True):
    """Per-round-trip latencies in microseconds (first 5% dropped as warm-up); each answer is
    checked (the value put, plus one)."""
    feed = FeedChannel(tf.float32, [], name=f"rt_feed_{mode}", timed=timed)
    fetch = FetchChannel(tf.float32, [], name=f"rt_fetch_{mode}")

    @tf.function(autograph=False)
    def loop():
        def body(i):
            e = fetch.enqueue_op(feed.dequeue_op() + 1.0)
            with tf.control_dependencies([e]):
                return [i + 1]

        return tf.while_loop(lambda i: i < n, body, [tf.constant(0)])

    loop.get_concrete_function()
    runner = GraphRunner()
    runner.start(loop)
    lat = []
    for k in range(n):
        t0 = time.perf_counter()
        feed.put(float(k))
        v = runner.fetch(fetch, timeout=10) if mode == "poll" else fetch.queue.dequeue()
        lat.append(time.perf_counter() - t0)
        if float(v) != k + 1.0:
            raise AssertionError(f"round trip {k}: got {float(v)}, expected {k + 1.0}")
    runner.result(timeout=10)
    return np.array(lat[n // 20:]) * 1e6


def cancel_ms(reps):
    """Milliseconds `GraphRunner.cancel()` takes on a graph blocked on a feed, `reps` times."""
    feed = FeedChannel(tf.float32, [], name="cancel_feed", timed=False)

    @tf.function(autograph=False)
    def blocked():
        return feed.dequeue_op()

    blocked.get_concrete_function()
    runner = GraphRunner()
    out = []
    for _ in range(reps):
        runner.start(blocked)
        time.sleep(0.02)
        t0 = time.perf_counter()
        ended = runner.cancel(timeout=5)  # (raises if the run does not end in time)
        out.append(time.perf_counter() - t0)
        if len(ended) != 1:
            raise AssertionError(f"cancel ended {len(ended)} runs, expected the blocked one")
    return np.array(out) * 1e3


def _row(a) -> dict:
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)),
            "p90": float(np.percentile(a, 90)), "n": int(len(a))}


def run(trips: int = 1000, repeats: int = 3, cancels: int = 20) -> dict:
    rows = {}
    for mode, timed in VARIANTS:
        lat = np.concatenate([round_trip_us(trips, mode, timed) for _ in range(repeats)])
        rows[f"{mode}, {'timed' if timed else 'untimed'} feed"] = _row(lat)
    return {"round_trip_us": rows, "cancel_ms": _row(cancel_ms(cancels))}


def markdown(res: dict, meta: dict) -> str:
    lines = ["# Feed -> graph -> fetch round trip (benchmarks/latency.py)", "",
             f"{meta['machine']}; TF {meta['tf']}; {meta['date']}; {meta['trips']} round trips "
             f"x {meta['repeats']} runs per variant, first 5% of each run dropped.", "",
             "| variant | median us | p10 us | p90 us |", "|---|---|---|---|"]
    for name, r in res["round_trip_us"].items():
        lines.append(f"| {name} | {r['median']:.0f} | {r['p10']:.0f} | {r['p90']:.0f} |")
    c = res["cancel_ms"]
    lines += ["", f"`GraphRunner.cancel()` of a graph blocked on a feed ({c['n']} times): median "
              f"{c['median']:.2f} ms, p10 {c['p10']:.2f} ms, p90 {c['p90']:.2f} ms.", "",
              "Targets: a polled round trip under 500 us median, a cancel under 20 ms."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trips", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=RESULTS)
    a = ap.parse_args(argv)
    res = run(a.trips, a.repeats)
    meta = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "tf": tf.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "trips": a.trips,
            "repeats": a.repeats}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "latency.json"), "w") as f:
        json.dump({"meta": meta, **res}, f, indent=1)
    md = markdown(res, meta)
    with open(os.path.join(a.out, "latency.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
