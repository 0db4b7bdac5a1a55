"""Shape folding (terra/compiler/fold.py): integer shape arithmetic the graph knows becomes
constants while the graph is built, and the graph's results stay bit-identical to eager's."""
import collections

import keras
import numpy as np
import tensorflow as tf

from terra.compiler import compile_trace, substitute_feeds
from terra.compiler.fold import EVALUATED, MAX_ELEMENTS, STATIC_SHAPE_RULES, fold
from terra.tracing import Recorder

I32 = "int32"


def _in_graph(fn):
    """Run `fn()` while a graph is built; returns its result."""
    out = {}

    def body():
        out["v"] = fn()
        return tf.constant(0)
    tf.function(body, autograph=False).get_concrete_function()
    return out["v"]


def test_shape_size_rank_of_a_fully_known_tensor_fold_and_of_an_unknown_do_not():
    def build():
        known = tf.zeros([2, 3, 4])
        unknown = tf.compat.v1.placeholder(tf.float32, [None, 3])
        no_rank = tf.compat.v1.placeholder(tf.float32, None)
        return (fold("Shape", [known], {"out_type": "int64"}, (), ["int64"]),
                fold("ShapeN", [known, known[0]], {}, (), [I32, I32]),
                fold("Size", [known], {}, (), [I32]),
                fold("Rank", [unknown], {}, (), [I32]),
                fold("Shape", [unknown], {}, (), [I32]),
                fold("Size", [unknown], {}, (), [I32]),
                fold("Rank", [no_rank], {}, (), [I32]))
    shape, shape_n, size, rank, shape_u, size_u, rank_u = _in_graph(build)
    assert shape[0].dtype == np.int64 and shape[0].tolist() == [2, 3, 4]
    assert [v.tolist() for v in shape_n] == [[2, 3, 4], [3, 4]]
    assert size[0].tolist() == 24 and rank[0].tolist() == 2
    assert shape_u is None and size_u is None and rank_u is None


def _attrs(**kw):
    flat = []
    for k, v in kw.items():
        flat += [k, v]
    return tuple(flat)


def test_constant_integer_ops_evaluate_as_eager_does():
    def build():
        a, b = tf.constant([4, 1, 3], tf.int32), tf.constant([1, 5, 3], tf.int32)
        t = tf.as_dtype(tf.int32).as_datatype_enum
        return (fold("BroadcastGradientArgs", [a, b], {"T": I32}, _attrs(T=t), [I32, I32]),
                fold("Prod", [a, tf.constant(0)], {"T": I32, "Tidx": I32, "keep_dims": False},
                     _attrs(keep_dims=False, T=t, Tidx=t), [I32]))
    (r0, r1), (prod,) = _in_graph(build)
    e0, e1 = tf.raw_ops.BroadcastGradientArgs(s0=[4, 1, 3], s1=[1, 5, 3])
    assert r0.tolist() == e0.numpy().tolist() and r1.tolist() == e1.numpy().tolist()
    assert prod.tolist() == 12


def test_float_results_non_constant_inputs_failing_and_large_ops_are_left_in_the_graph():
    def build():
        t32 = tf.as_dtype(tf.int32).as_datatype_enum
        f32 = tf.as_dtype(tf.float32).as_datatype_enum
        c = tf.constant([1.0, 2.0])
        ints = tf.constant([3, 4])
        fed = tf.compat.v1.placeholder(tf.int32, [2])
        return {
            "float add": fold("AddV2", [c, c], {"T": "float32"}, _attrs(T=f32), ["float32"]),
            "cast of float": fold("Cast", [c], {"SrcT": "float32", "DstT": "int32"},
                                  _attrs(SrcT=f32, DstT=t32, Truncate=False), [I32]),
            "cast of int": fold("Cast", [ints], {"SrcT": "int32", "DstT": "float32"},
                                _attrs(SrcT=t32, DstT=f32, Truncate=False), ["float32"]),
            "fed input": fold("AddV2", [fed, ints], {"T": I32}, _attrs(T=t32), [I32]),
            "bad reshape": fold("Reshape", [ints, tf.constant([3])], {"T": I32},
                                _attrs(T=t32, Tshape=t32), [I32]),
            "large": fold("Fill", [tf.constant([MAX_ELEMENTS + 1]), tf.constant(1)],
                          {"T": I32, "index_type": I32}, _attrs(T=t32, index_type=t32), [I32]),
            "not a rule": fold("MatMul", [ints, ints], {}, (), [I32]),
        }
    out = _in_graph(build)
    assert out["cast of int"][0].dtype == np.float32
    assert out["cast of int"][0].tolist() == [3.0, 4.0]
    for k in ("float add", "cast of float", "fed input", "bad reshape", "large", "not a rule"):
        assert out[k] is None, k


def test_rule_tables_hold_only_ops_tf_knows():
    for op in set(EVALUATED) | set(STATIC_SHAPE_RULES):
        assert tf.raw_ops.__dict__.get(op) is not None, op


def _ops(concrete):
    return collections.Counter(op.type for op in concrete.graph.get_operations())


def test_a_replayed_training_step_loses_its_shape_ops_and_stays_bit_identical():
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(0)
    batches = [(tf.constant(rng.normal(size=(4, 6, 8)).astype("float32")),
                tf.constant(rng.integers(0, 5, size=(4,)).astype("int32"))) for _ in range(3)]

    def build():
        keras.utils.set_random_seed(3)
        m = keras.Sequential([keras.Input((6, 8)), keras.layers.LayerNormalization(),
                              keras.layers.Dense(8, activation="relu"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(5)])
        opt = keras.optimizers.Adam(1e-2)
        m(batches[0][0])
        opt.build(m.trainable_variables)
        return m, opt
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(m, opt, x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, m(x, training=True))
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    ma, oa = build()
    mb, ob = build()
    eager = [step(ma, oa, x, y).numpy() for x, y in batches]
    x0, y0 = batches[0]
    with Recorder("step") as rec:
        loss0 = step(mb, ob, x0, y0)
    recorded = collections.Counter(r.op_type for r in rec.trace.records)
    assert recorded["Shape"] + recorded["BroadcastGradientArgs"] > 0  # eager computed them
    fn = compile_trace(rec.trace, [rec.ref_of(loss0)])
    ops = _ops(fn.concrete)
    assert ops["Shape"] == ops["ShapeN"] == ops["BroadcastGradientArgs"] == 0
    replayed = [loss0.numpy()] + [fn(substitute_feeds(rec.trace, [(x0, x), (y0, y)]))[0].numpy()
                                  for x, y in batches[1:]]
    np.testing.assert_array_equal(np.array(eager), np.array(replayed))
    for a, b in zip(ma.variables + oa.variables, mb.variables + ob.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
