"""A plain `keras.Sequential` or functional `keras.Model` made of built-in layers is one coarse
unit (terra/runtime/units.py `layer_call`), guarded on the model, its settings and every layer's;
a subclassed model, or one holding a user-defined layer, is not (its layers are units of their
own). A built-in Keras loss object's call is a unit too. Each program runs eagerly and under Terra: same losses and variables, bit for bit."""
import functools
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra import _tf_private as tfp  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(timeout_s=30.0)
    yield
    terra.reset()
    terra.config(**old)


class Scale(keras.layers.Layer):
    def call(self, x):
        return 2.0 * x


def sequential(seed, extra=None):
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Input((4,)), keras.layers.Dense(8),
              keras.layers.LeakyReLU(negative_slope=0.2), keras.layers.Dense(1)]
    if extra is not None:
        layers.insert(2, extra)
    return keras.Sequential(layers)


def functional(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.layers.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    return keras.Model(inp, keras.layers.Dense(1)(keras.layers.Add()([h, h])[:, :1]))


def train(make, Tape, steps=8, numpy_inputs=False, change=None):
    model, opt = make(), keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    ys = rng.normal(size=(steps, 8, 1)).astype(np.float32)
    losses = []
    for i in range(steps):
        if change is not None:
            change(model, i)
        x = xs[i] if numpy_inputs else tf.constant(xs[i])
        with Tape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - ys[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy().tolist() for v in model.variables]


def both(make, **kw):
    eager = train(make, tf.GradientTape, **kw)
    with CompileCounter() as c:
        got = train(make, tf.TerraGradientTape, **kw)
    assert got == eager, terra.explain()
    return c


def unit_spans():
    (site,) = terra._SESSION.sites.values()
    compiled = [p for p in site.paths.values() if p.graph is not None]
    return sorted({(u.start, u.end) for p in compiled for u in p.units.values()})


def test_a_sequential_model_call_is_one_unit():
    both(lambda: sequential(0)).assert_counts(traces=3, graph_builds=1, fallbacks=0)
    spans = unit_spans()
    # the model's call, tape.gradient, apply_gradients: three units, the first from op 0
    assert len(spans) == 3 and spans[0][0] == 0, spans


def test_a_functional_model_with_a_sliced_output_is_one_unit():
    both(lambda: functional(1)).assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert len(unit_spans()) == 3


def test_changing_an_inner_layers_setting_is_not_skipped():
    """`negative_slope` of the LeakyReLU inside the model changes at step 5: the model's guard
    fails, its layers run op by op, a constant differs and the new slope's path is traced."""
    def change(model, i):
        if i == 5:
            model.layers[1].negative_slope = 0.5
    both(lambda: sequential(2), change=change).assert_counts(traces=4, graph_builds=2,
                                                            fallbacks=1)


def test_a_predict_between_steps_keeps_the_model_one_unit(monkeypatch):
    """`model.predict` sets its loop state on the model (`stop_predicting`, `predict_function`):
    not a setting of its call, so the compiled steps after it still skip the model's call whole
    (its Dense layers' `call` is not run), where before every later step ran it op by op."""
    xs = tf.constant(np.random.default_rng(3).normal(size=(8, 4)).astype(np.float32))

    def change(model, i):
        if i == 4:
            model.predict(xs, verbose=0)
    calls = []
    real_call = keras.layers.Dense.call
    monkeypatch.setattr(keras.layers.Dense, "call", functools.wraps(real_call)(
        lambda self, *a, **k: calls.append(1) or real_call(self, *a, **k)))
    eager = train(lambda: sequential(4), tf.GradientTape, steps=10, change=change)
    calls.clear()
    with CompileCounter() as c:
        got = train(lambda: sequential(4), tf.TerraGradientTape, steps=10, change=change)
    assert got == eager, terra.explain()
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # 2 Dense layers: traced steps 1-3 and predict's call run them; compiled steps 4-10 do not
    assert len(calls) == 2 * 3 + 2, terra.explain()


def test_a_model_with_a_user_defined_layer_is_not_a_unit():
    assert tfp.keras_builtin_model_layers(sequential(3, extra=Scale())) is None
    assert tfp.keras_builtin_model_layers(sequential(3)) is not None
    both(lambda: sequential(3, extra=Scale())).assert_counts(traces=3, graph_builds=1,
                                                            fallbacks=0)
    assert len(unit_spans()) > 3  # its built-in layers are units one by one


def test_numpy_inputs_are_fed_to_the_model_unit():
    """The array passed straight to the model becomes a feed inside its call; skipping the
    unit feeds it (a new array each step)."""
    both(lambda: sequential(4), numpy_inputs=True).assert_counts(traces=3, graph_builds=1,
                                                                fallbacks=0)
    assert len(unit_spans()) == 3


def train_with_loss(Tape, steps=8, change=None):
    model, opt = sequential(5), keras.optimizers.SGD(0.05)
    loss_fn = keras.losses.MeanSquaredError()
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    ys = rng.normal(size=(steps, 8, 1)).astype(np.float32)
    losses = []
    for i in range(steps):
        if change is not None:
            change(loss_fn, i)
        with Tape() as tape:
            loss = loss_fn(ys[i], model(xs[i], training=True))  # NumPy data straight in
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy().tolist() for v in model.variables]


def test_a_builtin_loss_object_and_a_model_fed_numpy_are_units():
    eager = train_with_loss(tf.GradientTape)
    with CompileCounter() as c:
        got = train_with_loss(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert len(unit_spans()) == 4  # the model, the loss, tape.gradient, apply_gradients


def test_changing_a_loss_objects_reduction_is_not_skipped():
    def change(loss_fn, i):
        if i == 5:
            loss_fn.reduction = "sum"
    eager = train_with_loss(tf.GradientTape, change=change)
    with CompileCounter() as c:
        got = train_with_loss(tf.TerraGradientTape, change=change)
    assert got == eager, terra.explain()
    c.assert_counts(traces=4, graph_builds=2, fallbacks=1)
    assert tfp.keras_loss_settings(keras.losses.MeanSquaredError()) is not None
    assert tfp.keras_loss_settings(object()) is None


def train_with_integer_labels(Tape, steps=8):
    model, opt = sequential(6), keras.optimizers.SGD(0.05)
    model = keras.Sequential([model, keras.layers.Dense(3)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    ys = rng.integers(0, 3, size=(steps, 8)).astype(np.int32)  # converted to float by the loss
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = loss_fn(ys[i], model(xs[i], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy().tolist() for v in model.variables]


def test_integer_labels_a_loss_converts_are_fed_to_the_loss_unit(monkeypatch):
    """The loss converts the int32 labels to float32 inside its call: skipping the unit converts
    them the same way, so the loss is skipped whole (before, the feed's dtype differed from the
    array's and every op of the loss was matched one by one)."""
    from terra.runtime.python_runner import PythonRunner
    matched = []
    original = PythonRunner._skip

    def counting(self, *args, **kwargs):
        matched.append((self.iteration.number, args[0]))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(PythonRunner, "_skip", counting)
    eager = train_with_integer_labels(tf.GradientTape)
    with CompileCounter() as c:
        got = train_with_integer_labels(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert len(unit_spans()) == 4  # the model, the loss, tape.gradient, apply_gradients
    # iterations 4-8 skip four units and no op on its own; the one op is past the last step's
    # path (the first variable read after the loop, which ends the iteration)
    assert matched == [(8, "ReadVariableOp")], matched


def train_embedding_model(Tape, steps=8):
    keras.utils.set_random_seed(7)
    inp = keras.layers.Input((5,), dtype="int32")
    h = Scale()(keras.layers.Embedding(12, 4)(inp))  # a user-defined layer
    model = keras.Model(inp, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(h)))
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 12, size=(steps, 3, 5)).astype(np.int32)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean(model(ids[i], training=True) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy().tolist() for v in model.variables]


@pytest.mark.parametrize("user_units", [False, True])
def test_a_tensor_the_model_converted_is_fed_to_the_embedding_unit(monkeypatch, request,
                                                                   user_units):
    """The functional model converts the NumPy ids to a tensor and hands it to its Embedding:
    an external tensor, fed when the Embedding unit is skipped (before, the layer's guard named
    it by object, which is new every step, so the unit was never usable). With user-defined
    layers as units, the model (its Scale layer only computes) is one unit, fed the same way."""
    old = terra.config(user_layer_units=user_units)
    request.addfinalizer(lambda: terra.config(**old))  # a setting is global: put it back
    from terra.runtime.python_runner import PythonRunner
    matched = []
    original = PythonRunner._skip

    def counting(self, *args, **kwargs):
        if self.iteration.number == 5:
            matched.append(args[0])
        return original(self, *args, **kwargs)
    monkeypatch.setattr(PythonRunner, "_skip", counting)
    eager = train_embedding_model(tf.GradientTape)
    with CompileCounter() as c:
        got = train_embedding_model(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # in a compiled iteration only the ops outside units are matched one by one: Scale's Mul
    # (unless the model is a unit), then the loss's Pow (once, on TF's fast route) and Mean
    assert matched == (["Pow", "Mean"] if user_units else ["Mul", "Pow", "Mean"]), matched


def gan(Tape, steps=10, batches=(8,), seed=3):
    """A GAN's step (keras.io's WGAN-GP, in small): two critic updates, then the generator's,
    its noise drawn outside the tapes; the batch size cycles through `batches` (a last batch
    of another size every epoch)."""
    keras.utils.set_random_seed(seed)
    gen = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(6),
                            keras.layers.LeakyReLU(negative_slope=0.2), keras.layers.Dense(4)])
    critic = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(6),
                               keras.layers.LeakyReLU(negative_slope=0.2), keras.layers.Dense(1)])
    c_opt, g_opt = keras.optimizers.SGD(0.02), keras.optimizers.SGD(0.02)
    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        n = batches[i % len(batches)]
        real = tf.constant(rng.normal(size=(n, 4)).astype(np.float32))
        for _ in range(2):
            z = tf.constant(rng.normal(size=(n, 3)).astype(np.float32))
            with Tape() as tape:
                c_loss = tf.reduce_mean(critic(gen(z, training=True), training=True)) - \
                    tf.reduce_mean(critic(real, training=True))
            grads = tape.gradient(c_loss, critic.trainable_variables)
            c_opt.apply_gradients(zip(grads, critic.trainable_variables))
        z = tf.constant(rng.normal(size=(n, 3)).astype(np.float32))
        with Tape() as tape:
            g_loss = -tf.reduce_mean(critic(gen(z, training=True), training=True))
        grads = tape.gradient(g_loss, gen.trainable_variables)
        g_opt.apply_gradients(zip(grads, gen.trainable_variables))
        losses.append((float(c_loss), float(g_loss)))
    return losses, [v.numpy().tolist() for v in gen.variables + critic.variables], gen


def _model_units(gen):
    """Per compiled path: its calls of `gen` skipped whole (model units), and all its units."""
    out = []
    for site in terra._SESSION.sites.values():
        for p in site.paths.values():
            if p.graph is not None:
                out.append((sum(u.guard[0] == id(gen) for u in p.units.values()), len(p.units)))
    return sorted(out)


@pytest.mark.parametrize("batches", [(8,), (8, 8, 8, 8, 5)], ids=["one_size", "last_batch_smaller"])
def test_a_model_first_met_where_the_path_leaves_is_traced_as_one_unit(batches):
    """Where a path ends and the program goes on into a model call (the generator's step after
    the critic's), or a model is handed data of a shape no path was traced with (a smaller last
    batch), the fallback comes before the call, not at its first op: the trace then holds the
    call as one unit, and every later step skips it whole. Falling back inside the call, the
    trace held the model's layers as units of their own, and the path taken from it matched
    them one by one for good (with the fallback at the first op: generator units per path
    [1, 1] and [0, 1, 1, 1, 1], 8 traces, 3 fallbacks and 4 builds with the smaller batch)."""
    eager = gan(tf.GradientTape, batches=batches)[:2]
    with CompileCounter() as c:
        *got, gen = gan(tf.TerraGradientTape, batches=batches)
        terra.end_iteration()
    assert got == list(eager), terra.explain()
    # the critic's paths call the generator once, the path going on into its step twice
    per_path = [n for n, _ in _model_units(gen)]
    assert per_path == {(8,): [1, 2], (8, 8, 8, 8, 5): [1, 1, 1, 2]}[batches], \
        (per_path, terra.explain())
    assert (c.traces, c.fallbacks, c.graph_builds) == {(8,): (6, 1, 2),
                                                        (8, 8, 8, 8, 5): (7, 2, 3)}[batches], \
        (c.traces, c.fallbacks, c.graph_builds, terra.explain())


def critic_then_masked(Tape, steps=10, seed=4):
    """One or two updates of one model, then one of a model whose output carries a Keras mask (an
    Embedding with `mask_zero`): never a unit (`layer_call`), so its call is matched op by op."""
    keras.utils.set_random_seed(seed)
    critic = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(1)])
    masked = keras.Sequential([keras.layers.Input((5,), dtype="int32"),
                               keras.layers.Embedding(10, 3, mask_zero=True),
                               keras.layers.Dense(2)])
    c_opt, m_opt = keras.optimizers.SGD(0.02), keras.optimizers.SGD(0.02)
    rng = np.random.default_rng(seed)
    losses = []
    for i in range(steps):
        for _ in range(int(rng.integers(1, 3))):  # one or two, at random: mispredicted
            x = tf.constant(rng.normal(size=(8, 4)).astype(np.float32))
            with Tape() as tape:
                c_loss = tf.reduce_mean(critic(x) ** 2)
            grads = tape.gradient(c_loss, critic.trainable_variables)
            c_opt.apply_gradients(zip(grads, critic.trainable_variables))
        ids = tf.constant(rng.integers(0, 10, size=(8, 5)).astype(np.int32))
        with Tape() as tape:
            m_loss = tf.reduce_mean(masked(ids) ** 2)
        grads = tape.gradient(m_loss, masked.trainable_variables)
        m_opt.apply_gradients(zip(grads, masked.trainable_variables))
        losses.append((float(c_loss), float(m_loss)))
    return losses, [v.numpy().tolist() for v in critic.variables + masked.variables]


def test_a_model_that_is_no_unit_called_past_a_paths_end_switches_to_the_path_going_on():
    """Past the end of a path, a model call that no path holds as a unit (its output carries a
    mask) switches to the compiled path that goes on through its ops, as its first op would;
    it does not fall back every step for want of a path holding it as a unit."""
    eager = critic_then_masked(tf.GradientTape, steps=16)
    with CompileCounter() as c:
        got = critic_then_masked(tf.TerraGradientTape, steps=16)
        terra.end_iteration()
    assert got == eager, terra.explain()
    # (falling back where a path held no unit of the call: 9 traces, 4 fallbacks, 2 switches)
    c.assert_counts(traces=6, fallbacks=1, graph_builds=2, path_switches=5)
    switched = [e for e in terra.explain().splitlines()
                if e.startswith("[switch]") and "op after the end of the path" in e]
    assert len(switched) == 3, terra.explain()


def test_a_model_ending_in_softmax_keeps_its_logits_for_the_loss():
    """Keras marks a softmax's output with its logits (`_keras_logits`) and its cross-entropies
    then take the logits. Skipped whole, the model returned an unmarked placeholder, the loss
    clipped and took the log of the probabilities instead, and the compiled steps' updates
    rounded differently from eager's (a new path, too, at its first skip). The unit carries the
    mark (`GradUnit.tags`): its placeholder gets the logits' placeholder."""
    def make():
        keras.utils.set_random_seed(4)
        inp = keras.layers.Input((4,))
        return keras.Model(inp, keras.layers.Dense(3, activation="softmax")(
            keras.layers.Dense(8, activation="relu")(inp)))

    def run(Tape, steps=8):
        model, opt = make(), keras.optimizers.SGD(0.05)
        rng = np.random.default_rng(2)
        losses = []
        for i in range(steps):
            x = rng.normal(size=(8, 4)).astype(np.float32)
            y = rng.integers(0, 3, size=(8,)).astype(np.int32)
            with Tape() as tape:
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x)))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        return losses, [v.numpy().tolist() for v in model.variables]

    old = terra.config(grappler=False)  # (Grappler's rewrites round differently from eager)
    try:
        eager = run(tf.GradientTape)
        with CompileCounter() as c:
            got = run(tf.TerraGradientTape)
    finally:
        terra.config(**old)
    assert got == eager, terra.explain()
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    (path,) = [p for s in terra._SESSION.sites.values() for p in s.paths.values()
               if p.graph is not None]
    tagged = [u for u in path.units.values() if u.tags]
    assert [name for u in tagged for _, name, _ in u.tags] == ["_keras_logits"], path.units
