"""Shape folding (terra/compiler/fold.py): integer shape arithmetic the graph knows becomes
constants while the graph is built, and the graph's results stay bit-identical to eager's."""
import collections

import keras
import numpy as np
import tensorflow as tf

from terra.compiler import compile_trace, substitute_feeds
from terra.compiler.fold import (EVALUATED, IDENTITY_RULES, MAX_ELEMENTS, STATIC_SHAPE_RULES,
                                 _const_value, fold, graph_constant, identity_input)
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
            "large input": fold("Max", [tf.constant(np.zeros(MAX_ELEMENTS + 1, np.int32)),
                                        tf.constant([0])],
                                {"T": I32}, _attrs(keep_dims=False, T=t32, Tidx=t32), [I32]),
            "small input": fold("Identity", [tf.constant([5, 6])], {"T": I32}, _attrs(T=t32),
                                [I32]),
        }
    out = _in_graph(build)
    assert out["cast of int"][0].dtype == np.float32
    assert out["cast of int"][0].tolist() == [3.0, 4.0]
    assert out["small input"][0].tolist() == [5, 6]
    for k in ("float add", "cast of float", "fed input", "bad reshape", "large", "not a rule",
              "large input"):
        assert out[k] is None, k


def test_identities_hand_the_input_on_unless_control_inputs_are_pending():
    def build():
        x = tf.zeros([2, 3])
        fed = tf.compat.v1.placeholder(tf.float32, [None, 3])
        no_axes, axis = tf.constant([], tf.int32), tf.constant([1])
        out = {
            "sum over no axes": identity_input("Sum", [x, no_axes]),
            "sum over an axis": identity_input("Sum", [x, axis]),
            "reshape to own shape": identity_input("Reshape", [x, tf.constant([2, 3])]),
            "reshape to another": identity_input("Reshape", [x, tf.constant([3, 2])]),
            "reshape of unknown": identity_input("Reshape", [fed, tf.constant([2, 3])]),
            "shape fed": identity_input("Reshape", [x, fed]),
            "tile by ones": identity_input("Tile", [x, tf.constant([1, 1])]),
            "tile by two": identity_input("Tile", [x, tf.constant([1, 2])]),
            "not a rule": identity_input("AddV2", [x, x]),
        }
        with tf.control_dependencies([tf.no_op()]):
            out["gated"] = identity_input("Sum", [x, no_axes])
        return out
    out = _in_graph(build)
    assert {k for k, v in out.items() if v is not None} == {
        "sum over no axes", "reshape to own shape", "tile by ones"}
    assert out["sum over no axes"] == 0


def test_graph_constants_are_one_per_value_unless_the_op_is_scoped(monkeypatch):
    def build():
        a = graph_constant(np.array([2, 3]), I32)
        b = graph_constant(np.array([2, 3], np.int64), I32)  # the same int32 value
        c = graph_constant(np.array([2, 3]), "int64")        # another dtype
        d = graph_constant(np.array([3, 2]), I32)            # another value
        with tf.control_dependencies([tf.no_op()]):
            e = graph_constant(np.array([2, 3]), I32)        # waits for something
        with tf.xla.experimental.jit_scope():
            f = graph_constant(np.array([2, 3]), I32)        # marked for XLA
        # the rules read the values made here without reading the op's proto back
        monkeypatch.setattr(tf, "make_ndarray", None)
        values = [_const_value(t) for t in (a, c, d, e, f)]
        return (a, b, c, d, e, f), values
    (a, b, c, d, e, f), values = _in_graph(build)
    assert a is b
    assert len({id(t) for t in (a, c, d, e, f)}) == 5
    assert [v.tolist() for v in values] == [[2, 3], [2, 3], [3, 2], [2, 3], [2, 3]]
    assert [t.dtype for t in (a, c, d, e, f)] == [tf.int32, tf.int64, tf.int32, tf.int32, tf.int32]
    assert e.op.control_inputs and not a.op.control_inputs


def test_identity_rules_match_what_tf_computes():
    x = tf.reshape(tf.range(6, dtype=tf.float32), [2, 3])
    for op in ("Sum", "Mean", "Max", "Min", "Prod"):
        assert op in IDENTITY_RULES
        y = getattr(tf.raw_ops, op)(input=x, axis=tf.constant([], tf.int32))
        np.testing.assert_array_equal(y.numpy(), x.numpy())
    np.testing.assert_array_equal(tf.raw_ops.Tile(input=x, multiples=[1, 1]).numpy(), x.numpy())
    np.testing.assert_array_equal(tf.raw_ops.BroadcastTo(input=x, shape=[2, 3]).numpy(),
                                  x.numpy())


def test_rule_tables_hold_only_ops_tf_knows():
    for op in set(EVALUATED) | set(STATIC_SHAPE_RULES) | set(IDENTITY_RULES):
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
    assert ops["Sum"] < recorded["Sum"]  # eager's sums over no axes are handed on
    for op in fn.concrete.graph.get_operations():  # (none is left)
        if op.type == "Sum" and op.inputs[1].op.type == "Const":
            assert tf.make_ndarray(op.inputs[1].op.get_attr("value")).size > 0
    replayed = [loss0.numpy()] + [fn(substitute_feeds(rec.trace, [(x0, x), (y0, y)]))[0].numpy()
                                  for x, y in batches[1:]]
    np.testing.assert_array_equal(np.array(eager), np.array(replayed))
    for a, b in zip(ma.variables + oa.variables, mb.variables + ob.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
