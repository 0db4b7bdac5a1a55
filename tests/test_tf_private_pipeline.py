"""Fails loudly if TF changes the forward/backward function pair the pipeline relies on."""
import numpy as np
import tensorflow as tf

from terra import _tf_private


def test_private_names_still_exist():
    from tensorflow.python.eager.polymorphic_function import concrete_function as cf
    assert hasattr(cf, "_FirstOrderTapeGradientFunctions"), "TF moved the tape forward/backward builder"
    for name in ("_func_graph", "_attrs", "_garbage_collector", "_delayed_rewrite_functions"):
        assert name in cf.ConcreteFunction.__init__.__code__.co_names or hasattr(cf.ConcreteFunction, name), name
    functions = cf._FirstOrderTapeGradientFunctions
    for name in ("forward", "_forward_and_backward_functions"):
        assert hasattr(functions, name), f"_FirstOrderTapeGradientFunctions.{name} is gone"


def test_forward_backward_pair_splits_a_function_and_matches_the_tape():
    w = tf.Variable([[0.5, -1.0], [2.0, 0.25]])
    x = tf.constant([[1.0, 2.0], [3.0, -1.0]])

    @tf.function(autograph=False)
    def f(x):
        return tf.reduce_sum(tf.tanh(tf.matmul(x, w)) ** 2)

    pair = _tf_private.forward_backward_pair(f.get_concrete_function(tf.TensorSpec((2, 2))))
    assert pair.num_outputs == 1 and pair.num_output_grads == 1
    outs = pair.forward(x, *f.get_concrete_function(tf.TensorSpec((2, 2))).captured_inputs)
    assert len(outs) > 1, "forward must return side outputs after the real output"
    assert {kind for kind, _ in pair.capture_sources} <= {"side", "external"}
    captures = [outs[k] if kind == "side" else k for kind, k in pair.capture_sources]
    grads = pair.backward([tf.constant(1.0)], captures)
    with tf.GradientTape() as tape:
        tape.watch(x)
        ref = tf.reduce_sum(tf.tanh(tf.matmul(x, w)) ** 2)
    gx, gw = tape.gradient(ref, [x, w])
    np.testing.assert_allclose(outs[0].numpy(), ref.numpy(), rtol=1e-6)
    assert len(grads) == 2  # one per forward-graph input: x, then the captured variable handle
    np.testing.assert_allclose(grads[0].numpy(), gx.numpy(), rtol=1e-6)
    np.testing.assert_allclose(grads[1].numpy(), gw.numpy(), rtol=1e-6)


def test_backward_keeps_an_indexed_slices_gradient_whole():
    """`_call_flat` packs composites itself; the pair's backward must not pack them again (a
    gathered weight's IndexedSlices gradient made "Could not pack sequence")."""
    emb = tf.Variable(tf.reshape(tf.range(40, dtype=tf.float32), (10, 4)) / 40.0)
    w = tf.Variable(tf.ones((4, 3)))

    @tf.function(autograph=False)
    def f(ids):
        return tf.reduce_sum(tf.matmul(tf.gather(emb, ids), w) ** 2)

    concrete = f.get_concrete_function(tf.TensorSpec((5,), tf.int32))
    pair = _tf_private.forward_backward_pair(concrete)
    ids = tf.constant([1, 2, 2, 7, 0])
    outs = pair.forward(ids, *concrete.captured_inputs)
    grads = pair.backward([tf.constant(1.0)], [outs[k] if kind == "side" else k
                                                for kind, k in pair.capture_sources])
    with tf.GradientTape() as tape:
        ref = tf.reduce_sum(tf.matmul(tf.gather(emb, ids), w) ** 2)
    r_emb, r_w = tape.gradient(ref, [emb, w])
    assert grads[0] is None and isinstance(grads[1], tf.IndexedSlices)
    np.testing.assert_array_equal(tf.convert_to_tensor(grads[1]).numpy(), tf.convert_to_tensor(r_emb).numpy())
    np.testing.assert_array_equal(grads[2].numpy(), r_w.numpy())


def test_backward_takes_gradients_for_trainable_outputs_only():
    """TF's backward function takes one gradient per float output and none for an integer one;
    `grad_outputs` says which (a stage sending a residual stream plus a mask relies on it)."""
    w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])

    @tf.function(autograph=False)
    def f(x):
        return tf.cast(x > 0, tf.int32), tf.matmul(x, w), 2.0 * x

    concrete = f.get_concrete_function(tf.TensorSpec((2, 2)))
    pair = _tf_private.forward_backward_pair(concrete)
    assert pair.num_outputs == 3 and pair.grad_outputs == (1, 2) and pair.num_output_grads == 2
    x = tf.constant([[1.0, -1.0], [0.5, 2.0]])
    outs = pair.forward(x, *concrete.captured_inputs)
    grads = pair.backward([tf.ones((2, 2)), tf.ones((2, 2))],
                          [outs[k] if kind == "side" else k for kind, k in pair.capture_sources])
    with tf.GradientTape() as tape:
        tape.watch(x)
        ref = tf.reduce_sum(tf.matmul(x, w)) + tf.reduce_sum(2.0 * x)
    gx, gw = tape.gradient(ref, [x, w])
    np.testing.assert_array_equal(grads[0].numpy(), gx.numpy())
    np.testing.assert_array_equal(grads[1].numpy(), gw.numpy())


def test_keras_functional_graph_internals_still_exist():
    """terra.pipeline.keras_graph walks a functional model with Keras' own node table and runs
    each node as the model does; fails loudly if Keras renames any of it."""
    import keras
    from keras.src.models import functional
    assert callable(getattr(functional, "operation_fn", None)), "keras moved functional.operation_fn"
    inp = keras.Input((3,))
    a = keras.layers.Dense(4, name="a")
    b = keras.layers.Dropout(0.5, seed=1, name="b")
    out = keras.layers.Add(name="c")([a(inp), b(a(inp))])
    model = keras.Model(inp, out)
    assert _tf_private.is_keras_functional(model)
    assert not _tf_private.is_keras_functional(keras.layers.Dense(2))
    nodes = _tf_private.keras_functional_nodes(model)
    assert [n.operation.name for n in nodes][-1] == "c" and len(nodes) == 4  # a twice, b, c
    x = tf.ones((2, 3))
    values = {id(t): x for t in model.inputs}
    for node in nodes:
        outs = _tf_private.keras_node_call(node, values, training=True)
        values.update({id(t): v for t, v in zip(node.outputs, outs)})
    # training=True reached Dropout: some units are dropped (zero) where the model drops them too.
    got = values[id(model.outputs[0])].numpy()
    assert got.shape == (2, 4)
    ref = model(x, training=False).numpy()
    assert not np.allclose(got, ref), "training=True did not reach the Dropout node"


def test_move_keras_variable_keeps_the_keras_object_and_its_value():
    import keras
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    kernel = layer.kernel
    before = kernel.numpy()
    target = cpus[-1]
    _tf_private.move_keras_variable(kernel, target)
    assert layer.kernel is kernel
    assert kernel.value.device.endswith(target.split("/")[-1])
    np.testing.assert_array_equal(kernel.numpy(), before)
    kernel.assign(before + 1)          # writes reach the new tf.Variable
    np.testing.assert_allclose(layer(tf.ones((1, 3))).numpy(), np.ones((1, 3), "float32") @ (before + 1), rtol=1e-6)
    opt = keras.optimizers.SGD(1.0)
    opt.apply_gradients([(tf.ones_like(kernel.value), kernel)])
    np.testing.assert_allclose(kernel.numpy(), before)


def test_wait_for_devices_returns_after_pending_work():
    x = tf.random.normal((64, 64))
    y = tf.matmul(x, x)
    _tf_private.wait_for_devices()
    assert y.shape == (64, 64)
    from tensorflow.python.eager import context
    assert callable(getattr(context.context(), "sync_executors", None)), "TF renamed Context.sync_executors"


def test_place_updates_with_variables_runs_each_update_on_its_variables_device():
    """One optimizer over variables on two devices: Keras would run every update under the
    caller's device scope; patched, each update's arithmetic carries its variable's device, and
    the values are the same."""
    import keras
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    values = []
    for patch in (False, True):
        with tf.device(cpus[0]):
            a = keras.Variable(np.ones((3,), "float32"))
        with tf.device(cpus[1]):
            b = keras.Variable(np.full((3,), 2.0, "float32"))
        opt = keras.optimizers.Adam(0.1)
        with tf.device(cpus[0]):
            opt.build([a, b])
        if patch:
            _tf_private.place_updates_with_variables(opt)
            _tf_private.place_updates_with_variables(opt)   # idempotent

        @tf.function(autograph=False)
        def apply(ga, gb):
            opt.apply_gradients([(ga, a), (gb, b)])
        with tf.device(cpus[0]):
            apply(tf.ones(3), tf.ones(3))
        graph = apply.get_concrete_function(tf.TensorSpec((3,)), tf.TensorSpec((3,))).graph
        sqrt_devices = sorted(op.device.rsplit("/", 1)[-1] for op in graph.get_operations() if op.type == "Sqrt")
        names = [c.rsplit("/", 1)[-1] for c in cpus]
        # Adam takes two square roots per variable: with b's on CPU:1 once patched.
        # Unpatched they carry no device: they run wherever the apply call runs.
        assert sqrt_devices == (sorted(names * 2) if patch else [""] * 4), sqrt_devices
        # Every op reading a gradient runs on its variable's device once patched; unpatched,
        # Keras' all-reduce (an identity per gradient outside a strategy) reads them wherever
        # the call runs, which copies every gradient there.
        grads = {t.name: name for t, name in zip(graph.inputs[:2], names)}
        readers = [(op.device.rsplit("/", 1)[-1], grads[t.name]) for op in graph.get_operations()
                   for t in op.inputs if t.name in grads]
        assert readers and all(dev == want for dev, want in readers) == patch, readers
        values.append((a.numpy(), b.numpy()))
    np.testing.assert_array_equal(values[0][0], values[1][0])
    np.testing.assert_array_equal(values[0][1], values[1][1])
