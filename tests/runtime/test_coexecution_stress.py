"""Interleaved feeds and fetches under adversarial timing: no deadlock, correct values.

The Python side is a sequential "skeleton program" (a trace of feed / fetch events, where each
feed is computed from the previous fetched value, as in Figure 3.4); the graph is built from the
same trace. Random sleeps on both sides (graph side: `tf.py_function` sleeps on the data path of
fetched values) shuffle which side waits. Graphs are built both as `tf.function`s (automatic control
dependencies order one queue's ops by construction order) and without automatic control
dependencies (`tf.compat.v1.wrap_function`), where only the edges of `FeedFetchOrder` order them.
"""
import os
import random
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.compiler.channels import FeedChannel, FeedFetchOrder, FetchChannel  # noqa: E402
from terra.errors import TerraTimeoutError  # noqa: E402
from terra.runtime.graph_runner import GraphRunner  # noqa: E402


def slow(value, seconds):
    """Graph-side delay on the data path of `value`."""
    if seconds <= 0:
        return value

    def sleep_then(v):
        time.sleep(seconds)
        return v

    out = tf.py_function(sleep_then, [value], value.dtype)
    out.set_shape(value.shape)
    return out


def make_trace(rng, n_feeds, n_side):
    """Python-order events: feed k, then fetch a_k (which the next feed needs); side fetches c_j
    (independent of every feed) at random positions."""
    events = []
    for k in range(n_feeds):
        events += [("feed", k), ("fetch_a", k)]
    positions = sorted(rng.randrange(len(events) + 1) for _ in range(n_side))
    for j, pos in reversed(list(enumerate(positions))):
        events.insert(pos, ("fetch_c", j))
    return events


def expected_values(n_feeds, n_side):
    xs, a = [], []
    x = 1.0
    for k in range(n_feeds):
        xs.append(x)
        a.append(2.0 * x + k)
        x = a[-1] * 0.5 + 1.0
    return xs, a, [3.0 * j for j in range(n_side)]


def build_graph(events, channels, delays, auto_control_deps, ordered=True):
    feed, fetch_a, fetch_c = channels

    def body(seed):
        order = FeedFetchOrder()
        xs, emitted = {}, []
        for ev, k in events:
            if ev == "feed":
                xs[k] = order.feed(feed) if ordered else feed.dequeue_op()
            elif ev == "fetch_a":
                value = slow(2.0 * xs[k] + float(k), delays.get((ev, k), 0.0))
                emitted.append(
                    order.fetch(fetch_a, value) if ordered else fetch_a.enqueue_op(value))
            else:
                value = slow(seed * 0.0 + 3.0 * k, delays.get((ev, k), 0.0))
                emitted.append(
                    order.fetch(fetch_c, value) if ordered else fetch_c.enqueue_op(value))
        keep = emitted + order.all_ops
        with tf.control_dependencies(keep):
            return tf.add_n([xs[k] for k in sorted(xs)])

    spec = [tf.TensorSpec([], tf.float32)]
    if auto_control_deps:
        return tf.function(body, autograph=False).get_concrete_function(*spec)
    return tf.compat.v1.wrap_function(body, spec)


def drive(runner, events, channels, n_feeds, n_side, rng, max_sleep):
    """The sequential Python side: feeds depend on fetched values; random sleeps."""
    feed, fetch_a, fetch_c = channels
    xs, a, c = expected_values(n_feeds, n_side)
    next_x = 1.0
    for ev, k in events:
        if rng.random() < 0.3:
            time.sleep(rng.random() * max_sleep)
        if ev == "feed":
            assert next_x == xs[k]
            feed.put(next_x)
        elif ev == "fetch_a":
            got = float(runner.fetch(fetch_a, timeout=10))
            assert got == a[k], (ev, k, got, a[k])
            next_x = got * 0.5 + 1.0
        else:
            got = float(runner.fetch(fetch_c, timeout=10))
            assert got == c[k], (ev, k, got, c[k])
    return sum(xs)


@pytest.mark.parametrize("auto_control_deps", [True, False], ids=["tf_function", "no_auto_deps"])
def test_interleaved_feeds_and_fetches_adversarial_timing(auto_control_deps):
    t_start = time.perf_counter()
    rng = random.Random(1234 + auto_control_deps)
    tag = "auto" if auto_control_deps else "raw"
    channels = (FeedChannel(tf.float32, [], name=f"stress_x_{tag}"),
                FetchChannel(tf.float32, [], name=f"stress_a_{tag}"),
                FetchChannel(tf.float32, [], name=f"stress_c_{tag}"))
    runner = GraphRunner()
    n_feeds, n_side = 20, 8
    for trial in range(3):
        events = make_trace(rng, n_feeds, n_side)
        fetch_events = [e for e in events if e[0] != "feed"]
        delays = {e: rng.choice([0.0, 0.0005, 0.002]) for e in rng.sample(fetch_events, 10)}
        fn = build_graph(events, channels, delays, auto_control_deps)
        runner.start(fn, (tf.constant(trial, tf.float32),))
        total = drive(runner, events, channels, n_feeds, n_side, rng, max_sleep=0.002)
        assert float(runner.result(timeout=10)) == total
        assert all(ch.size() == 0 for ch in channels)
    assert time.perf_counter() - t_start < 20.0


def _shared_queue_graph(feed, fetch, ordered):
    """x1 is meant for the first dequeue, x2 (computed by Python from fetch a) for the second.
    The first dequeue is held back by a slow op, so unordered, the second one takes x1."""

    def body(seed):
        order = FeedFetchOrder()
        gate = slow(seed, 0.1)
        if ordered:
            with tf.control_dependencies([gate]):
                d1 = order.feed(feed)
            e = order.fetch(fetch, d1 * 2.0)
            d2 = order.feed(feed)
        else:
            d1 = feed.dequeue_op(control_inputs=[gate])
            e = fetch.enqueue_op(d1 * 2.0)
            d2 = feed.dequeue_op()
        with tf.control_dependencies([e] + order.all_ops):
            return d1 + d2

    return tf.compat.v1.wrap_function(body, [tf.TensorSpec([], tf.float32)])


def test_without_fetch_to_feed_edges_python_and_graph_deadlock():
    """Figure 3.4. Without the edge from the Output-Fetching op to the later Input-Feeding op, the
    graph may run the second dequeue first: it takes x1, the fetch waits for a second feed that
    Python only computes from the fetch. The bounded wait turns the deadlock into an error naming
    the channel; cancellation clears the graph; with FeedFetchOrder the same program is correct."""
    feed = FeedChannel(tf.float32, [], name="dl_x", timed=False)
    fetch = FetchChannel(tf.float32, [], name="dl_a")
    runner = GraphRunner()

    runner.start(_shared_queue_graph(feed, fetch, ordered=False), (tf.constant(0.0),))
    feed.put(5.0)                                           # x1
    with pytest.raises(TerraTimeoutError, match="dl_a"):
        runner.fetch(fetch, timeout=1.0)                    # never comes: deadlock
    t0 = time.perf_counter()
    assert len(runner.cancel(timeout=5)) == 1
    assert time.perf_counter() - t0 < 1.0
    feed.drain()
    fetch.drain()

    runner.start(_shared_queue_graph(feed, fetch, ordered=True), (tf.constant(0.0),))
    feed.put(5.0)
    a = runner.fetch(fetch, timeout=10)
    assert float(a) == 10.0
    feed.put(a + 1.0)                                       # x2 = f(fetched a)
    assert float(runner.result(10)) == 16.0


def test_per_slot_queues_without_edges_do_not_deadlock_in_tf():
    """Documented finding: with one queue per slot, TF's queue kernels are asynchronous (a blocked
    dequeue holds no executor thread), so the exact shape of Figure 3.4 (opB waits on feed k while
    slow opA is fetched) completes even without the edge. The edge still matters as soon as slots
    share a queue (previous test) or the graph is built out of trace order."""
    fa = FetchChannel(tf.float32, [], name="ps_a")
    fk = FeedChannel(tf.float32, [], name="ps_k", timed=False)

    @tf.function(autograph=False)
    def g(x):
        b = fk.dequeue_op() * 3.0   # opB: ready at once, blocks on the feed
        a = slow(x, 0.05) + 1.0     # opA: slow
        fa.enqueue_op(a)
        return b

    runner = GraphRunner()
    runner.start(g, (tf.constant(1.0),))
    a = runner.fetch(fa, timeout=10)
    fk.put(a * 10.0)
    assert float(runner.result(10)) == 60.0
