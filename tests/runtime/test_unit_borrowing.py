"""A trace recorded after a fallback takes the units its ops share with the site's other paths
(runtime/sites.py, `borrowed_units`): the call the fallback came in was recorded from its
middle, so it had no unit of its own, and the same ops traced eagerly filed as a second path.

The program is SDPoint's shape: Python picks where an extra op goes between two user-defined
blocks (each one coarse unit). A run on the path with the extra op before the second block,
when Python skips it this time, diverges inside that block's call."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    yield
    terra.reset()


class Block(keras.layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.d1 = keras.layers.Dense(8, activation="relu")
        self.d2 = keras.layers.Dense(8)

    def call(self, x):
        return x + self.d2(self.d1(x))


# iteration 1 makes the optimizer's state; 2 traces the plain path eagerly; 3 and 4 the
# scaled one (built at its second sighting); 5 runs the scaled path's graph, and Python,
# skipping the scale, calls the second block where the path scales: the fallback comes inside
# that call; 6 and 7 run the plain path's graph
CHOICES = [False, False, True, True, False, False, False]


def run(Tape):
    keras.utils.set_random_seed(3)
    blocks = [Block(), Block()]
    head = keras.layers.Dense(1)
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(len(CHOICES), 4, 8)).astype(np.float32)
    Y = rng.normal(size=(len(CHOICES), 4, 1)).astype(np.float32)
    losses = []
    for i, scale in enumerate(CHOICES):
        with Tape() as tape:
            x = blocks[0](X[i])
            if scale:
                x = x * 0.5
            x = blocks[1](x)
            loss = tf.reduce_mean((head(x) - Y[i]) ** 2)
        variables = [v for b in blocks for v in b.trainable_variables] + head.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        losses.append(float(loss))
    return losses, [v.numpy() for b in blocks for v in b.weights] + [v.numpy() for v in head.weights]


def test_a_trace_after_a_fallback_inside_a_call_files_with_the_eager_trace_of_its_ops():
    eager = run(tf.GradientTape)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape)
    assert got[0] == eager[0]
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)
    # the trace of iteration 5 is the plain path's second sighting: built, and run by 6 and 7
    c.assert_counts(traces=5, new_paths=3, fallbacks=1, graph_builds=2)
    (site,) = SESSION.sites.values()
    plain, scaled = sorted((p for p in site.paths.values() if p.graph is not None),
                           key=lambda p: len(p.trace.records))
    assert plain.count == 2, terra.explain()
    # both paths skip each block whole: same units where their ops agree
    assert len(plain.units) == len(scaled.units), (plain.units.keys(), scaled.units.keys())
    assert f"path p{plain.id} seen 2 times" in terra.explain(), terra.explain()
