"""Terra widens the collector's young generation only while it records an iteration: compiled
iterations run under the program's own thresholds."""
import gc
import os

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
    terra.config(tracing_gc_threshold=50000)
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
    terra.config(tracing_gc_threshold=0)
    seen, _, _ = _run(tf.TerraGradientTape, 4)
    assert seen == [700] * 4
