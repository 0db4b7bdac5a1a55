"""A skipped `tape.gradient` packs its flat results back into the gradient list, and a skipped
`apply_gradients` flattens the list it is given, without building each `IndexedSlices`' TypeSpec
(units.py `_gradient_plan`, `_pack_gradients`, `_flat_gradients`): the results must be what
`tf.nest` gives, and training with a sparse (embedding) gradient must equal eager bit for bit."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime import units  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(timeout_s=30.0)
    yield
    terra.reset()
    terra.config(**old)


def _gradients():
    return [tf.constant([1.0, 2.0]), None,
            tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 4]), tf.constant([5, 3])),
            tf.IndexedSlices(tf.ones((1, 3)), tf.constant([1]))]


def test_flat_gradients_is_tf_nests_flatten():
    grads = _gradients()
    want = tf.nest.flatten(grads, expand_composites=True)
    got = units._flat_gradients(grads)
    assert len(got) == len(want) == 7
    assert all(a is b for a, b in zip(got, want))


def test_flat_gradients_hands_other_composites_to_tf_nest():
    v = tf.Variable([1.0])  # a composite (its handle is its component)
    grads = [tf.constant([1.0]), v]
    got = units._flat_gradients(grads)
    want = tf.nest.flatten(grads, expand_composites=True)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_pack_gradients_rebuilds_the_list_tf_nest_would():
    grads = _gradients()
    plan = units._gradient_plan(grads)
    assert plan == (0, 0, 3, 2)
    flat = tf.nest.flatten(grads, expand_composites=True)
    got = units._pack_gradients(plan, flat)
    want = tf.nest.pack_sequence_as(grads, flat, expand_composites=True)
    assert [type(g) for g in got] == [type(g) for g in want]
    for g, w in zip(got, want):
        if isinstance(w, tf.IndexedSlices):
            assert g.values is w.values and g.indices is w.indices
            assert (g.dense_shape is None) == (w.dense_shape is None)
        else:
            assert g is w
    assert units._gradient_plan((grads[0],)) is None  # a tuple: tf.nest packs it
    assert units._gradient_plan([tf.Variable([1.0])]) is None


def _train(Tape, steps=8):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.layers.Input((5,), dtype="int32"),
                              keras.layers.Embedding(20, 4), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(0)
    ids = [tf.constant(rng.integers(0, 20, (6, 5)), tf.int32) for _ in range(steps)]
    ys = [tf.constant(rng.normal(size=(6, 1)), tf.float32) for _ in range(steps)]
    losses, kinds = [], []
    for x, y in zip(ids, ys):
        with Tape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        kinds.append(tuple(isinstance(g, tf.IndexedSlices) for g in grads))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy() for v in model.variables], kinds


def test_a_sparse_gradient_trains_as_eagerly_when_its_unit_is_skipped():
    e_losses, e_vars, e_kinds = _train(tf.GradientTape)
    terra.reset()
    with CompileCounter() as c:
        t_losses, t_vars, t_kinds = _train(tf.TerraGradientTape)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert t_losses == e_losses
    assert all(np.array_equal(a, b) for a, b in zip(t_vars, e_vars))
    assert t_kinds == e_kinds and e_kinds[0] == (True, False, False)
    plans = [u.pack for site in SESSION.sites.values() for p in site.paths.values()
             if p.view is not None for u in p.view.units.values() if u.pack is not None]
    assert plans and all(3 in plan for plan in plans)  # the skipped unit packed the slices


@pytest.mark.parametrize("structure", [
    tf.TensorSpec((2,), tf.float32),
    [tf.TensorSpec((2,), tf.float32), tf.TensorSpec((), tf.int32)],
    (tf.TensorSpec((2,), tf.float32),),
    {"a": tf.TensorSpec((2,), tf.float32)},
    [tf.TensorSpec((2,), tf.float32), None],
    tf.IndexedSlicesSpec((4, 3), tf.float32, tf.int64, tf.int32)])
def test_pack_results_is_tf_nests_pack(structure):
    want_flat = {tf.IndexedSlicesSpec: 3}.get(type(structure), None)
    n = want_flat or len(tf.nest.flatten(structure, expand_composites=True))
    values = [tf.constant([1.0, 2.0]), tf.constant(3), tf.constant([0])][:n]
    if isinstance(structure, tf.IndexedSlicesSpec):
        values = [tf.ones((1, 3)), tf.constant([2], tf.int64), tf.constant([4, 3])]
    if isinstance(structure, list) and structure[-1] is None:
        values = [tf.constant([1.0, 2.0]), None]
    want = tf.nest.pack_sequence_as(structure, values, expand_composites=True)
    got = units._pack_results(structure, values)
    assert type(got) is type(want)
    flat_got = tf.nest.flatten(got, expand_composites=True)
    flat_want = tf.nest.flatten(want, expand_composites=True)
    assert all(a is b for a, b in zip(flat_got, flat_want)) and len(flat_got) == len(flat_want)
