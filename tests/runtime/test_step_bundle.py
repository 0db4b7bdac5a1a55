"""`bundle_feeds` (the default): a compiled path whose feeds Python supplies before it reads any
value of the run takes them as one element of one channel, put once Python has supplied the
last (terra/compiler/path_lowering.py, `step_bundle`; terra/runtime/path_graph.py,
`_takes_step_bundle`); the commit token keeps its own channel.

Equality with eager, bit for bit (`grappler=False`), with and without bundles, and the exact
number of elements Python puts per compiled step: 2 (the bundle, the commit) with two feeds,
with or without the loss read after them, 3 (two feeds and the commit) with
`bundle_feeds=False`. Also a divergence before the bundle is complete (a Python-random branch),
an exception in the tape, a value read before the last feed is supplied (no bundle), and a
value kept past the iteration read before the iteration ends."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import random  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

STEPS = 8


@pytest.fixture(autouse=True)
def _fresh():
    old = terra.config(grappler=False, bundle_feeds=True, site_graph="auto")
    terra.reset()
    yield
    terra.reset()
    terra.config(**old)


def _model(seed=3):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(0.01)
    opt.build(model.trainable_variables)
    return model, opt


def _data(steps=STEPS):
    rng = np.random.default_rng(7)
    return (rng.normal(size=(steps, 5, 6)).astype(np.float32),
            rng.integers(0, 3, size=(steps, 5)).astype(np.int32))


def train(Tape, read_each_step=False, steps=STEPS):
    """A classifier's step, the loss kept (and read after the loop) or read every step."""
    model, opt = _model()
    X, Y = _data(steps)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    kept, read = [], []
    for i in range(steps):
        with Tape() as tape:
            loss = loss_fn(Y[i], model(X[i], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if read_each_step:
            read.append(float(loss))
        else:
            kept.append(loss)
    terra.end_iteration()
    return [float(v) for v in kept] or read, [v.numpy() for v in model.variables]


def _bit_equal(got, eager):
    assert got[0] == eager[0], (got[0], eager[0])
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)


def _graph():
    (site,) = SESSION.sites.values()
    (graph,) = {id(p.graph): p.graph for p in site.paths.values() if p.graph is not None}.values()
    return graph


def _puts(graph) -> int:
    channels = {id(c): c for c in [*graph.feed_channels, graph.commit_channel] if c is not None}
    return sum(c.puts for c in channels.values())


@pytest.mark.parametrize("read_each_step", [False, True])
def test_a_compiled_step_puts_its_feeds_at_once(read_each_step):
    eager = train(tf.GradientTape, read_each_step)
    with CompileCounter() as c:
        got = train(tf.TerraGradientTape, read_each_step)
    _bit_equal(got, eager)
    # (the optimizer's state is built before the loop: the path is compiled at its second trace)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, path_switches=0)
    g = _graph()
    assert g.step_bundle is not None and g.bundled == (0, 1)
    assert g.commit_channel is not None and g.commit_channel is not g.step_bundle
    assert all(ch is g.step_bundle for ch in g.feed_channels)
    compiled = STEPS - 2
    assert g.step_bundle.puts == compiled and _puts(g) == 2 * compiled


def test_without_bundles_each_feed_and_the_commit_is_a_put():
    eager = train(tf.GradientTape)
    terra.config(bundle_feeds=False)
    with CompileCounter() as c:
        got = train(tf.TerraGradientTape)
    _bit_equal(got, eager)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0)
    g = _graph()
    assert g.step_bundle is None and len(set(map(id, g.feed_channels))) == 2
    assert _puts(g) == 3 * (STEPS - 2)


def branchy(Tape, steps=14):
    """A head chosen by Python's `random` after the trunk, its target a second feed: a change
    of head restarts the iteration on the other head's path (or falls back) with the feeds
    Python supplied so far, the bundle not complete yet. (A step function: its locals end with
    it, so no value is kept past the iteration before the last feed.)"""
    keras.utils.set_random_seed(4)
    trunk = keras.layers.Dense(6, activation="relu")
    heads = [keras.layers.Dense(1), keras.layers.Dense(1, activation="tanh")]
    inp = keras.Input((6,))
    for h in heads:
        h(trunk(inp))
    variables = trunk.trainable_variables + [v for h in heads for v in h.trainable_variables]
    opt = keras.optimizers.SGD(0.1)
    opt.build(variables)
    X, _ = _data(steps)
    T = np.random.default_rng(8).normal(size=(steps, 5, 1)).astype(np.float32)
    rnd = random.Random(2)

    def step(x, t):
        with Tape() as tape:
            z = trunk(x)
            loss = tf.reduce_mean((heads[rnd.randrange(2)](z) - t) ** 2)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        return loss

    losses = [step(X[i], T[i]) for i in range(steps)]
    terra.end_iteration()
    return [float(v) for v in losses], [v.numpy() for v in variables]


def test_a_divergence_before_the_bundle_is_put_leaves_the_variables_as_eager():
    eager = branchy(tf.GradientTape)
    terra.config(site_graph=False)
    with CompileCounter() as c:
        got = branchy(tf.TerraGradientTape)
    _bit_equal(got, eager)
    # a path per head, each compiled; 6 changes of head between compiled iterations restart
    c.assert_counts(traces=3, graph_builds=2, fallbacks=1, path_switches=6, case_switches=0)
    (site,) = SESSION.sites.values()
    graphs = [p.graph for p in site.paths.values() if p.graph is not None]
    assert graphs and all(g.step_bundle is not None for g in graphs)


def raising(Tape, fail_at=6, steps=9):
    """An exception raised in the tape after the forward pass, caught by the user."""
    model, opt = _model()
    X, Y = _data(steps)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses, caught = [], []
    for i in range(steps):
        try:
            with Tape() as tape:
                loss = loss_fn(Y[i], model(X[i], training=True))
                if i == fail_at:
                    raise ValueError("skip this batch")
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(loss)
        except ValueError as e:
            caught.append((i, str(e)))
    terra.end_iteration()
    return [float(v) for v in losses], [v.numpy() for v in model.variables], caught


def test_an_exception_in_the_tape_leaves_the_variables_as_eager():
    eager = raising(tf.GradientTape)
    got = raising(tf.TerraGradientTape)
    _bit_equal(got[:2], eager[:2])
    assert got[2] == eager[2] == [(6, "skip this batch")]


def early_read(Tape, steps=STEPS):
    """The logits are read before the labels are fed: no bundle (Python reads the run before it
    has supplied every feed)."""
    model, opt = _model()
    X, Y = _data(steps)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    seen, losses = [], []
    for i in range(steps):
        with Tape() as tape:
            logits = model(X[i], training=True)
            seen.append(float(tf.reduce_max(logits)))
            loss = loss_fn(Y[i], logits)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(loss)
    terra.end_iteration()
    return [float(v) for v in losses] + seen, [v.numpy() for v in model.variables]


def test_a_read_before_the_last_feed_keeps_a_channel_per_feed():
    eager = early_read(tf.GradientTape)
    with CompileCounter() as c:
        got = early_read(tf.TerraGradientTape)
    _bit_equal(got, eager)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0)
    g = _graph()
    assert g.step_bundle is None and g.commit_channel is not None


def test_a_kept_value_read_before_the_iteration_ends():
    """The last step's loss, kept in a list (a live-out, made after the last feed), read while
    its iteration is still open: its channel answers, the bundle having been put."""
    def program(Tape):
        model, opt = _model()
        X, Y = _data()
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def step(x, y):
            with Tape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        kept = [step(X[i], Y[i]) for i in range(STEPS)]
        last = float(kept[-1])  # (the iteration ends at the next tape, or end_iteration)
        terra.end_iteration()
        return [float(v) for v in kept] + [last], [v.numpy() for v in model.variables]

    eager = program(tf.GradientTape)
    with CompileCounter() as c:
        got = program(tf.TerraGradientTape)
    _bit_equal(got, eager)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0)
    assert _graph().step_bundle is not None
