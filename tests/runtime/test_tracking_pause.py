"""Loop tracking (a global trace function while an iteration is recorded) is paused while library
code that Terra runs as one unit runs: a built-in layer's call, `tape.gradient`,
`apply_gradients`. User code that runs inside them counts its loop passes at op time; the
results equal eager's either way."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.tracing import locations  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

SEEN = []


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(timeout_s=30.0)
    SEEN.clear()
    yield
    terra.reset()
    terra.config(**old)


def looped_activation(x):
    """A user activation with a Python loop, called by a built-in Dense layer."""
    SEEN.append(("activation", sys.gettrace() is locations._global_trace))
    for k in range(3):
        x = x * 0.5 + float(k)
    return tf.nn.relu(x)


class Looped(keras.layers.Layer):
    """A user layer whose call loops over its sublayers (and skips one pass's ops)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.dense = [keras.layers.Dense(4, activation=looped_activation) for _ in range(3)]

    def call(self, x):
        SEEN.append(("layer", sys.gettrace() is locations._global_trace))
        for k, d in enumerate(self.dense):
            if k != 1:
                x = x + d(x)
        return x


def train(Tape, steps=6):
    keras.utils.set_random_seed(0)
    layer = Looped()
    head = keras.layers.Dense(1)
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x = tf.constant(rng.normal(size=(8, 4)).astype(np.float32))
        with Tape() as tape:
            loss = tf.reduce_mean(head(layer(x)) ** 2)
        variables = layer.trainable_variables + head.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        losses.append(float(loss))
    return losses, [v.numpy().tolist() for v in layer.variables + head.variables]


def test_a_built_in_layer_runs_untracked_and_equals_eager():
    eager = train(tf.GradientTape)
    assert SEEN and not any(tracked for _, tracked in SEEN)  # eager: nothing is tracked
    SEEN.clear()
    with CompileCounter() as c:
        got = train(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # iteration 1 traces the first calls, where the Dense layers are built (not yet units:
    # tracked); iterations 2 and 3 trace the user layer's call with loop tracking on, the
    # activation inside each built-in Dense without it
    assert SEEN[:3] == [("layer", True), ("activation", True), ("activation", True)], SEEN
    traced = SEEN[3:3 * 3]
    layer_calls = [t for kind, t in traced if kind == "layer"]
    activations = [t for kind, t in traced if kind == "activation"]
    assert layer_calls == [True, True], SEEN
    assert activations == [False] * 4, SEEN


def test_user_frames_begun_while_paused_count_passes_at_op_time():
    root = sys._getframe(0)
    loc = locations.Locator(root)
    try:
        def issue():  # stands for the op's own frames below the user's line
            return loc.location(sys._getframe(0))

        def body():
            out = []
            for _ in range(3):
                out.append(issue())
            return out
        tracked = body()
        paused = locations.pause_tracking()
        try:
            untracked = body()
        finally:
            locations.resume_tracking(paused)
    finally:
        loc.close()
    assert paused
    # each pass of the loop is a location of its own, counted by line events or at op time
    assert len(set(tracked)) == 3 and len(set(untracked)) == 3
