"""Terra widens the collector's young generation while it records an iteration
(`tracing_gc_threshold`) and while it co-executes one (`coexec_gc_threshold`); eager iterations,
and everything once Terra is done, run under the program's own thresholds."""
import gc
import os
import weakref

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import terra


@pytest.fixture(autouse=True)
def _fresh():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    terra.reset()
    yield
    terra.reset()
    terra.config(tracing_gc_threshold=50000, coexec_gc_threshold=50000)
    gc.set_threshold(*old)


def _run(tape_cls, steps):
    w = tf.Variable(np.linspace(-1, 1, 16, dtype="float32").reshape(4, 4))
    x = tf.constant(np.ones((2, 4), "float32"))
    seen, losses = [], []
    for _ in range(steps):
        with tape_cls() as tape:
            loss = tf.reduce_sum(tf.tanh(x @ w))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        seen.append(gc.get_threshold()[0])
        losses.append(float(loss))
    return seen, losses, w.numpy()


def test_thresholds_are_wide_while_traced_and_the_programs_once_compiled():
    terra.config(coexec_gc_threshold=0)
    _, eager_losses, eager_w = _run(tf.GradientTape, 6)
    seen, losses, w = _run(tf.TerraGradientTape, 6)
    assert losses == eager_losses and np.array_equal(w, eager_w)
    stats = terra.stats()
    assert stats["traces"] == 2 and stats["graph_builds"] == 1
    # iterations 0 and 1 are recorded (the second sighting builds), then the graph runs
    assert seen == [50000, 50000, 700, 700, 700, 700]
    terra.end_iteration()
    assert gc.get_threshold() == (700, 10, 10)


def test_zero_leaves_the_collector_alone():
    terra.config(tracing_gc_threshold=0, coexec_gc_threshold=0)
    seen, _, _ = _run(tf.TerraGradientTape, 4)
    assert seen == [700] * 4


def test_coexecuted_iterations_keep_the_window_open_from_one_to_the_next():
    terra.config(coexec_gc_threshold=30000)
    _, eager_losses, eager_w = _run(tf.GradientTape, 6)
    counts = []
    gc.callbacks.append(lambda phase, info: counts.append(info["generation"])
                        if phase == "start" else None)
    try:
        seen, losses, w = _run(tf.TerraGradientTape, 6)
    finally:
        gc.callbacks.pop()
    assert losses == eager_losses and np.array_equal(w, eager_w)
    stats = terra.stats()
    assert stats["traces"] == 2 and stats["graph_builds"] == 1
    # recorded with the tracing threshold, compiled with the co-execution one
    assert seen == [50000, 50000, 30000, 30000, 30000, 30000]
    terra.end_iteration()
    assert gc.get_threshold() == (700, 10, 10)


def test_steady_coexecution_runs_only_the_bounding_collections():
    """A compiled iteration's placeholders and skeleton objects die with it: no collection runs
    but the young ones made every COLLECT_EVERY co-executed iterations (with Python's 700, this
    loop ran a young collection about every step, which promoted what it met)."""
    w = tf.Variable(np.ones((4, 4), "float32"))
    x = tf.constant(np.ones((2, 4), "float32"))
    counts = []

    def count(phase, info):
        if phase == "start":
            counts.append(info["generation"])
    try:
        for step in range(45):
            if step == 5:  # traced twice, built, compiled since iteration 2
                gc.collect()
                gc.callbacks.append(count)
            with tf.TerraGradientTape() as tape:
                h = x
                for _ in range(40):  # a placeholder per op: ~1,000 objects live per iteration
                    h = tf.tanh(h @ w)
                loss = tf.reduce_sum(h)
            w.assign_sub(0.1 * tape.gradient(loss, w))
            float(loss)
    finally:
        if count in gc.callbacks:
            gc.callbacks.remove(count)
        terra.end_iteration()
    stats = terra.stats()
    assert (stats["traces"], stats["fallbacks"], stats["graph_builds"]) == (2, 0, 1)
    # co-executed from iteration 3: the window passes on at iterations 4..45, 42 times; every
    # 16th pass collects the young generation (at iterations 19 and 35)
    assert counts == [0, 0]
    assert stats["young_collections"] == 2


def test_cyclic_garbage_waits_at_most_collect_every_iterations():
    from terra.runtime.session import COLLECT_EVERY

    class Junk:
        pass

    w = tf.Variable(np.ones((4, 4), "float32"))
    x = tf.constant(np.ones((2, 4), "float32"))
    refs = []
    alive_at = []
    for step in range(40):
        with tf.TerraGradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(x @ w))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        float(loss)
        j = Junk()
        j.me = j  # a cycle: only the collector frees it
        refs.append(weakref.ref(j))
        del j
        alive_at.append(sum(r() is not None for r in refs[2:]))  # made while co-executed
    terra.end_iteration()
    assert terra.stats()["young_collections"] == 2  # passes 16 and 32: iterations 19 and 35
    # the cycles made from step 2 on pile up, COLLECT_EVERY at most, until iteration 19's tape
    # entry collects them (the one of step 18 is made after it)
    assert max(alive_at) == COLLECT_EVERY
    assert alive_at[17] == COLLECT_EVERY and alive_at[18] == 1
