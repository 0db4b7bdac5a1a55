"""What the path graph fetches: only the values skip mode can read.

A step function (`def step(): with tape: ...; return loss`) keeps nothing past its iteration but
what it returns: the graph fetches the loss Python reads, not the gradients and activations that
only Terra's own references (the tape's frame, a unit's result structure) or the Python of a
coarse unit (`tape.gradient` reading a shape, `apply_gradients` an IndexedSlices' dense shape)
touched while tracing. Fetched, they were left unread and dropped every step. A value a unit's
Python read that the path does not fix (a layer branching on `float(...)`) is fetched: skip
mode checks it before skipping the unit (GradUnit.reads), or the layer's Python reads it when
its ops are matched one by one."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra import _tf_private as tfp  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402

STEPS = 10


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _weights(model, opt):
    return [v.numpy() for v in model.variables] + [np.asarray(v.numpy()) for v in opt.variables]


def _assert_same(got, eager):
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-5, atol=1e-7)
    for x, y in zip(got[1], eager[1]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def _embedding_program(Tape, after_step=lambda i: None):
    """Embedding (IndexedSlices gradient) + dense head, one step function called in a loop
    (`after_step(i)` after step i's loss is read)."""
    keras.utils.set_random_seed(0)
    inp = keras.layers.Input((6,), dtype="int32")
    h = keras.layers.Embedding(20, 8)(inp)
    out = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
    model = keras.Model(inp, out)
    opt = keras.optimizers.Adam(0.01)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(2)
    X = rng.integers(0, 20, size=(STEPS, 4, 6)).astype(np.int32)
    Y = rng.integers(0, 3, size=(STEPS, 4)).astype(np.int32)

    def step(i):
        with Tape() as tape:
            loss = loss_fn(Y[i], model(X[i], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = []
    for i in range(STEPS):
        losses.append(float(step(i)))
        after_step(i)
    return losses, _weights(model, opt)


def test_a_step_function_fetches_only_the_loss_it_returns():
    eager = _embedding_program(tf.GradientTape)
    got = _embedding_program(tf.TerraGradientTape)
    terra.end_iteration()
    _assert_same(got, eager)
    stats, explain = terra.stats(), terra.explain()
    assert stats["graph_builds"] == 1 and stats["fallbacks"] == 0, explain
    (graph,) = SESSION._graphs
    trace = graph.path.trace
    fetched = [trace.records[r.record].op_type for r in graph.fetch_channels]
    # the loss only: no gradient, activation or dense shape of the embedding's IndexedSlices
    assert len(fetched) == 1 and graph.liveouts == (), (fetched, graph.liveouts, explain)
    assert not graph.stale.droppers and not graph.stale, graph.stale.droppers
    # the trace did see reads inside units; they are marked, and not compiled as fetches
    assert any(f.in_unit for f in trace.fetches), trace.fetches


class Gate(keras.layers.Layer):
    """Scales its input; its Python reads a value (`float(...)`) to choose the branch. Counted
    as a built-in layer (one coarse unit) by the test below."""

    def __init__(self):
        super().__init__()
        self.calls = 0   # a plain setting that changes every call: the unit's guard fails

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")

    def call(self, x):
        h = x * self.w
        if float(tf.reduce_max(h)) > 1e6:  # never true here: the same ops every step
            h = h * 0.5
        return h


def _gate_program(Tape, bump):
    keras.utils.set_random_seed(1)
    gate = Gate()
    dense = keras.layers.Dense(1)
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(3)
    X = rng.normal(size=(STEPS, 5, 3)).astype(np.float32)
    Y = rng.normal(size=(STEPS, 5, 1)).astype(np.float32)
    losses = []
    for i in range(STEPS):
        with Tape() as tape:
            # (an op between the fed batch and the layer: a unit whose input is fed is matched
            # op by op until its feeds are seen to repeat)
            loss = tf.reduce_mean((dense(gate(tf.tanh(X[i]))) - Y[i]) ** 2)
        params = gate.trainable_variables + dense.trainable_variables
        grads = tape.gradient(loss, params)
        opt.apply_gradients(zip(grads, params))
        losses.append(float(loss))
        if bump:
            gate.calls += 1
    return losses, [v.numpy() for v in gate.variables + dense.variables]


@pytest.mark.parametrize("bump", [False, True])
def test_a_read_inside_a_unit_is_fetched_once_skip_mode_makes_it(monkeypatch, bump):
    monkeypatch.setattr(tfp, "KERAS_BUILTIN_LAYER_MODULES",
                        tfp.KERAS_BUILTIN_LAYER_MODULES + (__name__,))
    eager = _gate_program(tf.GradientTape, bump)
    got = _gate_program(tf.TerraGradientTape, bump)
    terra.end_iteration()
    _assert_same(got, eager)
    stats, explain = terra.stats(), terra.explain()
    (graph,) = [g for g in SESSION._graphs if g is graph_of_last_path()]
    reads = {f.ref for f in graph.path.trace.fetches if f.in_unit}
    assert reads, graph.path.trace.fetches  # the layer's read, made inside its unit
    # Its value changes every step: without bump skip mode sees that before the unit (the
    # branch might differ) and matches the layer op by op, as it does with bump (the guard
    # fails every step). Either way the value is fetched from the first graph on: no fallback.
    assert stats["fallbacks"] == 0 and stats["graph_builds"] == 1, explain
    assert reads <= set(graph.fetch_channels), explain
    assert stats["phase"] in ("coexecution", "idle"), explain


def graph_of_last_path():
    (site,) = SESSION.sites.values()
    return site.last_path.graph


def test_finished_iterations_are_freed_without_the_cyclic_collector():
    """A finished iteration is freed by reference counting once its run is collected (the
    frame it held kept the step's locals, placeholders among them, and through them the
    iteration itself: a cycle only CPython's rare full collections broke, holding each step's
    outputs and variable snapshot meanwhile)."""
    import gc

    from terra.runtime.iteration import Iteration

    def alive():
        return sum(1 for o in gc.get_objects() if isinstance(o, Iteration))

    counts = []

    def count(i):
        if i == 4:
            gc.collect()
            gc.disable()
        if i >= 4:
            counts.append(alive())

    eager = _embedding_program(tf.GradientTape)
    enabled = gc.isenabled()
    try:
        got = _embedding_program(tf.TerraGradientTape, after_step=count)
    finally:
        if enabled:
            gc.enable()
    terra.end_iteration()
    _assert_same(got, eager)
    assert terra.stats()["fallbacks"] == 0, terra.explain()
    # no growth: besides iterations other tests left, the open one and at most one finished
    # one whose run is in flight
    assert max(counts) - counts[0] <= 1, (counts, terra.explain())



def _selected(Tape, steps=STEPS):
    """A count the data sets, read by Python as a shape (`sel.shape[0]`, `len(keep)`) outside
    any unit, for a branch that never turns."""
    keras.utils.set_random_seed(0)
    w = tf.Variable(tf.random.normal((4, 5)) * 0.3)
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        f = tf.constant(rng.normal(size=(20, 4)).astype(np.float32))
        with Tape() as tape:
            p = f @ w
            sel = tf.boolean_mask(p[:, 4], p[:, 4] > 0)
            xy = tf.sigmoid(p[:, :2])
            boxes = tf.concat([xy, xy + tf.sigmoid(p[:, 2:4]) * 0.3], 1)
            keep = tf.image.non_max_suppression(tf.stop_gradient(boxes), p[:, 4], 8, 0.5)
            loss = tf.reduce_mean(sel ** 2) + tf.reduce_mean(tf.gather(boxes, keep) ** 2)
            if sel.shape[0] > 20 or len(keep) > 8:  # (never)
                loss = loss * 2.0
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        losses.append(float(loss))
    return losses, [w.numpy()]


def test_a_shape_python_read_that_the_graph_leaves_open_is_fetched_from_the_first_build():
    """The trace notes which shapes Python read (`Trace.shape_reads`); the first graph fetches
    those the data sets, so skip mode's reads wait for the value instead of each costing a
    fallback and a rebuild to learn it."""
    from tests.counting import CompileCounter
    eager = _selected(tf.GradientTape)
    with CompileCounter() as c:
        got = _selected(tf.TerraGradientTape)
    assert got[0] == eager[0]
    np.testing.assert_array_equal(got[1][0], eager[1][0])
    c.assert_counts(traces=2, fallbacks=0, graph_builds=1)
    path = next(p for s in SESSION.sites.values() for p in s.paths.values() if p.graph)
    read = {r for r in path.shape_reads if r in path.graph.unknown_shapes}
    assert len(read) >= 2 and read <= set(path.graph.fetch_channels)  # (boolean_mask's own
    # Python reads shapes of its `Where` too)
