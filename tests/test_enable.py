"""`terra.enable()` / `terra.disable()`: every public `tf.GradientTape` name is Terra's tape while
enabled, TF's own object (by identity) after; Keras' trainer entry points likewise."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra import _tf_private as tfp  # noqa: E402
from terra.tracing import hook  # noqa: E402

PLAIN = tfp.PlainGradientTape


@pytest.fixture(autouse=True)
def _fresh():
    terra.disable()
    terra.reset()
    yield
    terra.disable()
    terra.reset()


def _public_names():
    return [tf, tf.autodiff, tf.compat.v2, tf.compat.v1]


def test_enable_rebinds_every_public_name_and_disable_restores_each_by_identity():
    trainer = tfp.keras_trainer_class()
    before = {a: trainer.__dict__[a] for a in tfp.KERAS_TRAINER_BOUNDARIES}
    assert all(m.GradientTape is PLAIN for m in _public_names())
    terra.enable()
    assert terra.is_enabled()
    assert all(m.GradientTape is terra.GradientTape for m in _public_names())
    assert all(trainer.__dict__[a] is not before[a] for a in before)
    assert {a for _, a in hook.replaced_attributes()} == {"GradientTape", *before}
    terra.disable()
    assert not terra.is_enabled()
    assert all(m.GradientTape is PLAIN for m in _public_names())
    assert all(trainer.__dict__[a] is before[a] for a in before)
    assert hook.replaced_attributes() == []
    from tensorflow.python.eager import backprop  # TF's own module is never touched
    assert backprop.GradientTape is PLAIN


def test_enable_is_idempotent_and_the_context_manager_restores_the_state_before():
    terra.enable()
    terra.enable()
    with terra.enable():
        assert tf.GradientTape is terra.GradientTape
    assert tf.GradientTape is terra.GradientTape  # it was enabled before the `with`
    terra.disable()
    assert tf.GradientTape is PLAIN
    with terra.enable() as e:
        assert tf.GradientTape is terra.GradientTape
        assert e is not None
    assert tf.GradientTape is PLAIN
    terra.disable()  # disabling twice is harmless
    assert tf.GradientTape is PLAIN


def _loop(steps=8):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(0.05)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        x = rng.normal(size=(5, 3)).astype(np.float32)
        with tf.GradientTape() as tape:  # the program's own, unmodified tape
            loss = tf.reduce_mean(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy() for v in model.variables]


def test_an_unmodified_loop_runs_under_terra_and_equals_eager():
    eager = _loop()
    with terra.enable():
        got = _loop()
    assert got[0] == eager[0]
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)
    s = terra.stats()
    # 1: the optimizer builds its slots (not compilable); 2, 3: the path repeats and is built
    assert (s["iterations"], s["traces"], s["graph_builds"], s["fallbacks"]) == (8, 3, 1, 0)
    assert s["phase"] == "idle"  # disable() finished the last iteration


def test_a_tape_inside_a_tf_function_stays_plain():
    w = tf.Variable(2.0)

    @tf.function
    def grad(x):
        with tf.GradientTape() as tape:
            y = w * x * x
        return tape.gradient(y, w)

    with terra.enable():
        assert float(grad(tf.constant(3.0))) == 9.0
        assert float(grad(tf.constant(4.0))) == 16.0
    assert terra.stats()["iterations"] == 0


def test_reset_keeps_terra_enabled():
    terra.enable()
    terra.reset()
    assert tf.GradientTape is terra.GradientTape
