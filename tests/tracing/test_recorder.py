"""The recorder: refs, attrs, fetch points, unsupported ops, unseeded random ops."""
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import tensor_util
from tensorflow.python.ops import gen_math_ops, gen_random_ops

from terra import _tf_private as tfp
from terra.ir.records import ConstRef, FeedRef, OutputRef, VariableRef
from terra.tracing import Recorder, record
from terra.tracing.recorder import freeze_attr

X = tf.constant([[1.0, 2.0], [3.0, 4.0]])


def test_input_refs():
    v = tf.Variable([1.0, 2.0])
    big = list(range(20))
    arr = np.ones((2, 2), "float32")
    with Recorder() as rec:
        a = gen_math_ops.add_v2(X, 1.5)            # Python scalar -> ConstRef
        b = gen_math_ops.mul(a, X)                 # earlier output, same feed again
        c = gen_math_ops.add_v2(v, [3.0, 4.0])     # raw variable, small list
        d = tf.constant(big)                       # born here, large -> feed
        e = gen_math_ops.add_v2(d, 1)
        f = gen_math_ops.add_v2(arr, b)            # numpy array -> feed
    r = rec.trace.records
    assert r[0].inputs == (FeedRef(0), ConstRef(1.5, "float32"))
    assert r[1].inputs == (OutputRef(0), FeedRef(0))
    key = id(v.handle)
    # A raw tf.Variable makes the fast path fall back; the wrapper reads it through a recorded op.
    assert (r[2].op_type, r[2].inputs) == ("ReadVariableOp", (VariableRef(key),))
    assert r[3].route == "fallback"
    assert r[3].inputs == (OutputRef(2), ConstRef((3.0, 4.0), "float32"))
    assert rec.trace.variables[key] is v
    assert r[4].inputs == (FeedRef(1), ConstRef(1, "int32"))
    assert rec.trace.feeds[1].source == "python-constant"
    assert r[5].inputs == (FeedRef(2), OutputRef(1)) and rec.trace.feeds[2].source == "numpy"
    assert rec.trace.feed_values[0] is X and rec.trace.feed_values[2] is arr
    assert [rec.ref_of(t) for t in (a, b, c, e, f)] == [OutputRef(i) for i in (0, 1, 3, 4, 5)]
    assert rec.ref_of(X) is None and rec.ref_of(d) is None
    np.testing.assert_array_equal(rec.value(OutputRef(1)).numpy(), b.numpy())


def test_attrs_complete_and_equal_on_fast_and_fallback_routes():
    kv = keras.Variable(np.ones((2, 2), "float32"))
    with Recorder() as rec:
        tf.reduce_sum(X, axis=1, keepdims=True)          # fast path
        tf.reduce_sum(kv, axis=1, keepdims=True)         # keras.Variable: fast path falls back
        tf.concat([X, X], axis=0)                        # list input
    sums = [r for r in rec.trace.records if r.op_type == "Sum"]
    assert [s.route for s in sums] == ["fast", "fallback"]
    assert sums[0].attrs == sums[1].attrs
    assert dict(sums[0].attrs) == {"T": "float32", "Tidx": "int32", "keep_dims": True}
    (concat,) = [r for r in rec.trace.records if r.op_type == "ConcatV2"]
    assert concat.attr("N") == 2 and concat.attr("T") == "float32"
    assert concat.inputs[0] == (FeedRef(0), FeedRef(0))
    assert concat.outputs[0].shape == (4, 2)


def test_fetch_points():
    with Recorder() as rec:
        y = X + 1.0
        s = tf.reduce_sum(y)
        y.numpy()
        bool(s > 0)
        float(s)
        int(tf.cast(s, tf.int32))
        [0, 1, 2][tf.constant(1) + 0]
        f"{s}"
        str(y)
        tensor_util.constant_value(s)
        X.numpy()  # not recorded: not produced in this iteration
    hows = [f.how for f in rec.trace.fetches]
    assert hows == ["numpy", "bool", "float", "int", "index", "format", "str", "constant_value"]
    assert rec.trace.fetches[0].ref == OutputRef(0) and rec.trace.fetches[0].after_record == 2
    for f in rec.trace.fetches:
        assert f.after_record > f.ref.record


def test_numpy_functions_are_fetch_points_and_buffer_reads_are_not_seen():
    """`np.squeeze(t)` reads `t` through NumPy's function dispatch, which the hook joins
    (`__array_function__`); `np.asarray(t)` reads it through the buffer protocol, unseen."""
    with Recorder() as rec:
        y = X * 2.0
        np.squeeze(y)
        np.concatenate([y, y])
        np.asarray(y)
    assert [(f.ref, f.how) for f in rec.trace.fetches] == [(OutputRef(0), "array")] * 3


def test_constant_origins_name_tensor_objects():
    """Two constants holding equal values are two origins; a slice's bounds keep theirs in the
    slice's gradient (the hook's StridedSlice rule passes the bound tensors themselves)."""
    w = tf.Variable([[1.0, 2.0]])
    with Recorder() as rec:
        with tf.GradientTape() as tape:
            total = w[0, 1] + w[0, 1]
        tape.gradient(total, w)
    slices = [r for r in rec.trace.records if r.op_type == "StridedSlice"]
    grads = [r for r in rec.trace.records if r.op_type == "StridedSliceGrad"]
    assert len(slices) == 2 and len(grads) == 2
    fwd = [r.inputs[1] for r in slices]
    assert fwd[0] == fwd[1] == ConstRef((0, 1), "int32")      # equal by value ...
    assert fwd[0].origin is not None and fwd[0].origin != fwd[1].origin   # ... not one object
    assert {g.inputs[1].origin for g in grads} == {f.origin for f in fwd}


def test_a_constant_value_copy_is_its_tensor_where_an_op_takes_it():
    """A NumPy copy (`constant_value`) of a constant, passed to an op, is that constant."""
    with Recorder() as rec:
        axis = tf.constant([0])
        y = tf.reduce_sum(X, axis=axis)
        tf.reduce_sum(y, axis=tensor_util.constant_value(axis))
    sums = [r for r in rec.trace.records if r.op_type == "Sum"]
    assert sums[0].inputs[1] == sums[1].inputs[1] == ConstRef((0,), "int32")
    assert sums[0].inputs[1].origin == sums[1].inputs[1].origin is not None


def test_unsupported_ops_are_named_and_iteration_still_runs():
    tl = tf.raw_ops.EmptyTensorList(element_shape=[2], max_num_elements=-1,
                                    element_dtype=tf.float32)
    with Recorder() as rec:
        n = tf.raw_ops.TensorListLength(input_handle=tl)     # external variant input
        w = tf.Variable(3.0)                                 # creates state inside the iteration
        ok = X * 2.0
    assert int(n) == 0 and float(w) == 3.0 and ok.numpy()[0, 0] == 2.0
    text = " ".join(rec.trace.unsupported)
    assert "TensorListLength: external variant input" in text
    assert "VarHandleOp: creates state" in text
    with pytest.raises(ValueError, match="cannot replay"):
        from terra.compiler import compile_trace
        compile_trace(rec.trace)


def test_unseeded_random_ops_are_host_ops_whose_outputs_are_feeds():
    """A stateful random op without a Generator is recorded (skip mode runs it on the program's
    thread) without its per-call seed attrs; the op consuming its draw takes a feed."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Recorder() as rec:
            r = gen_random_ops.random_standard_normal((2,), tf.float32)
            y = r * 2.0
            g = tf.random.Generator.from_seed(1).normal((2,))
    recs = rec.trace.records
    rnd = [r for r in recs if r.op_type == "RandomStandardNormal"]
    assert len(rnd) == 1 and rnd[0].attr("seed") is None and rnd[0].attr("seed2") is None
    assert not rec.trace.unseeded_random
    assert rec.ref_of(r) is None  # not a produced value: a feed where it is consumed
    assert rec.trace.records[rec.ref_of(y).record].inputs[0] == FeedRef(0)
    assert rec.trace.feed_values[0] is r
    assert isinstance(rec.ref_of(g), OutputRef)  # a Generator's draw is computed in the graph


def test_output_refs_are_consistent_in_a_keras_step():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.1)
    model(X)
    opt.build(model.trainable_variables)

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(X) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    _, rec = record(step)
    trace = rec.trace
    assert trace.site.endswith("step") and not trace.unsupported
    for r in trace.records:
        op_def = tfp.get_op_def(r.op_type)
        flat = [x for i in r.inputs for x in (i if isinstance(i, tuple) else (i,))]
        for ref in flat:
            if isinstance(ref, OutputRef):
                assert ref.record < r.index
                assert ref.index < len(trace.records[ref.record].outputs)
            if isinstance(ref, VariableRef):
                assert ref.key in trace.variables
        if op_def is not None:
            assert len(r.inputs) == len(op_def.input_arg)
    assert {id(v.value.handle) for v in model.trainable_variables} <= set(trace.variables)


def test_bad_arguments():
    with pytest.raises(TypeError):
        Recorder(site=3)
    with pytest.raises(ValueError):
        Recorder(const_limit=-1)
    rec = Recorder()
    with pytest.raises(RuntimeError):
        rec.stop()
    with pytest.raises(TypeError, match="func"):
        freeze_attr("func", None)
    assert freeze_attr("list(type)", [tf.float32, 3]) == ("float32", "int32")
    assert freeze_attr("shape", [None, 2]) == (None, 2) and freeze_attr("shape", None) is None


def test_a_recorder_error_marks_the_op_unsupported_and_never_breaks_the_program(monkeypatch):
    from terra.tracing import recorder as recorder_module

    def broken(self, info, per_arg, attrs, outputs):
        raise RuntimeError("boom")
    monkeypatch.setattr(recorder_module.Recorder, "_fast_attrs", broken)
    with Recorder() as rec:
        y = gen_math_ops.add_v2(X, 1.0)
        z = tf.raw_ops.StringLength(input=tf.strings.as_string(y))
    assert y.numpy().tolist() == [[2.0, 3.0], [4.0, 5.0]] and z.numpy().shape == (2, 2)
    assert rec.trace.unsupported[0] == "AddV2: RuntimeError: boom"
    assert rec.ref_of(y) == OutputRef(0)  # later inputs still resolve to the record


def test_string_constants_replay():
    from terra.compiler import compile_trace
    with Recorder() as rec:
        s = tf.strings.join(["ab", "c"])
        n = tf.strings.length(s)
    assert rec.trace.records[0].inputs == ((ConstRef(b"ab", "string"), ConstRef(b"c", "string")),)
    (got,) = compile_trace(rec.trace, [rec.ref_of(n)])([])
    assert int(got) == 3 == int(n)


def test_small_numpy_arrays_made_by_tf_are_constants_passed_arrays_stay_feeds():
    held = np.ones((1, 2), "float32")
    with Recorder() as rec:
        tf.reduce_mean(X)                                  # TF builds np.arange(2) for the axes
        tf.convert_to_tensor(held) + X                     # the program holds `held`: user data
        tf.convert_to_tensor(np.full((1, 2), 3.0, "float32")) + X   # passed in: user data
    r = rec.trace.records
    mean = next(x for x in r if x.op_type == "Mean")
    assert mean.inputs[1] == ConstRef((0, 1), "int32")
    adds = [x for x in r if x.op_type == "AddV2"]
    assert adds[0].inputs[0] == FeedRef(1) and rec.trace.feed_values[1] is held
    assert adds[1].inputs[0] == FeedRef(2)
    assert [f.source for f in rec.trace.feeds] == ["eager-tensor", "numpy", "numpy"]
    with Recorder(const_limit=1) as rec:
        tf.reduce_mean(X)                                  # 2 elements > const_limit: a feed
    assert rec.trace.records[0].inputs[1] == FeedRef(1)


def test_reduce_mean_in_a_loop_folds_with_constant_axes():
    from terra.compiler.merge import merge
    from terra.ir.trace_graph import LOOP
    xs = [tf.constant([[1.0, 2.0]]) * k for k in range(3)]
    with Recorder() as rec:
        for x in xs:
            tf.reduce_mean(x * 2.0)
    g = merge(None, rec.trace)
    (loop,) = g.op_nodes
    assert loop.kind == LOOP
    (mean,) = [n for n in loop.loop.body.op_nodes if n.op.op_type == "Mean"]
    # the axes are one constant, not a new feed every iteration (Python enqueueing each one)
    assert mean.inputs[1] == ConstRef((0, 1), "int32") and mean.feeds == ()


def test_a_variable_collected_during_a_step_is_not_part_of_its_trace(monkeypatch):
    """The garbage collector may run a dead resource's deleter while any step is recorded (a queue
    of a graph a previous program left behind): the DestroyResourceOp runs as in eager,
    unrecorded."""
    import gc
    from tensorflow.python.ops import gen_resource_variable_ops as gen
    destroyed = []
    original = gen.destroy_resource_op

    def destroy(resource, **kwargs):
        destroyed.append(resource)
        return original(resource, **kwargs)

    monkeypatch.setattr(gen, "destroy_resource_op", destroy)
    dead = [tf.queue.FIFOQueue(1, tf.float32) for _ in range(3)]
    # (the collection may also destroy resources earlier tests left: count these three)
    mine = {id(q.queue_ref) for q in dead}
    with Recorder() as rec:
        y = X * 2.0
        del dead
        gc.collect()
        z = y + 1.0
    assert sum(id(r) in mine for r in destroyed) == 3
    assert z.numpy()[0, 0] == 3.0
    assert rec.trace.unsupported == []
    assert [r.op_type for r in rec.trace.records] == ["Mul", "AddV2"]
