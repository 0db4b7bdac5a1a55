"""An iteration ended before the last ops of its path (terra.end_iteration() between steps, as a
benchmark harness does, while the program prepares the next step's data before the next tape):
when those ops are pure, the path's graph still runs the iteration (`pure_tails`); when one of
them changes state, the iteration falls back, as before. Both equal eager."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _program(Tape, stateful_prep, steps=18, block=3):
    rng = np.random.default_rng(2)
    w = tf.Variable(rng.normal(size=(4, 4)).astype(np.float32) * 0.5)
    prepared = tf.Variable(0.0)
    data = [tf.constant(rng.normal(size=(6, 5)).astype(np.float32)) for _ in range(3)]
    losses = []
    for i in range(steps):
        # this step's data, prepared before its tape: part of the previous iteration, which
        # lasts until this tape's __enter__, except after end_iteration()
        batch = data[i % 3]
        x, y = batch[:, :4], batch[:, 4:]
        if stateful_prep:
            prepared.assign_add(1.0)
        with Tape() as tape:
            loss = tf.reduce_mean((tf.reduce_sum(tf.matmul(x, w), 1, keepdims=True) - y) ** 2)
        g = tape.gradient(loss, w)
        w.assign_sub(0.1 * g)
        losses.append(float(loss))
        if (i + 1) % block == 0 and Tape is tf.TerraGradientTape:
            terra.end_iteration()  # the next step's preparation runs outside any iteration
    return losses, [w.numpy(), prepared.numpy()]


@pytest.mark.parametrize("stateful_prep", [False, True], ids=["pure", "stateful"])
def test_iteration_ended_before_the_last_ops_of_its_path(stateful_prep):
    eager = _program(tf.GradientTape, stateful_prep)
    got = _program(tf.TerraGradientTape, stateful_prep)
    terra.end_iteration()
    stats, explain = terra.stats(), terra.explain()
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-6)
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    if stateful_prep:
        assert stats["pure_tails"] == 0, explain
        assert "iteration ended early" in explain, explain
    else:
        # 18 iterations in blocks of 3: each block's end cuts p0's last 2 (pure) ops, at
        # iterations 3, 6, ..., 18
        assert stats["pure_tails"] == 6, explain
        assert "those ops are pure" in explain, explain
        # no path for the cut iterations: p0, built at iteration 2, runs all of them
        assert stats["fallbacks"] == 0, explain
