"""Round-trip latency of a feed -> graph -> fetch cycle (numbers quoted in docs/runtime.md).

A `tf.while_loop` graph dequeues a feed, adds one, enqueues a fetch, n times; Python puts a value
and gets the answer. Modes: `poll` is `FetchChannel.get` (bounded, interruptible: polls `size()`),
`blocking` is a raw eager `queue.dequeue()` (unbounded: the lower bound polling is compared with).
Run the slow variant with `-s` to print the numbers:
  python -m pytest -q -m slow -s tests/runtime/test_latency.py
"""
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.compiler.channels import FeedChannel, FetchChannel  # noqa: E402
from terra.runtime.graph_runner import GraphRunner  # noqa: E402


def round_trip_us(n, mode="poll", timed=True):
    """Per-round-trip latencies in microseconds (first 5% dropped as warm-up)."""
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
        assert float(v) == k + 1.0
    runner.result(timeout=10)
    return np.array(lat[n // 20:]) * 1e6


def cancel_ms(reps):
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
        runner.cancel(timeout=5)
        out.append(time.perf_counter() - t0)
    return np.array(out) * 1e3


def summary(a):
    return (f"median {np.median(a):.0f}, p10 {np.percentile(a, 10):.0f}, "
            f"p90 {np.percentile(a, 90):.0f}, n={len(a)}")


def test_round_trip_is_correct_and_fast_enough():
    lat = round_trip_us(200)
    # Loose sanity bound (2 shared cores); the target (< 500 us median) is checked by the slow test.
    assert np.median(lat) < 5000, summary(lat)


@pytest.mark.slow
def test_round_trip_latency_report():
    assert threading.current_thread() is threading.main_thread()
    rows = {}
    for mode, timed in [("poll", True), ("poll", False), ("blocking", False)]:
        lat = np.concatenate([round_trip_us(1000, mode, timed) for _ in range(3)])
        rows[(mode, timed)] = lat
        print(f"\nround trip {mode:8s} timed={timed!s:5s}: {summary(lat)} us")
    c = cancel_ms(20)
    print(f"cancel of a blocked graph: median {np.median(c):.2f}, p10 {np.percentile(c, 10):.2f}, "
          f"p90 {np.percentile(c, 90):.2f} ms")
    assert np.median(rows[("poll", True)]) < 500
    assert np.median(c) < 20
