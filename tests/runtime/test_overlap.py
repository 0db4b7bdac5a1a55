"""Pipelined iterations: Python starts iteration i+1 while the graph still runs iteration i.

Checks that the overlap happens, that results equal eager with it on and off, that a fallback in
iteration i+1 waits for run i, that values kept from iteration i resolve after i+1 began, and
what happens when run i fails after iteration i's last sync point (the error surfaces at the next
sync point, variables exactly as eager leaves them at the error)."""
import os
import re
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(overlap_iterations=True)
    yield
    terra.reset()
    terra.config(**old)


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _data(steps, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(steps, 8, 4)).astype(np.float32),
            rng.normal(size=(steps, 8, 1)).astype(np.float32))


def _weights(model, opt):
    return [v.numpy() for v in model.variables] + [np.asarray(v.numpy()) for v in opt.variables]


def _train(Tape, steps=12, keep=None, diverge_at=()):
    model, opt = _model(), keras.optimizers.Adam(0.01)
    X, Y = _data(steps)
    losses, kept = [], []
    for i in range(steps):
        with Tape() as tape:
            h = model(X[i])
            if i in diverge_at:  # a path never seen before, taken before any sync point
                h = h * 2.0
            loss = tf.reduce_mean((h - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if keep is not None:
            kept.append(loss)         # read only after later iterations began
        else:
            losses.append(float(loss))
    if keep is not None:
        losses = [float(x) for x in kept]
    return losses, _weights(model, opt)


def _assert_same(a, b):
    np.testing.assert_allclose(a[0], b[0], rtol=1e-5, atol=1e-7)
    for x, y in zip(a[1], b[1]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overlap", [True, False])
def test_equal_to_eager_with_and_without_overlap(overlap):
    terra.config(overlap_iterations=overlap)
    eager = _train(tf.GradientTape)
    got = _train(tf.TerraGradientTape)
    terra.end_iteration()
    stats = terra.stats()
    _assert_same(got, eager)
    assert (stats["traces"], stats["graph_builds"]) == (3, 1), terra.explain()
    if overlap:  # every co-executed iteration (12 less the 3 traced) ended without waiting
        assert stats["overlapped_iterations"] == 12 - 3, stats
    else:
        assert stats["overlapped_iterations"] == 0, stats


def test_values_kept_from_a_finished_iteration_resolve_later():
    eager = _train(tf.GradientTape, keep=True)
    got = _train(tf.TerraGradientTape, keep=True)
    terra.end_iteration()
    _assert_same(got, eager)
    assert terra.stats()["overlapped_iterations"] == 12 - 3, terra.explain()


def test_the_wait_for_an_earlier_run_is_stall_not_skeleton_time(monkeypatch):
    """An iteration that ends while its run goes on is collected at a later sync point (the
    next iteration's end): Python waits there for the graph, and that wait counts in
    `python_stall_s` and not in `python_exec_s` (the skeleton's own time). Each collect here
    waits 50 ms more than the run needs, so a wait counted as the skeleton's would show."""
    from terra.runtime.graph_runner import GraphRunner
    eager = _train(tf.GradientTape, keep=True)
    waits, result = [], GraphRunner.result

    def slow_result(self, *args, **kwargs):
        t = time.perf_counter()
        time.sleep(0.05)
        try:
            return result(self, *args, **kwargs)
        finally:
            waits.append(time.perf_counter() - t)
    monkeypatch.setattr(GraphRunner, "result", slow_result)
    before, t = terra.stats(), time.perf_counter()
    got = _train(tf.TerraGradientTape, keep=True)
    terra.end_iteration()
    wall, after = time.perf_counter() - t, terra.stats()
    _assert_same(got, eager)
    assert (after["traces"], after["graph_builds"], after["overlapped_iterations"]) == \
        (3, 1, 12 - 3), terra.explain()
    assert len(waits) == 12 - 3  # one collect per overlapped iteration
    stall = after["python_stall_s"] - before["python_stall_s"]
    execute = after["python_exec_s"] - before["python_exec_s"]
    assert stall >= sum(waits), (stall, waits)
    assert 0 < execute and execute + stall <= wall, (execute, stall, wall)


def test_fallback_in_the_next_iteration_waits_for_the_previous_run():
    eager = _train(tf.GradientTape, diverge_at=(7, 9))
    got = _train(tf.TerraGradientTape, diverge_at=(7, 9))
    terra.end_iteration()
    stats = terra.stats()
    _assert_same(got, eager)
    # one fallback (the first divergence: the second path is then compiled), and every
    # co-executed iteration but the one that fell back overlapped
    assert (stats["traces"], stats["fallbacks"], stats["graph_builds"]) == (4, 1, 2), \
        terra.explain()
    assert stats["overlapped_iterations"] == 8, terra.explain()


def _late_error_program(Tape, steps=9, bad=6, last=False, loop_try=False):
    """The op that fails (an out-of-range gather, or with `last` an out-of-range scatter that is
    the iteration's last op) runs after the iteration's last sync point: it feeds the variable
    update only. The except handler captures the variables. The `try` is around each step, or
    with `loop_try` around the whole loop (the error ends it)."""
    model, opt = _model(5), keras.optimizers.SGD(0.05)
    X, Y = _data(steps)
    table = tf.Variable([1.0, 2.0, 3.0, 4.0])
    shift = tf.Variable(0.0)
    losses, errors, at_error = [], [], None

    def step(i):
        idx = (np.arange(100) % 4).astype(np.int32)   # a feed (too big for a constant)
        if i == bad:
            idx[50] = 7
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
        losses.append(float(loss))            # the last sync point of the iteration
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if last:
            table.scatter_nd_update(idx[:, None], tf.ones([100]))
        else:
            shift.assign_add(tf.reduce_sum(tf.gather(table, idx)) * 1e-3)

    def caught(i, e):
        nonlocal at_error
        lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                 if f.filename == __file__]
        errors.append((i, str(e), lines[-1]))
        if at_error is None:
            at_error = [v.numpy() for v in model.variables] + [shift.numpy(), table.numpy()]

    if loop_try:
        i = 0
        try:
            for i in range(steps):
                step(i)
        except tf.errors.InvalidArgumentError as e:
            caught(i, e)
    else:
        for i in range(steps):
            try:
                step(i)
            except tf.errors.InvalidArgumentError as e:
                caught(i, e)
    return losses, errors, at_error, [v.numpy() for v in model.variables] + [shift.numpy(),
                                                                             table.numpy()]


@pytest.mark.parametrize("overlap,last", [(True, False), (False, False), (True, True),
                                          (False, True)])
def test_an_error_in_a_step_try_is_raised_at_that_step(overlap, last):
    """A `try` around each step: the step's run ends inside it (PathView.end_sync), so its
    error is that step's, as in eager, and training goes on equal to eager."""
    terra.config(overlap_iterations=overlap)
    e_losses, e_errors, e_at, e_final = _late_error_program(tf.GradientTape, last=last)
    t_losses, t_errors, t_at, t_final = _late_error_program(tf.TerraGradientTape, last=last)
    terra.end_iteration()
    explain = terra.explain()
    assert [i for i, *_ in e_errors] == [6]
    assert [i for i, *_ in t_errors] == [6], (t_errors, explain)
    assert "terra: raised by op" in t_errors[0][1], t_errors
    line = int(re.search(r"test_overlap\.py:(\d+) \((?:\w+\.<locals>\.)?step\)", t_errors[0][1])[1])
    assert ("scatter_nd_update" if last else "tf.gather(table") in \
        open(__file__).read().splitlines()[line - 1]
    assert t_errors[0][2] == e_errors[0][2] == line, (t_errors, e_errors)
    np.testing.assert_allclose(t_losses, e_losses, rtol=1e-5, atol=1e-7)
    for a, b in zip(t_at + t_final, e_at + e_final):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("overlap,last", [(True, False), (False, False), (True, True),
                                          (False, True)])
def test_error_after_the_last_sync_point_surfaces_at_the_next_one(overlap, last):
    terra.config(overlap_iterations=overlap)
    e_losses, e_errors, e_at, _ = _late_error_program(tf.GradientTape, last=last, loop_try=True)
    t_losses, t_errors, t_at, t_final = _late_error_program(tf.TerraGradientTape, last=last,
                                                            loop_try=True)
    terra.end_iteration()
    explain = terra.explain()
    assert [i for i, *_ in e_errors] == [6]
    # raised once: in iteration 6 if Python still issued an op of it after the graph failed,
    # else in iteration 7 (the program had left iteration 6 already)
    assert len(t_errors) == 1 and t_errors[0][0] in ((7,) if last else (6, 7)), \
        (t_errors, explain)
    assert "indices" in t_errors[0][1] or "index" in t_errors[0][1], t_errors
    assert "terra: raised by op" in t_errors[0][1], t_errors
    # the program's own line, not a bytecode offset
    assert re.search(r"test_overlap\.py:(\d+) \((?:\w+\.<locals>\.)?step\)", t_errors[0][1]), t_errors
    line = int(re.search(r"test_overlap\.py:(\d+) \((?:\w+\.<locals>\.)?step\)", t_errors[0][1])[1])
    assert ("scatter_nd_update" if last else "tf.gather(table") in \
        open(__file__).read().splitlines()[line - 1]
    # the traceback ends at the failing op's line, as eager's (runtime/user_traceback.py)
    assert t_errors[0][2] == e_errors[0][2] == line, (t_errors, e_errors)
    # the variables are exactly what eager leaves at the error (iteration 7 wrote nothing yet)
    for a, b in zip(t_at, e_at):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # the losses read before the error are eager's (the loop ends at the error)
    np.testing.assert_allclose(t_losses[:7], e_losses[:7], rtol=1e-5, atol=1e-7)
    if t_errors[0][0] == 7 and overlap:  # raised at iteration 7's first sync point
        assert "surfaces here" in t_errors[0][1], t_errors
    assert np.all(np.isfinite(np.concatenate([np.ravel(v) for v in t_final])))


def _cycling_shapes(Tape, steps=12):
    """Sequence length cycles per step; inputs are sliced before the tape (the tail of the
    previous iteration) and the model reads its length with tf.shape and int()."""
    keras.utils.set_random_seed(4)
    emb = keras.layers.Embedding(20, 6)
    pos = keras.layers.Embedding(16, 6)
    head = keras.layers.Dense(20)
    opt = keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(2)
    batches = [tf.constant(rng.integers(0, 20, (4, n + 1)), tf.int32) for n in (12, 9, 6)]
    losses, lengths = [], []
    for i in range(steps):
        tokens = batches[i % 3]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        with Tape() as tape:
            n = tf.shape(inputs)[1]
            lengths.append(int(n))          # a read the path fixes: no wait for the graph
            h = emb(inputs) + pos(tf.range(n))[None]
            logits = head(h)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
        variables = emb.trainable_variables + pos.trainable_variables + head.trainable_variables
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        losses.append(float(loss))
    assert lengths == [12, 9, 6] * (steps // 3)
    return losses, [v.numpy() for v in variables] + [np.asarray(v.numpy()) for v in opt.variables]


def test_cycling_shapes_with_inputs_sliced_before_the_tape():
    eager = _cycling_shapes(tf.GradientTape)
    got = _cycling_shapes(tf.TerraGradientTape)
    terra.end_iteration()
    stats = terra.stats()
    _assert_same(got, eager)
    # lengths 9 and 6 form a shape group (one graph, which computes the shape constants from
    # the length it is fed), length 12 runs on it untraced; the last iteration (the variables
    # read after the loop) is a path of its own, not built (no next iteration came:
    # runtime/filing.py, `last`)
    assert (stats["traces"], stats["graph_builds"], stats["graph_reuses"]) == (4, 1, 0), \
        terra.explain()
    assert stats["static_reads"] >= 3, terra.explain()
    assert stats["overlapped_iterations"] >= 3, stats


def test_no_graph_run_is_in_flight_when_a_fallback_replays_eagerly(monkeypatch):
    """A fallback at the first feed of iteration i+1 (a batch of a new shape: the run of i+1 has
    not started) must still wait for run i: the eager replay and tracing read the variables."""
    from terra.runtime import inflight as inflight_mod
    from terra.runtime import iteration as iteration_mod
    from terra.runtime import session as session_mod
    seen = []

    class Checked(iteration_mod.EagerReplay):
        def run(self, upto):
            s = session_mod.SESSION
            seen.append((s.runner.done, len(s.inflight.pending)))
            return super().run(upto)

    # the fallback's replay (Iteration.fallback) and a late failure's (InFlight.collect)
    monkeypatch.setattr(iteration_mod, "EagerReplay", Checked)
    monkeypatch.setattr(inflight_mod, "EagerReplay", Checked)

    def program(Tape, steps=14):
        model, opt = _model(7), keras.optimizers.Adam(0.01)
        X, Y = _data(steps)
        losses = []
        for i in range(steps):
            n = 8 if i % 5 != 4 else 3           # now and then a smaller batch
            with Tape() as tape:
                loss = tf.reduce_mean((model(X[i][:n]) - Y[i][:n]) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        return losses, _weights(model, opt)

    eager = program(tf.GradientTape)
    got = program(tf.TerraGradientTape)
    terra.end_iteration()
    _assert_same(got, eager)
    assert seen and all(done and not pending for done, pending in seen), seen
    assert terra.stats()["overlapped_iterations"] >= 1


def test_unread_fetches_and_finished_iterations_do_not_pile_up():
    """Values kept past the iteration but read only at the end (`keep`) have fetch channels that
    no later iteration reads: their elements are taken every DROP_EVERY collected runs, and at
    the end, not left in the queues (which grew by one element per channel and iteration, the
    memory of a whole model's worth of tensors per step), and a collected iteration lets go of
    its runner, run and variable snapshot."""
    from terra.compiler.channels import DROP_EVERY
    from terra.runtime.session import SESSION

    eager = _train(tf.GradientTape, steps=16, keep=True)
    iterations = []
    inflight = SESSION.inflight
    real = inflight.collect

    def spy(*a, **k):
        iterations.extend(inflight.pending)
        return real(*a, **k)

    inflight.collect = spy
    try:
        model, opt = _model(), keras.optimizers.Adam(0.01)
        X, Y = _data(16)
        kept, queued = [], []
        for i in range(16):
            with tf.TerraGradientTape() as tape:
                loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            kept.append(loss)
            queued.append(sum(ch.size() for g in SESSION._graphs
                              for ch in g.fetch_channels.values()))
        terra.end_iteration()
    finally:
        inflight.collect = real
    np.testing.assert_allclose([float(x) for x in kept], eager[0], rtol=1e-5, atol=1e-7)
    (graph,) = SESSION._graphs
    assert len(graph.fetch_channels) >= 1
    # at most the elements of DROP_EVERY runs, never a growing backlog
    assert max(queued) <= DROP_EVERY * len(graph.fetch_channels), queued
    assert any(b < a for a, b in zip(queued, queued[1:])), queued  # (taken, not drained)
    assert sum(ch.size() for ch in graph.fetch_channels.values()) == 0 and not graph.stale
    collected = [it for it in iterations if not it.pending]
    assert collected and all(it.runner is None and it.snap is None and it.run is None
                             for it in collected)


@pytest.mark.parametrize("settings", [{"overlap_iterations": False}, {"coexecution": False}],
                         ids=["no_overlap", "lazy"])
def test_iterations_finished_without_overlap_let_go_of_their_run(settings, monkeypatch):
    """Without pipelining an iteration waits for its run when it finishes; it then drops its
    runner, run and variable snapshot as a collected pipelined one does."""
    from terra.runtime.iteration import Iteration

    eager = _train(tf.GradientTape, steps=10)
    finished, real_finish = [], Iteration.finish

    def finish(it):
        real_finish(it)
        finished.append(it)

    monkeypatch.setattr(Iteration, "finish", finish)
    old = terra.config(**settings)
    try:
        got = _train(tf.TerraGradientTape, steps=10)
        terra.end_iteration()
    finally:
        terra.config(**old)
    _assert_same(got, eager)
    coexecuted = [it for it in finished if it.path is not None and it.path.graph is not None
                  and it.outputs]
    assert len(coexecuted) >= 5, terra.explain()
    assert all(it.runner is None and it.snap is None and it.run is None for it in coexecuted)
