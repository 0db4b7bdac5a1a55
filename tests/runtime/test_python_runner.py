"""PythonRunner (skip mode): placeholders, divergence records, path signatures, generalization,
errors raised by the graph surfacing in the user's thread as the eager exception type."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.ir.records import ConstRef, FeedRef, OpRecord, Location, OutputRef, TensorSpec, Trace  # noqa: E402
from terra.runtime.divergence import Divergence  # noqa: E402
from terra.runtime.python_runner import SkipPlaceholder  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from terra.runtime.generalize import generalize  # noqa: E402
from terra.runtime.sites import path_signature  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _steps(n, body):
    v = tf.Variable([1.0, -2.0, 3.0])
    seen = []
    for i in range(n):
        with tf.TerraGradientTape() as tape:
            loss = body(v, i)
        seen.append((SESSION.iteration.mode, type(loss)))
        g = tape.gradient(loss, v)
        v.assign_sub(0.1 * g)
    terra.end_iteration()
    return v.numpy(), seen


def test_skip_mode_returns_tensor_placeholders():
    _, seen = _steps(5, lambda v, i: tf.reduce_sum(v * v))
    modes = [m for m, _ in seen]
    assert modes[:2] == ["tracing", "tracing"] and modes[2:] == ["skip"] * 3
    assert all(issubclass(t, tf.Tensor) for _, t in seen)
    assert seen[-1][1] is SkipPlaceholder


def test_divergence_record_and_equality_with_eager():
    def body(v, i):
        return tf.reduce_sum(v * v) + (0.0 if i != 4 else tf.reduce_sum(tf.sin(v)))
    vt, _ = _steps(7, body)
    v = tf.Variable([1.0, -2.0, 3.0])
    for i in range(7):
        with tf.GradientTape() as tape:
            loss = body(v, i)
        v.assign_sub(0.1 * tape.gradient(loss, v))
    np.testing.assert_allclose(vt, v.numpy(), rtol=1e-6)
    fallbacks = [e for e in SESSION.events if e.kind in ("fallback", "switch")]
    assert fallbacks and "test_python_runner.py" in fallbacks[0].where
    d = Divergence("f.py:3 (g)", "Sum", "Sin", 7, "different op")
    assert str(d) == "different op at op #7 (f.py:3 (g)): expected Sum, observed Sin"


def _rec(i, op, inputs, out="float32"):
    return OpRecord(i, op, (("T", "float32"),), inputs, (TensorSpec(out, (2,)),),
                    Location(("t.py:f@1",)))


def test_signature_ignores_fast_or_slow_route_and_location():
    a = Trace("s", [_rec(0, "Neg", (FeedRef(0),))])
    b = Trace("s", [OpRecord(0, "Neg", (("T", "float32"),), (FeedRef(0),),
                             (TensorSpec("float32", (2,)),), Location(("u.py:g@9",)), "fallback")])
    from terra.ir.records import Feed
    a.feeds = b.feeds = [Feed(0, TensorSpec("float32", (2,)), "numpy")]
    assert path_signature(a, {}) == path_signature(b, {})


def test_generalize_turns_changing_constants_into_one_feed():
    from terra.ir.records import Feed
    def trace(k):
        t = Trace("s", [_rec(0, "Neg", (FeedRef(0),)),
                        _rec(1, "Mul", (OutputRef(0), ConstRef(k, "float32"))),
                        _rec(2, "Mul", (OutputRef(1), ConstRef(k, "float32"))),
                        _rec(3, "Add", (OutputRef(2), ConstRef(1.0, "float32")))])
        t.feeds = [Feed(0, TensorSpec("float32", (2,)), "numpy")]
        t.feed_values = [np.zeros(2, np.float32)]
        return t
    g = generalize(trace(0.5), trace(0.25))
    assert [r.inputs for r in g.records][1:] == [(OutputRef(0), FeedRef(1)),
                                                 (OutputRef(1), FeedRef(1)),
                                                 (OutputRef(2), ConstRef(1.0, "float32"))]
    assert g.feeds[1].spec == TensorSpec("float32", ()) and g.feed_values[1] == 0.25
    assert generalize(trace(0.5), trace(0.5)) is None            # nothing changed
    other = trace(0.25)
    other.records[3] = _rec(3, "Sub", (OutputRef(2), ConstRef(1.0, "float32")))
    assert generalize(trace(0.5), other) is None                 # different op


def test_graph_error_surfaces_as_eager_exception_type():
    table = tf.constant([1.0, 2.0, 3.0])
    v = tf.Variable(1.0)
    errors = []
    for i in range(8):
        idx = np.array([0, 2] if i != 5 else [0, 7], np.int32)
        try:
            with tf.TerraGradientTape() as tape:
                loss = v * tf.reduce_sum(tf.gather(table, idx))
            g = tape.gradient(loss, v)
            v.assign_sub(0.01 * g)
            float(loss)
        except tf.errors.InvalidArgumentError as e:
            errors.append((i, str(e)))
    terra.end_iteration()
    assert [i for i, _ in errors] == [5]
    assert "7" in errors[0][1]
    assert abs(float(v.numpy()) - (1.0 - 0.01 * 4.0 * 7)) < 1e-5


def test_fetch_point_values_and_prints(capsys):
    v = tf.Variable([1.0, 2.0])
    got = []
    with CompileCounter() as c:
        for i in range(6):
            with tf.TerraGradientTape() as tape:
                loss = tf.reduce_sum(v * v)
            print(f"{loss:.3f}")
            got.append(float(loss))
            v.assign_sub(0.05 * tape.gradient(loss, v))
    out = capsys.readouterr().out.split()
    assert out == [f"{x:.3f}" for x in got]
    # one path: traced at iteration 1, seen again and built at 2; iterations 3-6 run its graph
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_keras_layer_units_are_skipped_and_guarded_on_settings():
    import keras

    def prog(Tape):
        keras.utils.set_random_seed(3)
        inp = keras.layers.Input((4,))
        h = keras.layers.Dense(6, activation="relu")(inp)
        h = keras.layers.Dropout(0.25, seed=1)(h)
        model = keras.Model(inp, keras.layers.Dense(1)(h))
        drop = model.layers[2]
        opt = keras.optimizers.SGD(0.05)
        x = tf.constant(np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4))
        out = []
        for i in range(8):
            if i == 5:
                drop.rate = 0.5          # a plain Python setting of a built-in layer changes
            with Tape() as tape:
                loss = tf.reduce_mean(model(x, training=True) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            out.append(float(loss))
        terra.end_iteration()
        return out, [v.numpy() for v in model.variables]
    le, ve = prog(tf.GradientTape)
    lt, vt = prog(tf.TerraGradientTape)
    np.testing.assert_allclose(lt, le, rtol=1e-6)
    for a, b in zip(ve, vt):
        np.testing.assert_allclose(b, a, rtol=1e-6)
    it_units = [p for s in SESSION.sites.values() for p in s.paths.values() if p.graph is not None]
    assert any(len(p.units) > 2 for p in it_units)  # layer units besides gradient and optimizer


def test_data_dependent_shapes_compile():
    def prog(Tape):
        v = tf.Variable([1.0, -2.0, 3.0, -4.0])
        sizes = []
        for i in range(6):
            with Tape() as tape:
                picked = tf.boolean_mask(v, v > float(i) - 3.0)   # size depends on the values
                sizes.append(int(picked.shape[0]))
                loss = tf.reduce_sum(picked ** 2)
            v.assign_sub(0.1 * tape.gradient(loss, v))
        terra.end_iteration()
        return sizes, v.numpy()
    se, ve = prog(tf.GradientTape)
    st, vt = prog(tf.TerraGradientTape)
    assert st == se
    np.testing.assert_allclose(vt, ve, rtol=1e-6)
    # compiled: the threshold becomes a feed, so one graph serves each step until the mask's
    # size changes; the gradient's ops wait for Python's check of that size (a gate), and a
    # size first seen is a new path (a fallback), each learning the fetch of `picked` once; the
    # paths of each size differ only in that size and the constants made from it, so they
    # share one graph (a shape group: built once, each later size joins it without a build;
    # the last iteration's size joins only when a next iteration comes, runtime/filing.py,
    # `last`: none does)
    st = terra.stats()
    assert (st["traces"], st["graph_builds"], st["graph_reuses"], st["fallbacks"]) == \
        (5, 2, 1, 3), terra.explain()
