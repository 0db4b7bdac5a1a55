"""A path first traced by a fallback that diverged inside a refused fast path: skip mode had
refused the C fast path of an op taking a variable (a Keras layer's kernel), and the op's slow
route diverged at the variable read it makes first. The new path's trace marks that op as
eager's fast-path-first route, so its later runs refuse the fast path again and match the read,
instead of falling back at the same op every time they are taken (5 fallbacks in 11 steps
before; sdpoint fell back so on each path first met this way). Equal to eager, exact counts."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")

ORDER = [1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 0]


def _program(Tape):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    conv = keras.layers.Conv2D(4, 3, padding="same")
    x = tf.constant(rng.normal(size=(2, 8, 8, 3)).astype(np.float32))
    conv(x)
    opt = keras.optimizers.SGD(0.01)
    losses = []
    for resize in ORDER:
        with Tape() as tape:
            h = x
            if resize:  # the branch's op sits where the other path's conv reads its kernel
                h = tf.image.resize(h, (6, 6))
            h = keras.ops.relu(conv(h))
            loss = tf.reduce_sum(h * h)
        g = tape.gradient(loss, conv.trainable_variables)
        opt.apply_gradients(zip(g, conv.trainable_variables))
        losses.append(float(loss))
    return losses, conv


def test_a_path_first_met_inside_a_refused_fast_path_runs_compiled_afterwards():
    eager = _program(tf.GradientTape)
    with CompileCounter() as c:
        got = _program(tf.TerraGradientTape)
    assert got[0] == eager[0]
    for a, b in zip(got[1].weights, eager[1].weights):
        assert np.array_equal(a.numpy(), b.numpy())
    # iteration 1 makes the optimizer's slots (not compilable), 2-3 trace and build the resize
    # path, 4 falls back into the other branch and builds it at once; from then on the branches
    # alternate by switches (iterations 7, 8 and 10), with no further fallback
    c.assert_counts(traces=4, fallbacks=1, graph_builds=2, path_switches=3)
