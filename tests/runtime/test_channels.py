"""Feed/fetch channels: values cross both ways correctly, every Python-side wait is bounded."""
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.compiler.channels import (FeedChannel, FeedFetchOrder, FetchChannel,  # noqa: E402
                                    StallTimer, case_select_channel, loop_cond_channel,
                                    wait_until)
from terra.errors import ChannelClosedError, TerraTimeoutError  # noqa: E402


def run_in_thread(fn, *args):
    box = {}

    def target():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th, box


def test_feed_and_fetch_cross_a_running_graph():
    feed = FeedChannel(tf.float32, [2], name="x")
    fetch = FetchChannel(tf.float32, [2], name="y")

    @tf.function(autograph=False)
    def g():
        x = feed.dequeue_op()
        fetch.enqueue_op(x * 2.0)
        x2 = feed.dequeue_op()
        return x2 + 1.0

    th, box = run_in_thread(g)
    feed.put([1.0, 2.0])
    y = fetch.get(timeout=10)
    np.testing.assert_array_equal(y.numpy(), [2.0, 4.0])
    feed.put(y * 10.0)  # the second feed depends on the fetched value
    th.join(10)
    np.testing.assert_array_equal(box["out"].numpy(), [21.0, 41.0])
    assert feed.puts == 2 and fetch.gets == 1 and feed.size() == 0 and fetch.size() == 0


def test_multi_component_and_unknown_shapes():
    feed = FeedChannel([tf.int32, tf.float32], [[None, 3], None], name="pair")
    fetch = FetchChannel([tf.int32, tf.float32], name="pair_out")

    @tf.function(autograph=False)
    def g():
        a, b = feed.dequeue_op()
        assert a.shape.as_list() == [None, 3]  # static shape restored inside the graph
        fetch.enqueue_op((tf.reduce_sum(a, axis=1), b * 2.0))

    th, box = run_in_thread(g)
    feed.put((np.arange(6, dtype=np.int32).reshape(2, 3), np.float32(1.5)))
    a, b = fetch.get(timeout=10)
    th.join(10)
    assert "err" not in box, box.get("err")
    np.testing.assert_array_equal(a.numpy(), [3, 12])
    assert float(b) == 3.0


def test_get_times_out_naming_the_channel():
    fetch = FetchChannel(tf.float32, [], name="loss_fetch")
    t0 = time.perf_counter()
    with pytest.raises(TerraTimeoutError, match="loss_fetch") as info:
        fetch.get(timeout=0.05)
    elapsed = time.perf_counter() - t0
    assert 0.05 <= elapsed < 1.0
    assert info.value.timeout == 0.05 and "loss_fetch" in info.value.what
    assert isinstance(info.value, TimeoutError)


def test_watch_aborts_the_wait():
    fetch = FetchChannel(tf.float32, [], name="w")
    calls = []

    def watch():
        calls.append(1)
        if len(calls) > 3:
            raise tf.errors.InvalidArgumentError(None, None, "graph failed")

    with pytest.raises(tf.errors.InvalidArgumentError, match="graph failed"):
        fetch.get(timeout=5, watch=watch)
    assert len(calls) == 4


def test_bounded_capacity_put_times_out():
    feed = FeedChannel(tf.float32, [], name="small", capacity=2)
    feed.put(1.0)
    feed.put(2.0)
    with pytest.raises(TerraTimeoutError, match=r"small.*\(full\)"):
        feed.put(3.0, timeout=0.05)
    assert feed.drain() == 2 and feed.size() == 0
    feed.put(4.0)
    assert feed.size() == 1


def test_bad_values_and_misuse():
    feed = FeedChannel(tf.float32, [2], name="f")
    with pytest.raises(ValueError, match="does not fit"):
        feed.put([1.0, 2.0, 3.0])
    pair = FeedChannel([tf.float32, tf.int32], [[], []], name="p")
    with pytest.raises(ValueError, match="expected 2 components, got 1"):
        pair.put((1.0,))
    with pytest.raises((TypeError, ValueError)):
        feed.put(["a", "b"])
    with pytest.raises(RuntimeError, match="inside a tf.function"):
        feed.dequeue_op()
    with pytest.raises(RuntimeError, match="inside a tf.function"):
        FetchChannel(tf.float32).enqueue_op(tf.constant(1.0))
    with pytest.raises(ValueError, match="2 shapes for 1 dtypes"):
        FeedChannel([tf.float32], [[], []])
    with pytest.raises(ValueError, match="capacity"):
        FeedChannel(tf.float32, capacity=0)

    @tf.function(autograph=False)
    def make():
        FeedChannel(tf.float32, name="in_graph")

    with pytest.raises(RuntimeError, match="eagerly"):
        make()
    assert "float32[2]" in repr(feed)


def test_closed_channel():
    feed = FeedChannel(tf.float32, [], name="c")
    feed.close()
    assert feed.closed
    with pytest.raises(ChannelClosedError, match="closed"):
        feed.put(1.0)


def test_graph_stall_is_measured_around_the_dequeue():
    feed = FeedChannel(tf.float32, [], name="slow_feed")
    untimed = FeedChannel(tf.float32, [], name="untimed", timed=False)

    @tf.function(autograph=False)
    def g():
        return feed.dequeue_op() + untimed.dequeue_op()

    # Fed before the graph starts: (almost) no stall. Also warms up the function, so that the
    # measured run below has no instantiation time in it.
    feed.put(1.0)
    untimed.put(1.0)
    assert float(g()) == 2.0
    assert feed.stall_seconds < 0.1
    feed.reset_stats()
    assert feed.stall_seconds == 0.0 and feed.puts == 0

    start = time.perf_counter()
    th, box = run_in_thread(g)
    time.sleep(0.3)  # the graph is (most likely) blocked on the feed now
    feed.put(1.0)
    time.sleep(0.1)
    untimed.put(2.0)
    th.join(10)
    elapsed = time.perf_counter() - start
    assert float(box["out"]) == 3.0
    # the wait is measured inside the run: more than nothing, no more than the run took (how
    # long exactly depends on when the graph's thread reached the dequeue, on a busy machine
    # after the put)
    assert 0.0 < feed.stall_seconds <= elapsed
    assert untimed.stall_seconds == 0.0


def test_a_stall_timer_sums_a_graphs_waits_in_one_variable():
    """Timed dequeues built with the graph's StallTimer make no variable of their own; the
    graph adds its waits to the timer's one variable once per run."""
    feeds = [FeedChannel(tf.float32, [], name=f"feed{i}") for i in range(3)]
    stall = StallTimer("graph")

    @tf.function(autograph=False)
    def g():
        order = FeedFetchOrder(stall)
        total = tf.add_n([order.feed(ch) for ch in feeds])
        stall.close()
        return total

    concrete = g.get_concrete_function()
    ops = concrete.graph.get_operations()
    assert [op.type for op in ops].count("AssignAddVariableOp") == 1
    assert [op.type for op in ops].count("Timestamp") == 2 * len(feeds)
    assert all(ch._stall is None for ch in feeds)
    start = time.perf_counter()
    th, box = run_in_thread(g)
    time.sleep(0.2)
    for i, ch in enumerate(feeds):
        ch.put(float(i))
    th.join(10)
    elapsed = time.perf_counter() - start
    assert float(box["out"]) == 3.0
    assert 0.0 < stall.seconds <= elapsed
    assert all(ch.stall_seconds == 0.0 for ch in feeds)
    stall.reset()
    assert stall.seconds == 0.0


def test_python_stall_is_measured_in_get():
    fetch = FetchChannel(tf.float32, [], name="late")
    feed = FeedChannel(tf.float32, [], name="trigger", timed=False)

    @tf.function(autograph=False)
    def g():
        fetch.enqueue_op(feed.dequeue_op() * 3.0)

    th, _ = run_in_thread(g)
    timer = threading.Timer(0.2, feed.put, args=(2.0,))
    timer.start()
    assert float(fetch.get(timeout=10)) == 6.0
    th.join(10)
    assert 0.15 <= fetch.wait_seconds < 5.0 and fetch.gets == 1
    fetch.reset_stats()
    assert fetch.wait_seconds == 0.0


def test_case_select_drives_switch_case_with_a_fetch_in_a_branch():
    select = case_select_channel()
    fetch = FetchChannel(tf.float32, [], name="branch_value")
    x = tf.Variable(1.0)

    @tf.function(autograph=False)
    def g():
        def b0():
            return x * 10.0

        def b1():
            v = x * 100.0
            with tf.control_dependencies([fetch.enqueue_op(v)]):
                return tf.identity(v)

        return tf.switch_case(select.dequeue_op(), [b0, b1])

    select.put(0)
    assert float(g()) == 10.0 and fetch.size() == 0
    select.put(1)
    assert float(g()) == 100.0
    assert float(fetch.get(timeout=5)) == 100.0


def test_loop_cond_channel_drives_a_while_loop():
    cond = loop_cond_channel()
    feed = FeedChannel(tf.float32, [], name="loop_feed")
    fetch = FetchChannel(tf.float32, [], name="loop_fetch")

    @tf.function(autograph=False)
    def g():
        def body(acc):
            new = acc + feed.dequeue_op()
            with tf.control_dependencies([fetch.enqueue_op(new)]):
                return [tf.identity(new)]

        return tf.while_loop(lambda acc: cond.dequeue_op(), body, [tf.constant(0.0)])

    th, box = run_in_thread(g)
    acc, expected = 0.0, []
    for i in range(7):  # Python decides, from fetched values, how long the loop runs
        cond.put(True)
        feed.put(float(i))
        acc = float(fetch.get(timeout=10))
        expected.append(acc)
        if acc > 12:
            break
    cond.put(False)
    th.join(10)
    assert expected == [0.0, 1.0, 3.0, 6.0, 10.0, 15.0]
    assert float(box["out"][0]) == 15.0


def test_feed_fetch_order_adds_figure_3_4_edges():
    f1 = FeedChannel(tf.float32, [], name="o_f1", timed=False)
    out = FetchChannel(tf.float32, [], name="o_out")
    seen = {}

    @tf.function(autograph=False)
    def g():
        order = FeedFetchOrder()
        a = order.feed(f1)
        fa = order.fetch(out, a * 2.0)
        fb = order.fetch(out, a * 3.0)
        b = order.feed(f1)
        seen["b_deps"] = {op.name for op in b.op.control_inputs}
        seen["fa"], seen["fb"], seen["a"] = fa.name, fb.name, a.op.name
        seen["fb_deps"] = {op.name for op in fb.control_inputs}
        return b

    g.get_concrete_function()
    assert {seen["fa"], seen["fb"], seen["a"]} <= seen["b_deps"]
    assert seen["fa"] in seen["fb_deps"]


def test_wait_until_returns_waited_time_and_honours_keyboard_interrupt():
    assert wait_until(lambda: True, "x", 0.0) == 0.0
    flag = []
    threading.Timer(0.05, flag.append, args=(1,)).start()
    waited = wait_until(lambda: bool(flag), "flag", 5)
    assert 0.03 <= waited < 2.0

    def watch():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        wait_until(lambda: False, "never", 5, watch=watch)


def test_wait_event_returns_at_once_when_set_and_times_out_naming_the_wait():
    from terra.compiler.channels import wait_event
    from terra.errors import TerraTimeoutError
    ev = threading.Event()
    ev.set()
    assert wait_event(ev, "set", 0.0) == 0.0
    ev = threading.Event()
    threading.Timer(0.05, ev.set).start()
    assert wait_event(ev, "timer", 10) > 0.0 and ev.is_set()
    with pytest.raises(TerraTimeoutError, match="never"):
        wait_event(threading.Event(), "never", 0.2)


def test_wait_until_sleeps_an_expected_wait_in_one_piece_before_polling(monkeypatch):
    from terra.compiler import channels
    slept, polls = [], []
    monkeypatch.setattr(channels.time, "sleep", slept.append)

    def ready():
        polls.append(1)
        return len(polls) >= 2  # the first poll (before any wait) finds nothing

    channels.wait_until(ready, "x", 5, expect=0.004)
    assert slept == [0.004] and len(polls) == 2
    # no expectation (or one shorter than the spin): no sleep before the value is seen
    polls.clear()
    slept.clear()
    channels.wait_until(ready, "x", 5, expect=0.0)
    assert slept == [] and len(polls) == 2


def test_fetch_get_expects_the_shortest_of_its_recent_waits(monkeypatch):
    from terra.compiler import channels
    ch = FetchChannel(tf.float32, [], name="expect_test")
    expects = []
    seq = [0.010, 0.004, 0.020, 0.008, 0.006, 0.009, 0.012, 0.030, 0.011, 0.007, 0.0]
    waits = iter(seq)

    def fake_wait(ready, what, timeout=None, watch=None, expect=0.0):
        expects.append(expect)
        return next(waits)

    monkeypatch.setattr(channels, "wait_until", fake_wait)

    @tf.function
    def fill():
        for i in range(11):
            ch.enqueue_op(tf.constant(float(i)))

    fill()
    got = [float(ch.get()) for _ in range(11)]
    assert got == [float(i) for i in range(11)]
    # none until eight waits are known, then 0.8 x the shortest of the last eight
    assert expects[:8] == [0.0] * 8
    assert expects[8] == pytest.approx(0.8 * 0.004)
    assert expects[9] == pytest.approx(0.8 * 0.004)
    assert expects[10] == pytest.approx(0.8 * 0.006)  # 0.010 and 0.004 have left the window
    assert ch.wait_seconds == pytest.approx(sum(seq))


def test_a_wait_formats_the_channels_description_only_when_it_times_out():
    """Every fetch waits through `wait_until`; describing the channel (dtypes, shapes) costs
    more than a poll, so it is made only for the timeout's message."""
    class Counted(FetchChannel):
        described = 0

        def __repr__(self):
            Counted.described += 1
            return super().__repr__()

    fetch = Counted(tf.float32, [], name="counted")
    fetch.queue.enqueue([tf.constant(1.5)])
    assert float(fetch.get(timeout=5)) == 1.5
    feed = FeedChannel(tf.float32, [], name="roomy", capacity=2)
    feed.put(1.0)
    assert Counted.described == 0
    with pytest.raises(TerraTimeoutError, match=r"counted") as info:
        fetch.get(timeout=0.01)
    assert Counted.described == 1 and info.value.what.startswith("Counted('counted'")


def test_unread_elements_are_taken_in_batches_by_count_and_by_size(monkeypatch):
    """Elements no reader takes are dequeued every DROP_EVERY collected runs in one call, at
    once when they hold DROP_BYTES or an element of a size never seen, and a count above what
    is queued raises instead of blocking."""
    from terra.compiler import channels
    from terra.errors import TerraRuntimeError

    fixed = FetchChannel(tf.float32, [4], name="fixed")      # 16 bytes an element
    varying = FetchChannel(tf.float32, [None], name="varying")
    assert fixed.element_bytes == 16 and varying.element_bytes is None
    unread = channels.Unread({"f": fixed, "v": varying})

    def enqueue(n):
        @tf.function(autograph=False)
        def run():
            for _ in range(n):
                fixed.enqueue_op(tf.ones([4]))
                varying.enqueue_op(tf.ones([3]))
        run()

    sizes = []
    for i in range(2 * channels.DROP_EVERY):
        enqueue(1)
        unread["f"] = unread.get("f", 0) + 1
        if i == 0:
            unread["v"] = 1
            unread.collected()  # a varying element of a size never seen: taken at once
            assert not unread and varying.size() == 0 and fixed.size() == 0
            unread.seen_bytes["v"] = 12
            continue
        unread["v"] = unread.get("v", 0) + 1
        unread.collected()
        sizes.append((fixed.size(), varying.size()))
    # taken after every DROP_EVERY runs, and only then
    want = [(k % channels.DROP_EVERY, k % channels.DROP_EVERY) for k in range(1, len(sizes) + 1)]
    assert sizes == want, sizes
    assert len(unread.droppers) == 1  # one function for the two channels, counts an argument

    monkeypatch.setattr(channels, "DROP_BYTES", 3 * 16 + 3 * 12)
    unread.drop()
    for k in range(1, 4):
        enqueue(1)
        unread["f"], unread["v"] = k, k
        unread.collected()
        assert fixed.size() == (0 if k == 3 else k), k  # three runs hold DROP_BYTES

    enqueue(1)
    unread["f"] = 2
    with pytest.raises(TerraRuntimeError, match="fewer elements queued"):
        unread.drop()
    assert not unread
