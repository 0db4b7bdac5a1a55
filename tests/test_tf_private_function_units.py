"""Fails loudly if TF changes what the tf.function-unit section of terra/_tf_private.py relies on:
the polymorphic `Function.__call__` entry point, the tape-state query, the cached forward/backward
pair of a `__forward_` function and its tape recording, and the function body's op types."""
import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra import _tf_private as tfp  # noqa: E402


def test_tf_function_returns_the_patched_class_and_calls_through_dunder_call():
    f = tf.function(lambda x: x + 1.0)
    assert type(f) is tfp.PolymorphicFunction, "tf.function no longer returns polymorphic Function"
    assert "__call__" in tfp.PolymorphicFunction.__dict__
    assert list(inspect.signature(tfp.PolymorphicFunction.__call__).parameters)[1:] == \
        ["args", "kwds"]
    assert tfp.function_runs_eagerly(f) is False
    tf.config.run_functions_eagerly(True)
    try:
        assert tfp.function_runs_eagerly(f) is True
    finally:
        tf.config.run_functions_eagerly(False)


def test_could_possibly_record_follows_the_tape_stack():
    assert tfp.could_possibly_record() is False
    with tf.GradientTape():
        assert tfp.could_possibly_record() is True
    assert tfp.could_possibly_record() is False


def _forward_call(f, w):
    """Call `f(w)` under a tape; return the name of the `__forward_` function TF called."""
    names = []
    original = tfp.AtomicFunction.call_flat

    def spy(self, *args):
        names.append(tfp.atomic_function_name(self))
        return original(self, *args)

    tfp.AtomicFunction.call_flat = spy
    try:
        with tf.GradientTape() as tape:
            y = f(w)
        g = tape.gradient(y, w)
    finally:
        tfp.AtomicFunction.call_flat = original
    return [n for n in names if n.startswith("__forward_")], g


def test_tape_functions_of_finds_the_forward_pair_and_replays_its_gradient():
    w = tf.Variable([1.0, -2.0, 3.0])
    f = tf.function(lambda v: tf.reduce_sum(v * v * v))
    forwards, g_tf = _forward_call(f, w)
    assert len(forwards) == 1, forwards
    functions = tfp.tape_functions_of(f, forwards[0])
    assert functions is not None, "TF moved the cached forward/backward pair of a concrete function"
    assert tfp.tape_functions_of(f, "__forward_nothing_1") is None
    wrapped = tfp.TapeRecordedFunction(functions._forward, functions)
    assert wrapped.name == functions._forward.name
    with tf.GradientTape() as tape:   # the replay calls the forward function on the handle
        outs = wrapped.call_flat(w.handle)
    assert tape.gradient(outs[0], w) is None   # w is not known to be the argument: not watched
    wrapped.add_variable(w)
    with tf.GradientTape() as tape:
        outs = wrapped.call_flat(w.handle)
    g = tape.gradient(outs[0], w)
    assert g is not None, "recording the forward call did not reach the tape"
    np.testing.assert_array_equal(g.numpy(), g_tf.numpy())
    np.testing.assert_array_equal(g.numpy(), 3 * w.numpy() ** 2)
    plain = functions._forward.call_flat(w.handle)   # without recording: no gradient
    with tf.GradientTape() as tape:
        plain = functions._forward.call_flat(w.handle)
    assert tape.gradient(plain[0], w) is None


def test_function_op_types_see_nested_bodies_and_static_outputs():
    @tf.function
    def inner(x):
        return x + tf.random.uniform(tf.shape(x))

    @tf.function
    def outer(x):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: inner(x), lambda: x * 2.0)

    atomic = outer.get_concrete_function(tf.TensorSpec([3]))._inference_function
    types = tfp.function_op_types(atomic)
    assert {"If", "RandomUniform", "Mul"} <= types, types
    masked = tf.function(lambda x: tf.boolean_mask(x, x > 0))
    atomic = masked.get_concrete_function(tf.TensorSpec([3]))._inference_function
    assert "Where" in tfp.function_op_types(atomic) or "Where" in str(tfp.function_op_types(atomic))
