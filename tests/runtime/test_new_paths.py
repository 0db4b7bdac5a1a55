"""`new_paths`: the distinct paths a site meets, each traced once before a graph can run it. A
Python-random branch among several depths: every branch the program takes is one new path, and
the traces are those paths plus the first compiled path's second sighting. Equal to eager."""
import os
import random

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def _random_depth(Tape, branches, steps=30):
    rng = random.Random(11)
    w = tf.Variable(np.linspace(-0.5, 0.5, 12, dtype=np.float32).reshape(4, 3))
    x = tf.constant(np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32))
    losses, taken = [], []
    for _ in range(steps):
        depth = rng.randrange(branches)  # a Python draw: one op sequence per depth
        taken.append(depth)
        with Tape() as tape:
            h = tf.matmul(x, w)
            for _ in range(depth):
                h = tf.tanh(h) * 1.5
            loss = tf.reduce_mean(h ** 2)
        w.assign_sub(0.05 * tape.gradient(loss, w))
        losses.append(float(loss))
    return losses, w.numpy(), taken


# branches -> (traces, new paths, graph builds, fallbacks, path switches). Paths met before the
# site's first graph are each traced twice (a site that has not compiled builds a path at its
# second sighting); a path met later is traced once, after a fallback. With 3 branches 2 paths
# come before the first graph (3 + 2 traces), with 7 three do (7 + 3); the last of the 7,
# met once, gets no graph (runtime/policy.py: when a path met after the first graph is built).
COUNTS = {3: (5, 3, 3, 2, 17), 7: (10, 7, 6, 6, 18)}


@pytest.mark.parametrize("branches", sorted(COUNTS))
def test_each_branch_taken_is_one_new_path(branches):
    eager = _random_depth(tf.GradientTape, branches)
    with CompileCounter() as c:
        got = _random_depth(tf.TerraGradientTape, branches)
    assert got[0] == eager[0] and np.array_equal(got[1], eager[1])
    assert c.new_paths == len(set(got[2]))
    traces, paths, builds, fallbacks, switches = COUNTS[branches]
    c.assert_counts(traces=traces, new_paths=paths, graph_builds=builds, fallbacks=fallbacks,
                    path_switches=switches)
