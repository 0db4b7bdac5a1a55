"""GraphRunner: background runs, cancellation, error re-raising with context, pipelining, timing."""
import _thread
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.compiler.channels import (FeedChannel, FeedFetchOrder, FetchChannel,  # noqa: E402
                                    wait_event, wait_until)
from terra.errors import TerraRuntimeError, TerraTimeoutError  # noqa: E402
from terra.runtime.graph_runner import (FetchResolver, GraphRunner, op_index_of,  # noqa: E402
                                        op_node_name, timing, with_error_context)


def fake_source_map(index):
    # Stands for the runtime's map from recorded op index to the user's source line.
    return {7: '  File "train.py", line 42, in step\n    loss = tf.math.log(p)'}.get(index, "")


def test_start_and_result_with_args_and_captured_variable():
    v = tf.Variable([1.0, 2.0])

    @tf.function(autograph=False)
    def f(x, y):
        v.assign_add(x)
        return {"sum": v * y, "n": tf.size(v)}

    r = GraphRunner()
    run = r.start(f, (tf.constant([1.0, 1.0]), tf.constant(3.0)))
    out = r.result(timeout=10)
    np.testing.assert_array_equal(out["sum"].numpy(), [6.0, 9.0])
    assert int(out["n"]) == 2 and run.state == "ok" and r.done
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])  # the real variable was updated
    assert r._thread.daemon and r._thread is not threading.main_thread()
    # a ConcreteFunction works as well
    cf = f.get_concrete_function(tf.constant([0.0, 0.0]), tf.constant(1.0))
    r.start(cf, (tf.constant([0.0, 0.0]), tf.constant(1.0)))
    np.testing.assert_array_equal(r.result(10)["sum"].numpy(), [2.0, 3.0])


def test_bad_usage():
    r = GraphRunner()
    with pytest.raises(TerraRuntimeError, match="no run was started"):
        r.result(1)
    with pytest.raises(TypeError, match="tf.function or ConcreteFunction"):
        r.start(lambda: 1)
    f = tf.function(lambda x: x + 1.0, autograph=False)
    cf = f.get_concrete_function(tf.constant(1.0))
    r.start(cf, ())
    with pytest.raises(ValueError, match="takes 1 tensor arguments, got 0"):
        r.result(10)


def _nan_check_fn():
    @tf.function(autograph=False)
    def f(x):
        y = tf.identity(x * 2.0, name=op_node_name(6))
        return tf.debugging.check_numerics(y, "bad value", name=op_node_name(7))

    return f


def test_graph_error_is_reraised_as_the_eager_type_with_source_context():
    x = tf.constant([1.0, np.nan])
    with pytest.raises(tf.errors.InvalidArgumentError) as eager:
        tf.debugging.check_numerics(x * 2.0, "bad value")
    r = GraphRunner(error_context=fake_source_map)
    r.start(_nan_check_fn(), (x,))
    with pytest.raises(type(eager.value)) as info:
        r.result(10)
    err = info.value
    assert type(err) is tf.errors.InvalidArgumentError
    assert "bad value" in err.message and "Tensor had NaN values" in err.message
    assert 'File "train.py", line 42, in step' in err.message
    assert err.terra_op_index == 7
    # without a hook the error passes unchanged
    r2 = GraphRunner()
    r2.start(_nan_check_fn(), (x,))
    with pytest.raises(tf.errors.InvalidArgumentError) as info2:
        r2.result(10)
    assert "train.py" not in info2.value.message


def test_error_in_nested_function_maps_the_innermost_node():
    @tf.function(autograph=False)
    def inner(x):
        return tf.gather(x, tf.constant([5]), name=op_node_name(7))

    @tf.function(autograph=False)
    def outer(x):
        return tf.identity(inner(x), name=op_node_name(3))

    r = GraphRunner(error_context=lambda i: f"at recorded op {i}")
    r.start(outer, (tf.constant([1.0, 2.0]),))
    with pytest.raises(tf.errors.InvalidArgumentError, match="at recorded op 7"):
        r.result(10)


def test_with_error_context_helpers():
    assert op_index_of(op_node_name(12)) == 12 and op_index_of("MatMul_3") is None
    e = tf.errors.OutOfRangeError(None, None, "end [[{{node terra_op_7}}]]")
    new = with_error_context(e, fake_source_map)
    assert type(new) is tf.errors.OutOfRangeError and "train.py" in new.message
    generic = tf.errors.OpError(None, None, "x [[{{node terra_op_7}}]]", tf.errors.INTERNAL)
    assert with_error_context(generic, fake_source_map).error_code == tf.errors.INTERNAL
    unmapped = tf.errors.InternalError(None, None, "no node here")
    assert with_error_context(unmapped, fake_source_map) is unmapped
    other = ValueError("not an op error")
    assert with_error_context(other, fake_source_map) is other


def test_fetch_reports_a_failed_graph_at_once():
    fetch = FetchChannel(tf.float32, [2], name="never_filled")

    @tf.function(autograph=False)
    def f(x):
        y = tf.debugging.check_numerics(x, "bad", name=op_node_name(7))
        fetch.enqueue_op(y)
        return y

    r = GraphRunner(error_context=fake_source_map)
    r.start(f, (tf.constant([np.nan, 1.0]),))
    t0 = time.perf_counter()
    with pytest.raises(tf.errors.InvalidArgumentError, match="train.py"):
        r.fetch(fetch, timeout=20)
    assert time.perf_counter() - t0 < 5.0
    assert r.current is None  # the failed run was consumed by the sync point


def test_result_timeout_then_cancel():
    feed = FeedChannel(tf.float32, [], name="starved")

    @tf.function(autograph=False)
    def f():
        return feed.dequeue_op()

    r = GraphRunner()
    r.start(f)
    with pytest.raises(TerraTimeoutError, match="graph run #0"):
        r.result(timeout=0.1)
    assert not r.done
    cancelled = r.cancel(timeout=5)
    assert [c.index for c in cancelled] == [0] and r.done


def test_cancel_blocked_graph_quickly_and_reuse_queues_and_function():
    feed = FeedChannel(tf.float32, [], name="cx")
    fetch = FetchChannel(tf.float32, [], name="cy")

    @tf.function(autograph=False)
    def f():
        a = feed.dequeue_op()
        fetch.enqueue_op(a + 1.0)
        b = feed.dequeue_op()  # the graph will block here
        return a + b

    r = GraphRunner()
    run = r.start(f)
    feed.put(1.0)
    assert float(r.fetch(fetch, 10)) == 2.0
    time.sleep(0.05)
    t0 = time.perf_counter()
    assert r.cancel(timeout=5) == [run]
    cancel_s = time.perf_counter() - t0
    assert cancel_s < 1.0, cancel_s
    assert run.state == "cancelled" and isinstance(run.error, tf.errors.CancelledError)
    assert r.current is None
    # the function and the queues remain usable
    assert feed.size() == 0 and fetch.size() == 0
    r.start(f)
    feed.put(10.0)
    assert float(r.fetch(fetch, 10)) == 11.0
    feed.put(5.0)
    assert float(r.result(10)) == 15.0


def test_cancel_drops_pending_runs_and_leftover_feeds_can_be_drained():
    feed = FeedChannel(tf.float32, [], name="pend")

    @tf.function(autograph=False)
    def f():
        return feed.dequeue_op() + feed.dequeue_op()

    r = GraphRunner()
    r1, r2 = r.start(f), r.start(f)
    feed.put(1.0)  # r1 takes it and waits for a second value
    wait_until(lambda: feed.size() == 0, "r1's first dequeue", 10)
    time.sleep(0.02)
    assert r.cancel(5) == [r1, r2]
    assert r2.state == "cancelled" and isinstance(r2.error, tf.errors.CancelledError)
    assert feed.drain() == 0
    feed.put(2.0)
    feed.put(3.0)
    r.start(f)
    assert float(r.result(10)) == 5.0


def test_pipelined_runs_consume_feeds_in_order():
    feed = FeedChannel(tf.float32, [], name="pipe")
    fetch = FetchChannel(tf.float32, [], name="pipe_out")
    w = tf.Variable(1.0)

    @tf.function(autograph=False)
    def step():
        x = feed.dequeue_op()
        loss = x * w
        fetch.enqueue_op(loss)
        w.assign_add(x)
        return loss

    step.get_concrete_function()
    r = GraphRunner()
    losses, runs = [], []
    feed.put(1.0)
    runs.append(r.start(step))
    for i in range(2, 7):
        # Python is already one iteration ahead: it feeds and starts run i while run i-1 may
        # still be executing; the worker begins run i as soon as run i-1 ends.
        feed.put(float(i))
        runs.append(r.start(step))
        losses.append(float(r.fetch(fetch, 10)))
    losses.append(float(r.fetch(fetch, 10)))
    results = [float(r.result(10)) for _ in runs]
    # eager reference
    wr, ref = 1.0, []
    for i in range(1, 7):
        ref.append(i * wr)
        wr += i
    assert losses == ref and results == ref and float(w.numpy()) == wr
    assert [x.state for x in runs] == ["ok"] * 6 and r.runs_finished >= 6


def _interrupt_main_once_it_waits(limit_s=120.0):
    """Ctrl-C for the main thread as soon as it is inside the runner's bounded wait (not after a
    fixed delay, which a loaded machine can make land before the wait began)."""
    main = threading.main_thread().ident

    def waiting():
        f = sys._current_frames().get(main)
        while f is not None:
            if f.f_code in (wait_until.__code__, wait_event.__code__):
                return True
            f = f.f_back
        return False

    def fire():
        deadline = time.monotonic() + limit_s
        while not waiting() and time.monotonic() < deadline:
            time.sleep(0.005)
        _thread.interrupt_main()
    t = threading.Thread(target=fire, daemon=True)
    t.start()
    return t


@pytest.mark.usefixtures("python_sigint")
def test_keyboard_interrupt_while_fetching_cancels_the_graph():
    assert threading.current_thread() is threading.main_thread()
    feed = FeedChannel(tf.float32, [], name="ki_feed")
    fetch = FetchChannel(tf.float32, [], name="ki_fetch")

    @tf.function(autograph=False)
    def f():
        fetch.enqueue_op(feed.dequeue_op())
        return tf.constant(0)

    r = GraphRunner()
    run = r.start(f)
    firing = _interrupt_main_once_it_waits()  # Ctrl-C while Python waits
    with pytest.raises(KeyboardInterrupt):
        r.fetch(fetch, timeout=300)  # the interrupt, not this bound, ends the wait
    firing.join()
    assert run.state == "cancelled" and r.done
    feed.put(4.0)
    r.start(f)
    assert float(r.fetch(fetch, 10)) == 4.0
    r.result(10)


@pytest.mark.usefixtures("python_sigint")
def test_keyboard_interrupt_while_waiting_for_result_cancels_the_graph():
    feed = FeedChannel(tf.float32, [], name="ki2")

    @tf.function(autograph=False)
    def f():
        return feed.dequeue_op()

    r = GraphRunner()
    run = r.start(f)
    firing = _interrupt_main_once_it_waits()
    with pytest.raises(KeyboardInterrupt):
        r.result(timeout=300)
    firing.join()
    assert run.state == "cancelled"


def test_timing_counters():
    feed = FeedChannel(tf.float32, [], name="t_feed")
    fetch = FetchChannel(tf.float32, [], name="t_fetch")

    @tf.function(autograph=False)
    def f():
        x = feed.dequeue_op()
        fetch.enqueue_op(x)
        y = feed.dequeue_op()
        return y

    r = GraphRunner()
    feed.put(0.0)
    feed.put(0.0)
    r.start(f)                # warm-up run: function instantiation is not a stall
    r.fetch(fetch, 10)
    r.result(10)
    r.exec_seconds = 0.0
    feed.reset_stats()
    fetch.reset_stats()
    r.start(f)
    time.sleep(0.2)           # graph stalls on the first feed
    feed.put(1.0)
    r.fetch(fetch, 10)
    time.sleep(0.1)           # graph stalls on the second feed
    feed.put(2.0)
    r.result(10)
    t = timing(r, feeds=[feed], fetches=[fetch])
    assert t.graph_exec_s >= 0.28
    assert 0.25 <= t.graph_stall_s <= t.graph_exec_s + 0.01, t
    assert 0.0 <= t.python_stall_s < 0.2
    assert t == timing(r, [feed], [fetch])


def test_fetch_fails_at_once_when_no_run_can_fill_the_channel():
    fetch = FetchChannel(tf.float32, [], name="orphan")
    r = GraphRunner()
    with pytest.raises(TerraRuntimeError, match="orphan"):
        r.fetch(fetch, timeout=20)

    @tf.function(autograph=False)
    def f():
        return tf.constant(1.0)  # finishes without filling the channel

    r.start(f)
    r.result(10)
    t0 = time.perf_counter()
    with pytest.raises(TerraRuntimeError, match="no graph run is active"):
        r.fetch(fetch, timeout=20)
    assert time.perf_counter() - t0 < 2.0


def test_failing_error_context_hook_keeps_the_graph_error():
    def broken(index):
        raise KeyError(index)

    r = GraphRunner(error_context=broken)
    r.start(_nan_check_fn(), (tf.constant([np.nan]),))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"error_context\(7\) failed"):
        r.result(10)


def test_cancelling_the_runner_does_not_touch_function_calls_of_the_user_thread():
    """TF's own cancellable-call route sets a module-global context that a concurrent main-thread
    call would join; the runner passes its manager explicitly, so only its run is cancelled."""
    feed_a = FeedChannel(tf.float32, [], name="iso_a", timed=False)
    feed_b = FeedChannel(tf.float32, [], name="iso_b", timed=False)

    @tf.function(autograph=False)
    def background():
        return feed_a.dequeue_op()

    @tf.function(autograph=False)
    def user_side():
        return feed_b.dequeue_op() * 2.0

    user_side.get_concrete_function()
    r = GraphRunner()
    run = r.start(background)
    threading.Timer(0.1, r.cancel).start()            # cancels while the user call is blocked
    threading.Timer(0.4, feed_b.put, args=(5.0,)).start()
    assert float(user_side()) == 10.0                  # not cancelled
    assert wait_until(lambda: run.done, "runner cancel", 10) >= 0.0
    assert run.state == "cancelled"


def test_placeholders_resolve_from_a_running_graph():
    """A skeleton step: the graph computes, Python holds placeholders and syncs where it must."""
    from terra.runtime.placeholders import Placeholder

    x_feed = FeedChannel(tf.float32, [2], name="e2e_x")
    loss_fetch = FetchChannel(tf.float32, [], name="e2e_loss")
    w = tf.Variable([0.5, -1.0])

    @tf.function(autograph=False)
    def step():
        order = FeedFetchOrder()
        x = order.feed(x_feed)
        loss = tf.reduce_sum(x * w)
        order.fetch(loss_fetch, loss)
        w.assign_sub(0.1 * x)
        return loss

    r = GraphRunner()
    losses = []
    for i in range(3):
        x_feed.put([1.0 + i, 2.0])
        r.start(step)
        loss = Placeholder.create(tf.float32, [], FetchResolver(r, loss_fetch, timeout=10))
        losses.append(loss)                       # kept across iterations
        if loss > -100.0:                         # sync point: one fetch
            scaled = loss * 2.0                   # op on a placeholder gets the real value
        assert float(scaled) == 2.0 * float(loss)
        r.result(10)
    # eager reference
    wr, ref = tf.Variable([0.5, -1.0]), []
    for i in range(3):
        x = tf.constant([1.0 + i, 2.0])
        ref.append(float(tf.reduce_sum(x * wr)))
        wr.assign_sub(0.1 * x)
    assert [float(v) for v in losses] == ref
    np.testing.assert_array_equal(w.numpy(), wr.numpy())


@pytest.mark.slow
def test_interpreter_exits_cleanly_with_a_blocked_run():
    import subprocess
    import sys
    code = (
        "import tensorflow as tf, time\n"
        "from terra.runtime import FeedChannel, GraphRunner\n"
        "feed = FeedChannel(tf.float32, [], name='exit_feed')\n"
        "f = tf.function(lambda: feed.dequeue_op(), autograph=False)\n"
        "run = GraphRunner().start(f)\n"
        "time.sleep(0.3)\n"
        "print('state', run.state)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "state running" in out.stdout


def test_grappler_option_gives_eager_bits():
    # Grappler folds (x * 0.1) * 0.3 + 0.7 + 0.2 into fewer constants, which rounds differently.
    @tf.function(autograph=False)
    def f(x):
        return (x * 0.1) * 0.3 + 0.7 + 0.2

    x = tf.constant(np.random.default_rng(0).normal(size=1000).astype("float32"))
    eager = ((x * 0.1) * 0.3 + 0.7 + 0.2).numpy()
    concrete = f.get_concrete_function(x)
    outs = {}
    for grappler in (True, False):
        r = GraphRunner(grappler=grappler)
        assert r.grappler is grappler
        r.start(concrete, (x,))
        outs[grappler] = r.result(timeout=10).numpy()
    np.testing.assert_array_equal(outs[False], eager)
    assert np.any(outs[True] != eager)  # the default really runs Grappler
    with pytest.raises(TypeError, match="grappler"):
        GraphRunner(grappler="no")


def test_per_run_config_is_applied_on_the_worker_for_that_run_only():
    calls = []

    def no_remapper(config):
        calls.append((threading.current_thread().name, type(config).__name__))
        config.graph_options.rewrite_options.remapping = 2  # RewriterConfig.OFF

    @tf.function(autograph=False)
    def f(x):
        return x * 2.0

    runner = GraphRunner(name="config-runner")
    runner.start(f, (tf.constant(1.0),), config=no_remapper)
    assert float(runner.result(timeout=30)) == 2.0
    runner.start(f, (tf.constant(2.0),))
    assert float(runner.result(timeout=30)) == 4.0
    assert calls == [("config-runner", "ConfigProto")]
