"""A user-defined layer or model is one coarse unit where its Python only computed while traced
(runtime/layer_guards.py, tracing/purity.py); where it did anything else, or its guard fails,
its Python runs, and the results equal eager's either way."""
import os
import random

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

LOG = []
FACTOR = 2.0


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(timeout_s=30.0)
    LOG.clear()
    yield
    terra.reset()
    terra.config(**old)


class Block(keras.layers.Layer):
    """Pure: sublayers, arithmetic, plain and container settings, a tensor attribute."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.d1 = keras.layers.Dense(8, activation="relu")
        self.d2 = keras.layers.Dense(4)
        self.factor = 1.0
        self.cfg = {"shift": 0.0}
        self.offset = tf.constant(0.0)

    def call(self, x):
        h = self.d2(self.d1(x)) * self.factor + self.cfg["shift"]
        return x + h + self.offset


class Impure(keras.layers.Layer):
    """Does one of the things a skipped call would lose."""

    def __init__(self, kind, **kw):
        super().__init__(**kw)
        self.kind = kind
        self.calls = 0
        self.d = keras.layers.Dense(4)

    def call(self, x):
        if self.kind == "random":
            return self.d(x) if random.random() < 0.5 else x * 0.5
        if self.kind == "counter":
            self.calls += 1
        elif self.kind == "log":
            LOG.append(1)
        elif self.kind == "print":
            print("call")
        elif self.kind == "global":
            return self.d(x) * FACTOR
        return self.d(x)


def model_with(layer, seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.layers.Input((4,))
    return keras.Model(inp, keras.layers.Dense(1)(layer(keras.layers.Dense(4)(inp))))


def train(make, Tape, steps=8, change=None):
    random.seed(3)
    model, opt = make(), keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    ys = rng.normal(size=(steps, 8, 1)).astype(np.float32)
    losses = []
    for i in range(steps):
        if change is not None:
            change(model, i)
        with Tape() as tape:
            loss = tf.reduce_mean((model(tf.constant(xs[i]), training=True) - ys[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy().tolist() for v in model.variables], model


def both(make, **kw):
    el, ev, em = train(make, tf.GradientTape, **kw)
    with CompileCounter() as c:
        gl, gv, gm = train(make, tf.TerraGradientTape, **kw)
    assert (gl, gv) == (el, ev), terra.explain()
    return c, em, gm


def matched_ops(monkeypatch, iteration=5):
    """The op types skip mode matches one by one (outside units) in `iteration`."""
    from terra.runtime.python_runner import PythonRunner
    matched = []
    original = PythonRunner._skip

    def counting(self, *args, **kwargs):
        if self.iteration.number == iteration:
            matched.append(args[0])
        return original(self, *args, **kwargs)
    monkeypatch.setattr(PythonRunner, "_skip", counting)
    return matched


def find(model, cls):
    (layer,) = [x for x in model._flatten_layers() if isinstance(x, cls)]
    return layer


def test_a_model_with_a_pure_user_layer_is_one_unit(monkeypatch):
    matched = matched_ops(monkeypatch)
    c, _, _ = both(lambda: model_with(Block()))
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # compiled: the model, tape.gradient and apply_gradients are skipped whole; only the
    # loss's ops (Sub and Pow, each once: eager's slow route, taken because a number met the
    # tape, is not retaken; Mean) are matched one by one
    assert matched == ["Sub", "Pow", "Mean"], matched


def test_without_the_setting_the_user_layer_runs_its_python(monkeypatch):
    old = terra.config(user_layer_units=False)
    matched = matched_ops(monkeypatch)
    try:
        c, _, _ = both(lambda: model_with(Block()))
    finally:
        terra.config(**old)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # Block's own Mul, two Adds and the AddV2 of its offset, between its Dense units
    assert "Mul" in matched and len(matched) > 4, matched


@pytest.mark.parametrize("change", ["plain", "container", "tensor"])
def test_a_changed_setting_of_a_pure_layer_fails_its_guard(change):
    def edit(model, i):
        if i != 5:
            return
        block = find(model, Block)
        if change == "plain":
            block.factor = 3.0
        elif change == "container":
            block.cfg["shift"] = 0.25  # in place: no attribute is set
        else:
            block.offset = tf.constant(0.5)
    c, _, _ = both(lambda: model_with(Block()), steps=9, change=edit)
    # the guard fails at step 6 and its Python runs: a new factor or shift is a new constant
    # of its ops (one fallback, then a feed); a new offset tensor is fed as it is
    if change == "tensor":
        c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    else:
        c.assert_counts(traces=4, graph_builds=2, fallbacks=1)


@pytest.mark.parametrize("kind", ["random", "counter", "log", "print", "global"])
def test_an_impure_layer_is_not_a_unit_and_keeps_its_effects(kind, capsys, monkeypatch):
    matched = matched_ops(monkeypatch)
    effects = []

    def run(Tape):
        LOG.clear()
        capsys.readouterr()
        losses, variables, model = train(lambda: model_with(Impure(kind)), Tape)
        effects.append((find(model, Impure).calls, len(LOG),
                        capsys.readouterr().out.count("call")))
        return losses, variables
    eager = run(tf.GradientTape)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    assert effects[0] == effects[1], effects  # 8 steps, and the model's symbolic calls
    assert effects[0][["counter", "log", "print"].index(kind)] >= 8 if kind in (
        "counter", "log", "print") else True
    if kind != "random":
        c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
        # its Python ran (the effects above), and with it its own ops, matched one by one (the
        # Mul by a Python float once, on its fast route)
        assert matched == (["Mul"] if kind == "global" else []) + \
            ["Sub", "Pow", "Mean"], matched


def test_a_global_the_layer_reads_changes_between_steps():
    global FACTOR

    def edit(model, i):
        global FACTOR
        FACTOR = 2.0 if i < 5 else 4.0
    try:
        c, _, _ = both(lambda: model_with(Impure("global")), change=edit)
    finally:
        FACTOR = 2.0
    assert c.traces >= 3


def test_a_layer_that_adds_a_loss_is_not_a_unit():
    """Keras' `add_loss` is trusted code, but a skipped call would leave `model.losses`
    without the loss the program adds to its own."""
    class Penalized(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(4)

        def call(self, x):
            y = self.d(x)
            self.add_loss(0.01 * tf.reduce_sum(y ** 2))
            return y

    def run(Tape, steps=6):
        keras.utils.set_random_seed(0)
        inp = keras.layers.Input((4,))
        model = keras.Model(inp, keras.layers.Dense(1)(Penalized()(inp)))
        opt = keras.optimizers.SGD(0.05)
        x = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
        losses = []
        for _ in range(steps):
            with Tape() as tape:
                loss = tf.reduce_mean(model(x, training=True) ** 2) + tf.add_n(model.losses)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        return losses, [v.numpy().tolist() for v in model.variables]
    eager = run(tf.GradientTape)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)


def test_a_layer_reading_an_object_attribute_is_not_a_unit():
    class Settings:
        scale = 1.0

    class Reads(keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.settings = Settings()
            self.d = keras.layers.Dense(4)

        def call(self, x):
            return self.d(x) * self.settings.scale

    def edit(model, i):
        if i == 5:
            find(model, Reads).settings.scale = 3.0
    c, _, _ = both(lambda: model_with(Reads()), change=edit)
    # its Python runs: the new scale is a new constant of its Mul, which falls back once and
    # becomes a feed
    c.assert_counts(traces=4, graph_builds=2, fallbacks=1)


def _count_watches(monkeypatch):
    from terra.tracing import purity
    opened = []
    original = purity.watch.__enter__

    def enter(self):
        opened.append(self)
        return original(self)
    monkeypatch.setattr(purity.watch, "__enter__", enter)
    return opened


def test_a_kept_verdict_is_not_watched_again(monkeypatch):
    opened = _count_watches(monkeypatch)
    matched = matched_ops(monkeypatch)
    c, _, _ = both(lambda: model_with(Block()))
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0, verdicts_kept=2)
    # eager's run watches nothing. Iterations 1 and 2 watch the model and, inside it, Block (the
    # model's first call sets attributes of its own: iteration 2 has other settings); iteration
    # 3 keeps both verdicts (no watch is open when Block is called), and the unit is the same
    assert len(opened) == 4, opened
    assert matched == ["Sub", "Pow", "Mean"], matched


def test_a_kept_verdict_holds_only_for_what_the_call_read():
    from terra.runtime import layer_guards
    from terra.tracing import purity
    keras.utils.set_random_seed(0)
    block = Block()
    x2, x3 = tf.ones((2, 4)), tf.ones((3, 4))
    block(x2)

    def key():
        return (True, layer_guards.user_settings(block))

    def watched_call(x, training):
        settings = key()
        with purity.watch(layer_guards.forced_codes(block)) as w:
            block(x, training=training)
        layer_guards.remember_verdict(block, settings, [x, training], w)
        return w

    w = watched_call(x2, True)
    assert w.reason is None and {"factor", "cfg", "offset"} <= w.attributes
    kept = layer_guards.known_verdict(block, key(), [x2, True])
    assert kept is not None and kept.reason is None and kept.attributes == w.attributes
    assert layer_guards.known_verdict(block, key(), [x3, True]) is None  # another shape
    assert layer_guards.known_verdict(block, key(), [x2, False]) is None  # another argument
    block.cfg["shift"] = 0.25  # in place: the container the call read holds something else
    assert layer_guards.known_verdict(block, key(), [x2, True]) is None
    block.cfg["shift"] = 0.0
    assert layer_guards.known_verdict(block, key(), [x2, True]) is not None
    from terra.tracing import hook
    hook.install()  # Terra counts layer epochs while its hook is installed (inside a tape)
    try:
        block.factor = 3.0  # an attribute set: a new layer epoch drops every kept verdict
        assert layer_guards.known_verdict(block, key(), [x2, True]) is None
    finally:
        hook.uninstall()
    # an impure call's verdict is kept as well
    impure = Impure("counter")
    impure(x2)
    settings = (True, layer_guards.user_settings(impure))
    with purity.watch(layer_guards.forced_codes(impure)) as w:
        impure(x2)
    assert w.reason is not None
    layer_guards.remember_verdict(impure, settings, [x2], w)
    assert layer_guards.known_verdict(impure, settings, [x2]).reason == w.reason
