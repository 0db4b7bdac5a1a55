"""Fails loudly, naming the API, when a TF upgrade moves a private name Terra relies on."""
import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

from terra import _tf_private as tfp

# These read TF's attributes as TF defines them: a test before them in the same process may
# have left Terra's hook installed (a session keeps it between iterations until reset).
pytestmark = pytest.mark.usefixtures("fresh_terra")


def test_tf_version_is_the_verified_one():
    assert tf.__version__.startswith("2.21"), f"private APIs verified on TF 2.21, found {tf.__version__}"


def test_dispatch_entry_points_exist_with_expected_signatures():
    assert callable(getattr(tfp.pywrap_tfe_module, tfp.FAST_PATH_ATTR))
    params = {name: list(inspect.signature(getattr(tfp.execute_module, name)).parameters)
              for name in tfp.EXECUTE_ATTRS}
    assert params["quick_execute"] == ["op_name", "num_outputs", "inputs", "attrs", "ctx", "name"]
    assert params["execute"] == params["quick_execute"]
    assert params["execute_with_cancellation"] == [
        "op_name", "num_outputs", "inputs", "attrs", "ctx", "cancellation_manager", "name"]
    assert issubclass(tfp.FallbackException, Exception)


def test_gen_ops_look_up_the_fast_path_through_the_module():
    from tensorflow.python.ops import gen_math_ops
    src = inspect.getsource(gen_math_ops.add_v2)
    assert "pywrap_tfe.TFE_Py_FastPathExecute(" in src
    assert "_execute.execute(" in inspect.getsource(gen_math_ops.add_v2_eager_fallback)


def test_function_call_path():
    assert list(inspect.signature(tfp.AtomicFunction.call_flat).parameters) == ["self", "args"]
    assert "call_function" in inspect.getsource(tfp.AtomicFunction.call_flat)
    assert callable(tfp.context().call_function)
    opts = tfp.context().function_call_options
    assert isinstance(opts, tfp.FunctionCallOptions) and hasattr(opts, "config_proto_serialized")


def test_value_points():
    for name in ("numpy", "__array__", "__bool__", "__float__", "__int__", "__index__",
                 "__format__", "__str__", "__complex__"):
        assert name in tfp.EagerTensorBase.__dict__, name
    assert issubclass(tfp.EagerTensor, tfp.EagerTensorBase)
    assert list(inspect.signature(getattr(tfp.constant_op_module, tfp.CONVERT_ATTR)).parameters) == [
        "value", "ctx", "dtype"]
    assert list(inspect.signature(getattr(tfp.tensor_util_module, tfp.CONSTANT_VALUE_ATTR))
                .parameters) == ["tensor", "partial"]
    assert isinstance(tfp.BaseResourceVariable.__dict__["handle"], property)
    assert isinstance(tfp.EagerTensorBase.__dict__["shape"], property)  # (shape reads: hook)
    for name in ("TFE_Py_TapeSetIsStopped", "TFE_Py_TapeSetStopOnThread",
                 "TFE_Py_TapeSetRestartOnThread"):  # (`resume_recording`)
        assert callable(getattr(tfp.pywrap_tfe_module, name)), name
    with tfp.stop_recording():
        with tf.GradientTape() as tape:
            w = tf.Variable(2.0)
            y = w * w
        assert tape.gradient(y, w) is None  # (stopped: what `resume_recording` undoes)
        with tfp.resume_recording():
            with tf.GradientTape() as tape:
                w = tf.Variable(2.0)
                y = w * w
            assert float(tape.gradient(y, w)) == 4.0
    v = tf.Variable(1.0)
    assert "_handle" in v.__dict__ and v.__dict__["_handle"] is v.handle


def test_list_inputs_take_their_dtype_through_the_module():
    """An op's eager fallback makes a list input one dtype with the module's
    `args_to_matching_eager` (the hook's patch), from its first `core_types.Value`."""
    from tensorflow.python.ops import gen_array_ops
    assert list(inspect.signature(getattr(tfp.execute_module, tfp.MATCHING_ATTR)).parameters) == [
        "l", "ctx", "allowed_dtypes", "default_dtype"]
    assert f"_execute.{tfp.MATCHING_ATTR}(" in inspect.getsource(gen_array_ops.concat_v2_eager_fallback)
    assert isinstance(tf.constant(1), tfp.CoreValue) and not issubclass(tf.Tensor, tfp.CoreValue)
    assert tfp.convert_registered(tf.constant(1, tf.int64), tf.int64).dtype == tf.int64


def test_replay_helpers():
    assert tfp.get_op_def("AddV2") is not None and tfp.get_op_def("no_such_op") is None

    @tf.function(autograph=False)
    def f():
        out = tfp.apply_op_helper("AddV2", x=tf.constant(1.0), y=tf.constant(2.0))
        assert len(out) == 4 and out[2].type == "AddV2"
        return out[3][0]
    assert float(f()) == 3.0
    v = tf.Variable(2.0)
    assert float(tfp.read_variable_op(v.handle, tf.float32)) == 2.0
    with tfp.function_call_config(tfp.disable_grappler):
        assert float(tf.function(lambda: v * 2.0)()) == 4.0
    # a function graph captures an eager variable's handle with its shape data
    w = tf.Variable(tf.zeros((2, 3)))
    with tfp.FuncGraph("probe").as_default():
        read = tfp.read_variable_op(w.handle, tf.float32)
    assert read.shape.as_list() == [2, 3]


def test_ops_are_created_from_attr_protos_as_apply_op_helper_creates_them():
    """replay's direct op creation (`attr_protos`, `create_op`): the same node as
    `_apply_op_helper` makes (type, attrs, name), and None where an attr is not given."""
    op_def = tfp.get_op_def("MatMul")
    values = {"T": tf.float32, "transpose_a": False, "transpose_b": True, "grad_a": False,
              "grad_b": False}
    protos = tfp.attr_protos("MatMul", op_def, values)
    assert protos is not None and set(protos) == {a.name for a in op_def.attr}
    assert tfp.attr_protos("MatMul", op_def, {"T": tf.float32}) is None

    @tf.function(autograph=False)
    def f(a, b):
        with tf.name_scope("r3"):
            (direct,) = tfp.create_op("MatMul", [a, b], protos, op_def)
        with tf.name_scope("r4"):
            helper = tfp.apply_op_helper("MatMul", a=a, b=b, transpose_a=False, transpose_b=True,
                                         grad_a=False, grad_b=False)[3][0]
        assert direct.op.name == "r3/MatMul" and helper.op.name == "r4/MatMul"
        assert direct.op.node_def.attr == helper.op.node_def.attr
        return direct, helper
    x = tf.constant([[1.0, 2.0]])
    d, h = f(x, x)
    assert d.numpy().tolist() == h.numpy().tolist() == [[5.0]]


def test_a_control_input_added_after_the_fact_orders_the_ops():
    """`add_control_input` (commit-gated writes): the op waits for the one added later."""
    v = tf.Variable(1.0)

    @tf.function(autograph=False)
    def f():
        read = v.read_value()
        w = tfp.assign_variable_op(v.handle, tf.constant(5.0))
        late = tf.raw_ops.NoOp(name="late")
        tfp.add_control_input(w, late)
        assert late in w.control_inputs
        return read
    assert f().numpy() == 1.0 and v.numpy() == 5.0


def test_assign_variable_op_writes_by_handle():
    v = tf.Variable([1.0, 2.0])
    tfp.assign_variable_op(v.handle, tf.constant([5.0, 6.0]))
    assert v.numpy().tolist() == [5.0, 6.0]


def test_graph_ops_can_be_made_without_their_python_traceback():
    from tensorflow.python.framework import ops
    assert "extract_traceback" in inspect.signature(ops._create_c_op).parameters, \
        "ops._create_c_op lost its extract_traceback parameter"
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(1.0)
        with tfp.without_op_tracebacks():
            b = tf.constant(2.0)
            with tfp.without_op_tracebacks():  # nests
                c = tf.constant(3.0)
            d = tf.constant(4.0)
        e = tf.constant(5.0)
    assert a.op.traceback and e.op.traceback
    assert b.op.traceback is None and c.op.traceback is None and d.op.traceback is None


def test_stateless_v2_draws_what_the_stateful_kernel_draws():
    """terra/tracing/random_streams.py: a stateful random kernel with attrs (seed, seed2) draws
    what `StatelessRandom*V2` draws with key `seed` and counter `seed2 << 64` plus 256 per output
    it drew before (eager caches the kernel per attrs: an op seed given again continues it)."""
    from terra.tracing import random_streams
    mask = (1 << 64) - 1
    for name, (op_type, stateless) in tfp.STATEFUL_RANDOM.items():
        stateful = getattr(tfp.gen_random_ops_module, name)
        stateful = getattr(stateful, "__wrapped__", stateful)  # TF's own wrapper
        assert stateful.__module__ == tfp.gen_random_ops_module.__name__
        integer = op_type == "RandomUniformInt"
        for dtype in ((tf.int32, tf.int64) if integer else
                      (tf.float32, tf.float64, tf.float16, tf.bfloat16)):
            tf.random.set_seed(5)
            seed, seed2, drawn = 123, 2**31 - 9, 0
            for shape in [(4, 3), (7,), (1,), (300,)]:
                total = (seed2 << 64) + tfp.PHILOX_SKIP_PER_OUTPUT * drawn
                counter = [total & mask, total >> 64]
                if integer:
                    lo, hi = tf.constant(-3, dtype), tf.constant(1000, dtype)
                    a = stateful(shape, lo, hi, seed=seed, seed2=seed2)
                    b = stateless(shape, key=[seed], counter=counter, alg=tfp.PHILOX_ALG,
                                  minval=lo, maxval=hi)
                else:
                    a = stateful(shape, dtype=dtype, seed=seed, seed2=seed2)
                    b = stateless(shape, key=[seed], counter=counter, alg=tfp.PHILOX_ALG,
                                  dtype=dtype)
                np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=f"{op_type} {dtype}")
                drawn += int(np.prod(shape))
    # tf.random.* look the wrappers up through the module at call time (so the patch reaches them)
    from tensorflow.python.ops import random_ops
    assert "gen_random_ops.random_standard_normal(" in inspect.getsource(random_ops.random_normal)
    assert "gen_random_ops.random_uniform(" in inspect.getsource(random_ops.random_uniform)
    assert "gen_random_ops.truncated_normal(" in inspect.getsource(random_ops.truncated_normal)
    assert "gen_random_ops.random_uniform_int(" in inspect.getsource(random_ops.random_uniform)
    assert random_streams.installed()  # (importing terra installs it)
    assert set(tfp.KERNEL_CACHE_RESETS) <= set(vars(tfp.ContextClass))


def test_trace_once_traces_once_and_orders_what_it_captures():
    """`trace_once` (tracing_compilation.trace_function): one trace, with automatic control
    dependencies, capturing variables and eager constants made outside."""
    v = tf.Variable(2.0)
    outside = tf.constant(3.0)
    calls = []

    def build():
        calls.append(1)
        v.assign_add(1.0)
        return outside * v.read_value()

    fn = tfp.trace_once(build)
    assert len(calls) == 1
    assert type(fn).__name__ == "ConcreteFunction"
    assert float(fn()) == 9.0 and float(v.numpy()) == 3.0
    assert float(fn()) == 12.0 and len(calls) == 1
