"""Placeholders behave like the real tensor they stand for, in user, TF and Keras code.

Each snippet runs twice, once on real EagerTensors and once on placeholders resolving to the same
values; the results must be equal (bit-identical). A counting resolver shows where a fetch happened.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra import _tf_private as tfp  # noqa: E402
from terra.runtime.placeholders import ConstantResolver, Placeholder, is_placeholder  # noqa: E402

M = np.array([[1.0, -2.0], [3.0, 4.5]], np.float32)
IMG = np.arange(2 * 5 * 5 * 3, dtype=np.float32).reshape(2, 5, 5, 3) / 50.0


def real(v, dtype=None):
    return tf.constant(v, dtype=dtype)


def ph(v, dtype=None):
    t = tf.constant(v, dtype=dtype)
    return Placeholder.create(t.dtype, t.shape, ConstantResolver(t))


def to_plain(x):
    """Comparable plain value of a snippet result (tensors -> numpy, containers recursively)."""
    if isinstance(x, (list, tuple)):
        return [to_plain(e) for e in x]
    if isinstance(x, dict):
        return {k: to_plain(v) for k, v in x.items()}
    if isinstance(x, (tf.Tensor, tf.Variable)) or hasattr(x, "numpy"):
        return np.asarray(x.numpy())
    return x


def assert_same(a, b):
    a, b = to_plain(a), to_plain(b)
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    else:
        assert type(a) is type(b) and a == b, (a, b)


def _if_positive(mk):
    s = mk(2.5)
    return "pos" if s > 0 else "neg"


def _if_negative(mk):
    s = mk(-2.5)
    return "pos" if s > 0 else "neg"


def _variable_assign(mk):
    v = tf.Variable(tf.zeros([2, 2]))
    v.assign(mk(M))
    v.assign_add(mk(M))
    return v.numpy()


def _keras_variable_assign(mk):
    v = keras.Variable(np.zeros((2, 2), np.float32))
    v.assign(mk(M))
    return np.asarray(v.numpy())




def _keras_dense(mk):
    layer = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(seed=3))
    return layer(mk(M))


def _keras_conv(mk):
    layer = keras.layers.Conv2D(2, 3, kernel_initializer=keras.initializers.GlorotUniform(seed=4))
    return layer(mk(IMG))


def _keras_sequential(mk):
    model = keras.Sequential([
        keras.layers.Dense(4, activation="relu", kernel_initializer=keras.initializers.Ones()),
        keras.layers.Dense(2, kernel_initializer=keras.initializers.Ones())])
    return model(mk(M))


def _keras_loss(mk):
    # Keras `_get_logits` reads `output.op.type`: the dummy op must match nothing.
    y_true = mk([[0.0, 1.0], [1.0, 0.0]])
    y_pred = mk([[0.3, 0.7], [0.6, 0.4]])
    return keras.losses.categorical_crossentropy(y_true, y_pred)


def _keras_sparse_ce_from_softmax(mk):
    probs = tf.nn.softmax(mk(M))  # a real Softmax output: the eager side reads its op type too
    return keras.losses.sparse_categorical_crossentropy(mk([1, 0]), probs)


_tf_fn = tf.function(lambda a, b: tf.matmul(a, b) + 1.0)


def _tf_function_call(mk):
    return _tf_fn(mk(M), mk(M))


@tf.function
def _tf_fn_nested(d, scale=1.0):
    return d["a"] * scale + d["b"]


def _tf_function_nested(mk):
    return _tf_fn_nested({"a": mk(M), "b": mk(M)}, scale=mk(2.0))


def _tape_gradient(mk):
    v = tf.Variable(M)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * mk(M) * mk(M))
    return tape.gradient(loss, v)


def _print(mk, capsys=None):
    print(mk(M), mk(3.0))


def _iteration(mk):
    return [r for r in mk(M)]


def _ref(mk):
    a, b = mk(M), mk(M)
    d = {a.ref(): "a", b.ref(): "b"}
    return [d[a.ref()], d[b.ref()], a.ref() == a.ref(), a.ref().deref() is a, len(d)]


def _unhashable(mk):
    with pytest.raises(TypeError):
        hash(mk(M))
    return "ok"


SNIPPETS = {
    "add": lambda mk: mk(M) + 1.0,
    "radd": lambda mk: 1.0 + mk(M),
    "sub_neg": lambda mk: -mk(M) - mk(M),
    "mul_div": lambda mk: mk(M) * 2.0 / 3.0,
    "floordiv_mod": lambda mk: [mk([7, 9]) // 2, mk([7, 9]) % 4],
    "matmul": lambda mk: mk(M) @ mk(M),
    "pow": lambda mk: mk(M) ** 2,
    "abs": lambda mk: abs(mk(M)),
    "compare": lambda mk: [mk(M) > 2.0, mk(M) <= 1.0, mk(M) == mk(M), mk(M) != 1.0],
    "logical": lambda mk: [~mk([True, False]), mk([True, False]) & mk([True, True])],
    "index": lambda mk: mk(M)[0],
    "slice": lambda mk: mk(M)[:, 1],
    "fancy_index": lambda mk: mk(IMG)[1, ::2, tf.newaxis, -1],
    "tensor_index": lambda mk: mk(M)[mk(1)],
    "reshape": lambda mk: tf.reshape(mk(M), [4]),
    "concat": lambda mk: tf.concat([mk(M), mk(M) * 2.0], axis=0),
    "stack": lambda mk: tf.stack([mk(M), mk(M)], axis=1),
    "split": lambda mk: tf.split(mk(M), 2, axis=1),
    "unstack": lambda mk: tf.unstack(mk(M)),
    "where": lambda mk: tf.where(mk(M) > 0.0, mk(M), tf.zeros_like(mk(M))),
    "where_indices": lambda mk: tf.where(mk(M) > 0.0),
    "cond": lambda mk: tf.cond(mk(2.0) > 0.0, lambda: mk(M) * 2.0, lambda: mk(M)),
    "reduce_cast": lambda mk: [tf.reduce_sum(mk(M)), tf.cast(mk(M), tf.int32),
                               tf.math.reduce_max(mk(M), axis=1)],
    "shape_ops": lambda mk: [tf.shape(mk(IMG)), tf.rank(mk(M)), mk(IMG).shape.as_list(),
                             mk(M).dtype.name, mk(M).ndim],
    "convert": lambda mk: tf.convert_to_tensor(mk(M)),
    "identity_nest": lambda mk: tf.nest.map_structure(tf.identity, {"x": mk(M), "y": [mk(1.0)]}),
    "float": lambda mk: float(mk(3.25)),
    "int": lambda mk: int(mk(7)),
    "index_protocol": lambda mk: [["a", "b", "c"][mk(2)], list(range(10))[mk(1):mk(4)]],
    "bool": lambda mk: [bool(mk(True)), bool(mk(0.0))],
    "len": lambda mk: len(mk(M)),
    "format": lambda mk: [f"{mk(2.5):.3f}", "{:>8}".format(mk(7))],
    "numpy": lambda mk: mk(M).numpy(),
    "np_asarray": lambda mk: np.asarray(mk(M)),
    "np_ufunc": lambda mk: [np.sum(mk(M)), np.array(mk(M), dtype=np.float64), np.add(mk(M), 1)],
    "repr_str": lambda mk: [repr(mk(M)), str(mk(M))],
    "if_positive": _if_positive,
    "if_negative": _if_negative,
    "iteration": _iteration,
    "ref": _ref,
    "unhashable": _unhashable,
    "variable_assign": _variable_assign,
    "keras_variable_assign": _keras_variable_assign,
    "keras_dense": _keras_dense,
    "keras_conv2d": _keras_conv,
    "keras_sequential": _keras_sequential,
    "keras_ops": lambda mk: [keras.ops.sum(mk(M)), keras.ops.softmax(mk(M)),
                             keras.ops.concatenate([mk(M), mk(M)]), keras.ops.relu(mk(M))],
    "keras_loss": _keras_loss,
    "keras_sparse_ce": _keras_sparse_ce_from_softmax,
    "tf_constant": lambda mk: [tf.constant(mk(M)), tf.constant(mk(M), dtype=tf.float32)],
    "like_ops": lambda mk: [tf.ones_like(mk(M)), tf.zeros_like(mk(M)), tf.stop_gradient(mk(M))],
    "stateless_random_shape": lambda mk: tf.random.stateless_normal(tf.shape(mk(M)), seed=[1, 2]),
    "dataset": lambda mk: list(tf.data.Dataset.from_tensors(mk(M)))[0],
    "py_function": lambda mk: tf.py_function(lambda a: a * 2.0, [mk(M)], tf.float32),
    "gather_scatter": lambda mk: [tf.gather(mk(M), mk([1, 0])),
                                  tf.tensor_scatter_nd_update(mk(M), [[0, 0]], mk([9.0]))],
    "boolean_mask": lambda mk: tf.boolean_mask(mk(M), mk(M) > 0.0),
    "einsum_transpose": lambda mk: [tf.einsum("ij,jk->ik", mk(M), mk(M)), tf.transpose(mk(M))],
    "nn_ops": lambda mk: [tf.math.log(mk(M) * mk(M)), tf.nn.relu(mk(M)), tf.nn.softmax(mk(M)),
                          tf.math.argmax(mk(M))],
    "tensor_array": lambda mk: tf.TensorArray(tf.float32, size=2).write(0, mk(M)).read(0),
    "variable_init": lambda mk: tf.Variable(mk(M)).numpy(),
    "tape_gradient_wrt_variable": _tape_gradient,
    "tf_function": _tf_function_call,
    "tf_function_nested_kwargs": _tf_function_nested,
}


@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_snippet_matches_eager(name):
    snippet = SNIPPETS[name]
    expected = snippet(real)
    got = snippet(ph)
    assert_same(expected, got)


def test_snippet_count():
    assert len(SNIPPETS) >= 33


def test_print_fetches_and_matches_eager(capsys):
    _print(real)
    want = capsys.readouterr().out
    _print(ph)
    assert capsys.readouterr().out == want


def test_ops_receive_the_resolved_value_and_resolve_once():
    r = ConstantResolver(M)
    x = Placeholder.create(tf.float32, [2, 2], r)
    assert r.calls == 0 and not x.is_materialized
    y = x + 1.0
    assert isinstance(y, tfp.EagerTensor) and not is_placeholder(y)
    np.testing.assert_array_equal(y.numpy(), M + 1.0)
    assert r.calls == 1 and x.is_materialized
    float(x[0, 0]), x.numpy(), np.asarray(x), repr(x)
    assert r.calls == 1  # cached: one fetch per placeholder


@pytest.mark.parametrize("sync", ["numpy", "array", "float", "int", "index", "bool", "len",
                                  "format", "repr", "str", "convert"])
def test_each_sync_point_fetches(sync):
    r = ConstantResolver(np.float32(3.0) if sync not in ("int", "index", "len") else
                         (np.int32(2) if sync != "len" else np.zeros(4, np.int32)))
    x = Placeholder.create(r.value.dtype, r.value.shape, r)
    do = {"numpy": lambda: x.numpy(), "array": lambda: np.asarray(x), "float": lambda: float(x),
          "int": lambda: int(x), "index": lambda: [0, 1, 2][x], "bool": lambda: bool(x),
          "len": lambda: len(x), "format": lambda: f"{x}", "repr": lambda: repr(x),
          "str": lambda: str(x), "convert": lambda: tf.convert_to_tensor(x)}[sync]
    out = do()
    assert r.calls == 1
    ref = {"numpy": lambda v: v.numpy(), "array": lambda v: np.asarray(v),
           "float": float, "int": int, "index": lambda v: [0, 1, 2][v], "bool": bool, "len": len,
           "format": lambda v: f"{v}", "repr": repr, "str": str,
           "convert": lambda v: v}[sync](r.value)
    assert_same(ref, out)


def test_static_metadata_needs_no_fetch():
    r = ConstantResolver(IMG)
    x = Placeholder.create(tf.float32, IMG.shape, r, terra_id=("n3", 0))
    assert x.dtype == tf.float32 and x.shape == IMG.shape and x.ndim == 4
    assert x.terra_id == ("n3", 0) and x.name == "terra_placeholder_('n3', 0)"
    assert x.op.type == "TerraPlaceholder" and x.op.inputs == ()
    assert isinstance(x, tf.Tensor) and tf.is_tensor(x)
    assert isinstance(x._id, int)
    assert not hasattr(x, "graph") and not hasattr(tf.constant(1.0), "graph")  # as eager
    assert r.calls == 0


def test_ids_are_unique_and_distinct_from_eager_tensors():
    xs = [ph(1.0) for _ in range(5)]
    ids = {x._id for x in xs} | {tf.constant(1.0)._id for _ in range(5)}
    assert len(ids) == 10


def test_bind_forwards_everything_and_stops_fetching():
    class Exploding:
        def resolve(self):
            raise AssertionError("a bound placeholder must not fetch")

    x = Placeholder.create(tf.float32, [None, 2], Exploding())
    kept = [x]  # user code keeps placeholders across iterations
    real_value = tf.constant(M)
    x._terra_bind(real_value)
    assert x.is_bound and x.is_materialized
    y = kept[0]
    np.testing.assert_array_equal((y * 2.0).numpy(), M * 2.0)
    assert y.shape == (2, 2)  # the real (fully known) shape now
    assert y.device == real_value.device
    assert float(y[1, 1]) == 4.5 and len(y) == 2 and repr(y) == repr(real_value)
    assert y.backing_device == real_value.backing_device  # forwarded attribute
    np.testing.assert_array_equal(_tf_fn(y, y).numpy(), _tf_fn(real_value, real_value).numpy())
    v = tf.Variable(tf.zeros([2, 2]))
    v.assign(y)
    np.testing.assert_array_equal(v.numpy(), M)


def test_bind_checks_value():
    x = Placeholder.create(tf.float32, [2], ConstantResolver([1.0, 2.0]))
    with pytest.raises(TypeError, match="dtype int32"):
        x._terra_bind(tf.constant([1, 2]))
    with pytest.raises(ValueError, match="shape"):
        x._terra_bind(tf.constant([1.0, 2.0, 3.0]))
    with pytest.raises(TypeError, match="EagerTensor"):
        x._terra_bind(np.zeros(2, np.float32))


def test_resolver_result_is_checked():
    bad = Placeholder.create(tf.float32, [2], ConstantResolver(np.zeros(2, np.int32)))
    with pytest.raises(TypeError, match="dtype int32, expected float32"):
        bad.numpy()
    bad_shape = Placeholder.create(tf.float32, [3], ConstantResolver(np.zeros(2, np.float32)))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        bad_shape + 1.0


def test_conversion_with_wrong_dtype_is_refused():
    x = ph(M)
    with pytest.raises((TypeError, ValueError)):
        tf.convert_to_tensor(x, dtype=tf.int32)


def test_rebind_resolver_before_materialization_only():
    x = Placeholder.create(tf.float32, [], ConstantResolver(1.0))
    x._terra_rebind_resolver(ConstantResolver(2.0))
    assert float(x) == 2.0
    with pytest.raises(ValueError, match="already has a value"):
        x._terra_rebind_resolver(ConstantResolver(3.0))


def test_bad_construction():
    with pytest.raises(TypeError, match="Placeholder.create"):
        Placeholder(None, 0, tf.float32)
    with pytest.raises(TypeError, match="resolve"):
        Placeholder.create(tf.float32, [], object())


def test_keras_attributes_survive_on_the_placeholder():
    x = ph(M)
    x._keras_mask = None
    assert x._keras_mask is None
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        x.nonexistent  # noqa: B018


def test_data_dependent_shape_placeholder():
    # A placeholder with an unknown dim (e.g. output of tf.where) iterates over its real value.
    r = ConstantResolver(np.array([[0, 1], [1, 1]], np.int64))
    x = Placeholder.create(tf.int64, [None, 2], r)
    rows = [row.numpy().tolist() for row in x]
    assert rows == [[0, 1], [1, 1]]
