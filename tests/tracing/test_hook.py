"""The dispatch hook: completeness against op_callbacks, clean install/uninstall, thread scope,
and an interceptor that skips ops."""
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

from terra import _tf_private as tfp
from terra.tracing import Recorder, hook

# These read TF's attributes as TF defines them: a test before them in the same process may
# have left Terra's hook installed (a session keeps it between iterations until reset).
pytestmark = pytest.mark.usefixtures("fresh_terra")


def _attr_identities():
    return {(getattr(o, "__name__", o), a): hook._raw(o, a) for o, a in hook.patched_attributes()}


def test_install_uninstall_restores_every_attribute():
    before = _attr_identities()
    hook.install()
    hook.install()
    during = _attr_identities()
    assert all(during[k] is not before[k] for k in before)
    hook.uninstall()
    assert all(_attr_identities()[k] is during[k] for k in before)  # still installed once
    hook.uninstall()
    after = _attr_identities()
    assert all(after[k] is before[k] for k in before)
    assert not hook.installed()
    with pytest.raises(RuntimeError):
        hook.uninstall()


def test_activate_rejects_bad_interceptor_and_needs_install():
    with pytest.raises(RuntimeError, match="before install"):
        hook.activate(hook.Interceptor())
    hook.install()
    try:
        with pytest.raises(TypeError, match="Interceptor"):
            hook.activate(object())
    finally:
        hook.uninstall()


class _Log(hook.Interceptor):
    def __init__(self):
        self.ops = []

    def op(self, op_type, inputs, attrs, route, run):
        self.ops.append((op_type, route))
        return run()


def test_only_the_activating_thread_is_intercepted():
    log = _Log()
    other = []

    def work():
        other.append(tf.add(tf.constant(1.0), 2.0).numpy())
    with hook.intercepting(log):
        t = threading.Thread(target=work)
        t.start()
        t.join()
        tf.multiply(tf.constant(3.0), 2.0)
    assert other == [3.0]
    assert [op for op, _ in log.ops] == ["Mul"]


def test_skipping_interceptor_returns_substitutes():
    class Skip(hook.Interceptor):
        def op(self, op_type, inputs, attrs, route, run):
            return tf.constant(42.0) if op_type == "AddV2" else run()
    x = tf.constant(1.0)
    with hook.intercepting(Skip()):
        y = x + 1.0
        z = y * 2.0
    assert float(y) == 42.0 and float(z) == 84.0
    assert float(x + 1.0) == 2.0


def _training_program():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(6, activation="relu"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(1e-2)
    model(tf.zeros((1, 4)))
    opt.build(model.trainable_variables)
    gen = tf.random.Generator.from_seed(3)
    counter = tf.Variable(0.0)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def scale(t):
        return t * 0.5 + 1.0

    def step(x, y):
        noise = gen.normal(x.shape)
        with tf.GradientTape() as tape:
            logits = model(x + 0.01 * noise, training=True)
            loss = loss_fn(y, scale(logits))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        counter.assign_add(counter.read_value() * 0.0 + 1.0)
        return loss
    x = tf.constant(np.arange(20, dtype="float32").reshape(5, 4) / 20)
    y = tf.constant([0, 1, 2, 1, 0])
    return step, x, y


def _callback_ops():
    seen = []

    def cb(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is None:
            seen.append(op_type.decode() if isinstance(op_type, bytes) else op_type)
    return seen, cb


def test_hook_sees_every_op_of_a_keras_training_step():
    step, x, y = _training_program()
    step(x, y)  # warm up: trace the tf.function, build everything

    # 1. Simultaneously: every op op_callbacks reports, in order, is a record.
    seen, cb = _callback_ops()
    with Recorder("step") as rec:
        op_callbacks.add_op_callback(cb)
        try:
            step(x, y)
        finally:
            op_callbacks.remove_op_callback(cb)
    recorded = [r.op_type for r in rec.trace.records]
    assert recorded == seen
    assert len(recorded) > 100

    # 2. Without callbacks (the fast path stays on): the same op sequence as a callback run.
    with Recorder("step") as rec2:
        step(x, y)
    seen2, cb2 = _callback_ops()
    op_callbacks.add_op_callback(cb2)
    try:
        step(x, y)
    finally:
        op_callbacks.remove_op_callback(cb2)
    assert [r.op_type for r in rec2.trace.records] == seen2
    routes = {r.route for r in rec2.trace.records}
    assert routes == {"fast", "fallback", "function"}
    types = set(seen2)
    assert {"MatMul", "ResourceApplyAdam"} & types or {"MatMul", "AssignVariableOp"} <= types
    assert {"RngReadAndSkip", "StatelessRandomNormalV2"} <= types
    assert any(t.startswith("__inference_scale") or t.startswith("__forward_scale") for t in types)
    assert any("backward_scale" in t for t in types)
    assert {"ReadVariableOp", "AssignAddVariableOp"} <= types
    assert not rec2.trace.unsupported
    assert not hook.installed()


def test_fast_path_fallback_is_noted():
    v = keras.Variable(np.ones(3, "float32"))
    with Recorder() as rec:
        tf.raw_ops.AddV2(x=v, y=tf.constant([1.0, 2.0, 3.0]))
    ops = [(r.op_type, r.route) for r in rec.trace.records]
    assert ops[-1] == ("AddV2", "fallback")
    assert rec.trace.fast_fallbacks == [len(ops) - 1]


def test_idle_hook_keeps_results():
    hook.install()
    try:
        assert tfp.pywrap_tfe_module.TFE_Py_FastPathExecute.__name__ == "TFE_Py_FastPathExecute"
        assert float(tf.add(tf.constant(2.0), 3.0)) == 5.0
        assert np.asarray(tf.constant([1, 2])).tolist() == [1, 2]
    finally:
        hook.uninstall()


def test_an_exception_inside_recording_leaves_tf_clean():
    import sys
    before = _attr_identities()
    with pytest.raises(ZeroDivisionError):
        with Recorder():
            tf.add(tf.constant(1.0), 1.0)
            1 / 0
    assert not hook.installed() and hook.active() is None and sys.gettrace() is None
    assert all(_attr_identities()[k] is v for k, v in before.items())
    assert tfp.execute_module.execute is tfp.execute_module.quick_execute


def test_placeholder_reaching_eager_execution_is_replaced_by_its_value():
    """An op wrapper's fallback route hands converted inputs straight to `execute`; a placeholder
    among them must run as its value (C++ would crash on the placeholder object itself)."""
    from tensorflow.python.eager import context

    from terra.runtime.placeholders import ConstantResolver, Placeholder

    value = tf.constant([[1.0, 2.0]])
    ph = Placeholder.create(tf.float32, (1, 2), ConstantResolver(value))
    attrs = ("T", tf.float32.as_datatype_enum)
    with Recorder() as rec:
        out, = tfp.execute_module.execute(b"AddV2", 1, [ph, tf.constant([[10.0, 20.0]])], attrs,
                                          context.context())
    np.testing.assert_array_equal(out.numpy(), [[11.0, 22.0]])
    assert [r.op_type for r in rec.trace.records] == ["AddV2"]


def test_a_placeholder_sets_a_list_inputs_dtype_as_an_eager_tensor_does():
    """`tf.concat([[0], n])` with an int64 `n` is int64 in eager (TF takes a list's dtype from
    its first eager tensor). A placeholder for `n` must set it too: TF alone would make the
    literal int32 and fail on the mix (ragged row splits are built so)."""
    from terra.runtime.placeholders import ConstantResolver, Placeholder

    n = tf.constant([2, 5], tf.int64)
    eager = tf.concat([[0], n], 0)
    ph = Placeholder.create(tf.int64, (2,), ConstantResolver(n))
    with Recorder() as rec:
        out = tf.concat([[0], ph], 0)
        first = tf.concat([ph, [7]], 0)
    assert eager.dtype == out.dtype == first.dtype == tf.int64
    np.testing.assert_array_equal(out.numpy(), [0, 2, 5])
    np.testing.assert_array_equal(first.numpy(), [2, 5, 7])
    assert [r.op_type for r in rec.trace.records] == ["ConcatV2", "ConcatV2"]
    assert not hook.installed()
    with pytest.raises(ValueError):  # TF alone: the placeholder asked for int32
        tf.concat([[0], Placeholder.create(tf.int64, (2,), ConstantResolver(n))], 0)


def test_unit_patches_are_in_the_table_and_reset_restores_them():
    """The coarse-unit patches (optimizer.apply_gradients, Keras Layer.__call__, tf.function
    calls) are hook patches: installed with the session's first iteration, restored by identity
    by `terra.reset()`."""
    import terra
    classes = tfp.keras_unit_classes()
    owners = {(classes["apply_gradients"], "apply_gradients"), (classes["layer"], "__call__"),
              (tfp.PolymorphicFunction, "__call__")}
    assert owners <= set(hook.patched_attributes())
    terra.reset()
    before = {k: hook._raw(*k) for k in owners}
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.1)
    f = tf.function(lambda v: v * 2.0)
    for _ in range(3):
        with tf.TerraGradientTape() as tape:
            loss = tf.reduce_sum(model(np.ones((1, 2), np.float32))) + f(tf.constant(1.0))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
    assert all(hook._raw(*k) is not before[k] for k in owners)  # patched while Terra runs
    terra.reset()
    assert all(hook._raw(*k) is before[k] for k in owners)
    assert not hook.installed()


def test_layer_attribute_changes_advance_the_layer_epoch():
    """Keras' own `Layer.__setattr__` / `__delattr__` are what the hook wraps (the guards of
    layer units are kept while the epoch stands: runtime/layer_guards.py); a set to the value
    already there (Keras sets `built` and `_called` on every call) is no change."""
    layer_cls = tfp.keras_unit_classes()["layer"]
    assert "__setattr__" in vars(layer_cls) and "__delattr__" in vars(layer_cls)
    assert (layer_cls, "__setattr__") in set(hook.patched_attributes())
    import terra
    terra.reset()
    assert not hook.installed()
    e = hook.layer_epoch()
    hook.install()  # what changed while it was not installed went uncounted
    try:
        assert hook.layer_epoch() == e + 1
        d = keras.layers.Dense(2)
        e = hook.layer_epoch()
        d.units, d.built = 2, d.built
        assert hook.layer_epoch() == e
        d.units = 3
        assert hook.layer_epoch() == e + 1
        d.extra = [1]  # (Keras' tracking sets attributes of its own on the way)
        assert hook.layer_epoch() > e + 1
        e = hook.layer_epoch()
        del d.extra
        assert hook.layer_epoch() > e
        d(np.ones((1, 4), np.float32))
        e = hook.layer_epoch()
        d(np.ones((1, 4), np.float32))  # a call of a built layer changes nothing
        assert hook.layer_epoch() == e
    finally:
        hook.uninstall()
