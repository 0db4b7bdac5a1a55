"""The private TF APIs of the runtime section of terra/_tf_private.py still behave as relied upon.

If one of these fails after a TF upgrade, the runtime (placeholders, channels, graph runner) is
broken in the way the failing test names; fix the section, not the test.
"""
import inspect
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import cancellation, context, execute  # noqa: E402
from tensorflow.python.framework import tensor_conversion_registry  # noqa: E402

from terra import _tf_private as tfp  # noqa: E402

# These read TF's attributes as TF defines them: a test before them in the same process may
# have left Terra's hook installed (a session keeps it between iterations until reset).
pytestmark = pytest.mark.usefixtures("fresh_terra")


def test_tensor_classes():
    assert tfp.Tensor is tf.Tensor
    assert type(tf.constant(1.0)) is tfp.EagerTensor
    assert issubclass(tfp.EagerTensor, tfp.Tensor)
    # Placeholders are built with object.__new__ and set these private fields the base class reads.
    t = object.__new__(type("T", (tfp.Tensor,), {}))
    t._dtype, t._shape_val = tf.float32, tf.TensorShape([2])
    assert t.dtype == tf.float32 and t.shape == [2]


def test_conversion_honours_tf_tensor_overload_on_tensor_subclasses():
    class Sub(tfp.Tensor):
        def __tf_tensor__(self, dtype=None, name=None):
            return tf.constant([5.0])

    s = object.__new__(Sub)
    s._dtype, s._shape_val = tf.float32, tf.TensorShape([1])
    assert float(tensor_conversion_registry.convert(s)[0]) == 5.0
    assert float(tf.convert_to_tensor(s)[0]) == 5.0
    assert float(tf.add(s, 1.0)[0]) == 6.0  # op wrappers convert through the same route


def test_tensor_spec_cast_still_passes_tensor_subclasses_through():
    # Why install_function_call_guard exists: tf.function calls would hand the subclass to C++.
    class Sub(tfp.Tensor):
        pass

    s = object.__new__(Sub)
    s._dtype, s._shape_val = tf.float32, tf.TensorShape([1])
    from tensorflow.core.function import trace_type
    out = tf.TensorSpec([1], tf.float32).cast(s, trace_type.InternalCastContext())
    assert out is s


def test_call_function_is_the_eager_function_call_choke_point():
    sig = inspect.signature(context.Context.call_function)
    assert list(sig.parameters) == ["self", "name", "tensor_inputs", "num_outputs"]
    src = inspect.getsource(getattr(context.Context.call_function, "__wrapped__",
                                    context.Context.call_function))
    assert "cancellation.context()" in src and "execute_with_cancellation" in src


def test_execute_with_cancellation_signature():
    sig = inspect.signature(execute.execute_with_cancellation)
    for p in ("op_name", "num_outputs", "inputs", "attrs", "ctx", "cancellation_manager"):
        assert p in sig.parameters


def test_concrete_function_internals():
    v = tf.Variable(2.0)

    @tf.function(autograph=False)
    def f(x):
        return {"y": x * v}

    cf = tfp.concrete_function_of(f, (tf.constant(3.0),))
    assert cf is tfp.concrete_function_of(cf, ())
    atomic = cf._inference_function
    assert isinstance(atomic.name, bytes)
    assert len(atomic.cached_definition.signature.input_arg) == 1 + len(cf.captured_inputs)
    assert len(atomic.function_type.flat_outputs) == 1
    assert context.context().function_call_options.as_attrs() is not None
    out = tfp.call_concrete_cancellable(cf, [tf.constant(3.0)], tfp.CancellationManager())
    assert float(out["y"]) == 6.0
    with pytest.raises(ValueError, match="takes 1 tensor arguments, got 0"):
        tfp.call_concrete_cancellable(cf, [], tfp.CancellationManager())
    with pytest.raises(TypeError, match="tf.function or ConcreteFunction"):
        tfp.concrete_function_of(lambda: 1, ())


def test_a_concrete_function_runs_over_other_captured_variables():
    """ReboundFunction: the captured handles are passed as the call's trailing inputs, so the
    same function writes another variable of the same dtype and shape."""
    a, b = tf.Variable(1.0), tf.Variable(5.0)

    def body():
        a.assign_add(1.0)
        return a.read_value() * 2.0
    cf = tf.function(body, autograph=False).get_concrete_function()
    captured = list(cf.captured_inputs)
    assert [id(c) for c in captured] == [id(a.handle)]
    rebound = tfp.ReboundFunction(cf, [b.handle])
    assert tfp.concrete_function_of(rebound, []) is rebound
    out = tfp.call_concrete_cancellable(rebound, [], tfp.CancellationManager())
    assert (float(out), float(a.numpy()), float(b.numpy())) == (12.0, 1.0, 6.0)
    out = tfp.call_concrete_cancellable(cf, [], tfp.CancellationManager())
    assert (float(out), float(a.numpy()), float(b.numpy())) == (4.0, 2.0, 6.0)
    with pytest.raises(ValueError, match="captures 1 inputs, got 2"):
        tfp.ReboundFunction(cf, [b.handle, a.handle])


def test_every_eager_variable_is_initialized_through_the_patched_method():
    """roles.py files each variable where `ResourceVariable._init_from_args` (the hook wraps it)
    builds it: `tf.Variable` and Keras' variables (and their optimizer slots) pass through it."""
    import keras
    from terra.tracing import hook
    assert callable(tfp.ResourceVariable.__dict__[tfp.VARIABLE_INIT_ATTR])
    seen = []
    hook.install()
    hook.on_variable(seen.append)
    try:
        v = tf.Variable(1.0)
        m = keras.metrics.Mean()
        k = keras.Variable(tf.zeros((2,)))
    finally:
        hook.on_variable(None)
        hook.uninstall()
    assert seen[0] is v
    made = {id(x) for x in seen}
    assert all(id(x.value) in made for x in m.variables) and id(k.value) in made


def test_cancellation_manager_ends_blocked_dequeue_without_global_context():
    q = tf.queue.FIFOQueue(10, tf.float32, shapes=[])

    @tf.function(autograph=False)
    def g():
        return q.dequeue() + 1.0

    cf = g.get_concrete_function()
    cm = tfp.CancellationManager()
    box = {}

    def run():
        try:
            box["out"] = tfp.call_concrete_cancellable(cf, [], cm)
        except tf.errors.CancelledError as e:
            box["err"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    time.sleep(0.2)
    assert tfp.global_cancellation_context() is None  # nothing leaks to other threads
    assert cancellation.context() is None
    assert not cm.is_cancelled
    cm.start_cancel()
    th.join(5.0)
    assert not th.is_alive() and isinstance(box.get("err"), tf.errors.CancelledError)
    # queue and function stay usable
    q.enqueue(1.5)
    assert float(tfp.call_concrete_cancellable(cf, [], tfp.CancellationManager())) == 2.5


def test_new_tensor_uid_increases():
    a, b = tfp.new_tensor_uid(), tfp.new_tensor_uid()
    assert b > a and tf.constant(0.0)._id > b


def test_control_inputs_pending_sees_control_dependencies_blocks():
    seen = []

    def body():
        seen.append(tfp.control_inputs_pending())
        with tf.control_dependencies([tf.no_op()]):
            seen.append(tfp.control_inputs_pending())
            with tf.control_dependencies(None):
                seen.append(tfp.control_inputs_pending())
        seen.append(tfp.control_inputs_pending())
        return tf.constant(0)
    tf.function(body, autograph=False).get_concrete_function()
    assert seen == [False, True, False, False]


def test_attr_scope_active_sees_xla_jit_scopes():
    seen = []

    def body():
        seen.append(tfp.attr_scope_active())
        with tf.xla.experimental.jit_scope():
            seen.append(tfp.attr_scope_active())
        seen.append(tfp.attr_scope_active())
        return tf.constant(0)
    tf.function(body, autograph=False).get_concrete_function()
    assert seen == [False, True, False]


def test_eager_tensor_of_array_copies_like_conversion():
    import numpy as np
    for arr in (np.arange(12, dtype=np.int32).reshape(3, 4), np.float32(2.5) * np.ones((2,)),
                np.array(True)):
        d = tf.as_dtype(arr.dtype)
        t = tfp.eager_tensor_of_array(arr, d)
        ref = tf.convert_to_tensor(arr)
        assert isinstance(t, tfp.EagerTensor) and t.dtype == d and t.shape == ref.shape
        assert np.array_equal(t.numpy(), ref.numpy())
        assert t.device == ref.device
    arr = np.zeros(3, np.float32)
    t = tfp.eager_tensor_of_array(arr, tf.float32)
    arr[:] = 7  # the tensor holds a copy: a later change of the array is not seen
    assert t.numpy().tolist() == [0.0, 0.0, 0.0]


def test_function_call_guard_is_installed_once_and_wraps():
    from terra.runtime.placeholders import ConstantResolver, Placeholder
    Placeholder.create(tf.float32, [], ConstantResolver(1.0))
    fn = context.Context.call_function
    assert hasattr(fn, "__wrapped__")
    Placeholder.create(tf.float32, [], ConstantResolver(1.0))
    assert context.Context.call_function is fn


def test_eager_tensor_array_reads_only_an_eager_tensor_index_with_numpy():
    # Why install_tensor_array_index_guard exists: any other tensor index is compared with ops.
    from tensorflow.python.ops import tensor_array_ops
    cls = tensor_array_ops._EagerTensorArray
    for name in tfp.TENSOR_ARRAY_INDEX_METHODS:
        method = getattr(cls, name)
        original = getattr(method, "__wrapped__", method)
        params = list(inspect.signature(original).parameters)
        arg = params[1]
        assert arg in ("index", "indices"), (name, params)
        src = inspect.getsource(original)
        assert f"isinstance({arg}, ops.EagerTensor)" in src and f"{arg} = {arg}.numpy()" in src, name


def test_gradient_tape_exports():
    """`terra.enable()` rebinds the public names of TF's tape class; they must be found where TF's
    generated API modules put them, and Keras' trainer must open its tape through `tf`."""
    import inspect

    import tensorflow as tf
    from terra import _tf_private as tfp

    assert tfp.PlainGradientTape is tf.GradientTape
    owners = {m for m, _ in tfp.gradient_tape_exports()}
    for public in (tf, tf.autodiff, tf.compat.v2, tf.compat.v1):
        assert public in owners
    trainer = tfp.keras_trainer_class()
    assert trainer is not None
    for attr in tfp.KERAS_TRAINER_BOUNDARIES:
        assert callable(trainer.__dict__[attr])
    assert "tf.GradientTape()" in inspect.getsource(trainer.train_step)


def test_keras_builtin_models_are_recognized_with_all_their_operations():
    """`keras.Sequential` and `keras.Model(inputs, outputs)` live in KERAS_BUILTIN_MODEL_MODULES,
    and `_flatten_layers` / `_operations` list every layer and `keras.ops` operation of them
    (the model unit's guard covers exactly these)."""
    import keras
    seq = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(2),
                            keras.Sequential([keras.layers.Dense(2)])])
    inp = keras.layers.Input((3,))
    fun = keras.Model(inp, keras.ops.relu(keras.layers.Dense(2)(inp)))
    assert type(seq).__module__ in tfp.KERAS_BUILTIN_MODEL_MODULES
    assert type(fun).__module__ in tfp.KERAS_BUILTIN_MODEL_MODULES
    names = [type(x).__name__ for x in tfp.keras_builtin_model_layers(seq)]
    assert names.count("Dense") == 2 and "Sequential" in names, names
    kinds = {type(x).__module__.split(".")[2] for x in tfp.keras_builtin_model_layers(fun)}
    assert kinds == {"layers", "ops"}, kinds

    class Own(keras.Model):
        def call(self, x):
            return x
    assert tfp.keras_builtin_model_layers(Own()) is None


def test_tapes_recording_and_stop_recording():
    """What the recorder notes per op (`OpRecord.taped`) and how the fallback replays an op eager
    ran unrecorded."""

    x = tf.constant(2.0)
    assert not tfp.tapes_recording()
    with tf.GradientTape() as tape:
        tape.watch(x)
        assert tfp.tapes_recording()
        with tape.stop_recording():
            assert not tfp.tapes_recording()
        with tfp.stop_recording():
            assert not tfp.tapes_recording()
            y = x * 3.0
        assert tfp.tapes_recording()
        z = y * x
    assert float(tape.gradient(z, x)) == 6.0  # y was not recorded: a constant to the tape


def test_keras_loops_change_only_their_loop_state_on_a_model():
    """`KERAS_LOOP_STATE` names every plain attribute that fit / evaluate / predict set on a
    model (a unit's guard leaves them out): if Keras sets another, a model's call stops being
    skipped whole after such a loop, and this test names the attribute."""
    import keras
    import numpy as np

    def plain(model):
        return {k: v for k, v in vars(model).items()
                if isinstance(v, (bool, int, float, str, type(None)))}

    x = np.ones((8, 4), np.float32)
    y = np.ones((8, 1), np.float32)
    for compiled in (False, True):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        if compiled:
            model.compile(optimizer="sgd", loss="mse")
        model(x)
        before = plain(model)
        model.predict(x, verbose=0)
        if compiled:
            model.evaluate(x, y, verbose=0)
            model.fit(x, y, epochs=1, verbose=0)
        after = plain(model)
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert changed <= tfp.KERAS_LOOP_STATE, sorted(changed - tfp.KERAS_LOOP_STATE)


def test_the_strided_slice_gradient_entry_and_its_rule():
    """`GradientEntry` shows TF's registered StridedSlice gradient as `fn`, and Terra's rule
    (`strided_slice_gradient`) gives TF's gradient in eager while taking the slice's own bound
    tensors (the gradient op's inputs are the forward op's, by identity)."""
    from tensorflow.python.ops import array_grad
    entry = tfp.GradientEntry("StridedSlice")
    assert entry.fn is array_grad._StridedSliceGrad
    rule = tfp.strided_slice_gradient(entry.fn)
    x = tf.Variable([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    got = {}
    for name, fn in (("tf", array_grad._StridedSliceGrad), ("terra", rule)):
        entry.fn = fn
        try:
            with tf.GradientTape() as tape:
                y = x[1, 0:3:2] * tf.constant([2.0, 5.0])
            got[name] = tape.gradient(y, x).numpy()
        finally:
            entry.fn = array_grad._StridedSliceGrad
    assert (got["tf"] == got["terra"]).all() and got["tf"].tolist() == [[0, 0, 0], [2, 0, 5]]

    seen = []

    class Op:  # what eager's backprop hands a gradient function
        inputs = (tf.ones((2, 3)), tf.constant([1, 0]), tf.constant([2, 3]), tf.constant([1, 2]))

        def get_attr(self, name):
            return {"shrink_axis_mask": 1}.get(name, 0)

    orig_value = tfp.tensor_util_module.constant_value
    try:
        tfp.tensor_util_module.constant_value = lambda t, partial=False: (
            seen.append(t), orig_value(t, partial))[1]
        rule(Op(), tf.ones((2,)))
    finally:
        tfp.tensor_util_module.constant_value = orig_value
    assert not any(t is b for t in seen for b in Op.inputs[1:])  # the bounds are not copied


def test_eager_tensors_take_no_part_in_numpy_dispatch_of_their_own():
    """The hook adds `__array_function__` to eager tensors (and deletes it again): TF defines
    none, and NumPy functions read an eager tensor through the buffer protocol, unseen."""
    assert "__array_function__" not in tfp.EagerTensorBase.__dict__
    assert not hasattr(tf.constant(1.0), "__array_function__")
    import numpy as np
    assert np.squeeze(tf.constant([[1.0, 2.0]])).tolist() == [1.0, 2.0]


def test_gradient_taken_leaves_a_tape_as_tf_gradient_does():
    """A non-persistent tape after `gradient` inside its `with`: off the stack, no state."""
    x = tf.constant(3.0)
    with tf.GradientTape() as eager_tape:
        eager_tape.watch(x)
        y = x * x
        eager_tape.gradient(y, x)
        assert not tfp.tapes_recording()
    assert not tfp.tape_has_state(eager_tape) and not tfp.tape_is_recording(eager_tape)
    with tf.GradientTape() as tape:
        tape.watch(x)
        assert tfp.gradient_taken(tape) is True
        assert not tfp.tapes_recording()
    assert not tfp.tape_has_state(tape) and not tfp.tape_is_recording(tape)
    with pytest.raises(RuntimeError, match="non-persistent"):
        tape.gradient(x * x, x)
    with tf.GradientTape(persistent=True) as kept:
        kept.watch(x)
        assert tfp.gradient_taken(kept) is False
        assert tfp.tapes_recording()


def test_plain_operator_dtypes_follows_tfs_dtype_conversion_mode():
    """Skipped placeholders' operators (python_runner `_OPERATORS`) call the op directly only
    while TF's operators convert as they always have: NumPy-style promotion and auto dtype
    conversion each change which op `x * 2.0` is."""
    from tensorflow.python.framework import ops
    assert tfp.plain_operator_dtypes()
    before = ops._dtype_conversion_mode
    try:
        for mode in ("legacy", "all", "safe"):
            ops.set_dtype_conversion_mode(mode)
            assert not tfp.plain_operator_dtypes(), mode
        ops.set_dtype_conversion_mode("off")
        assert tfp.plain_operator_dtypes()
    finally:
        ops._dtype_conversion_mode = before
    assert tfp.plain_operator_dtypes()
