"""Variables made anew inside the loop (a `keras.metrics.Mean` every epoch, a fresh model per
task): a path over new variable objects of the same dtypes and shapes runs the graph already
built for the old ones, with the new handles (`PathGraph.bind`): no lowering, no tracing of a
concrete function. Each program runs eagerly and under Terra and must be bit-identical."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.ir.records import OpRecord, TensorSpec, Trace, VariableRef  # noqa: E402
from terra.runtime.sites import variable_renaming  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _epochs(Tape, epochs=5, steps=8):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.05)
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(epochs * steps, 16, 4)).astype("float32")
    ys = rng.integers(0, 3, (epochs * steps, 16))
    out = []
    for epoch in range(epochs):
        avg = keras.metrics.Mean()
        acc = keras.metrics.SparseCategoricalAccuracy()
        for b in range(steps):
            x, y = tf.constant(xs[epoch * steps + b]), tf.constant(ys[epoch * steps + b])
            with Tape() as tape:
                loss = lossf(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            avg.update_state(loss)
            acc.update_state(y, model(x, training=True))
        out.append((float(avg.result()), float(acc.result())))
    return out, [v.numpy() for v in model.weights]


def test_metrics_made_every_epoch_reuse_the_graph_and_equal_eager():
    eager_out, eager_w = _epochs(tf.GradientTape)
    with CompileCounter() as c:
        terra_out, terra_w = _epochs(tf.TerraGradientTape)
    assert terra_out == eager_out
    for a, b in zip(eager_w, terra_w):
        np.testing.assert_array_equal(b, a)
    # epoch 1: two traces, one build; epoch 2's first step reaches the metric update on the
    # graph and falls back (new variables), its path is built (its fetches differ from epoch
    # 1's); every later epoch: one fallback, and its path runs epoch 2's graph. No restart on
    # an older epoch's path (their variables are not the program's).
    c.assert_counts(traces=7, graph_builds=2, graph_reuses=3, fallbacks=4, path_switches=0)
    assert "runs the graph of p2 over its own variables" in terra.explain()


def test_a_new_model_per_task_runs_the_first_tasks_graph():
    """A new model (and optimizer) per task, as in meta-learning: each task's path runs the
    graph built for the first task, over the new task's weights and slots."""
    def program(Tape):
        rng = np.random.default_rng(1)
        out = []
        for task in range(4):
            keras.utils.set_random_seed(task)
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(5, activation="tanh"),
                                      keras.layers.Dense(1)])
            opt = keras.optimizers.Adam(0.01)
            x = tf.constant(rng.normal(size=(8, 3)).astype("float32"))
            y = tf.constant(rng.normal(size=(8, 1)).astype("float32"))
            for _ in range(6):
                with Tape() as tape:
                    loss = tf.reduce_mean((model(x) - y) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                out.append(float(loss))
            out.extend(float(np.sum(v.numpy())) for v in model.weights)
        return out
    eager = program(tf.GradientTape)
    with CompileCounter() as c:
        got = program(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    # per task: its first step makes the Adam slots (not compilable) and its second falls back
    # at its first op (new weights); from then on its path runs task 0's graph
    c.assert_counts(traces=9, graph_builds=1, graph_reuses=3, fallbacks=6, path_switches=0)


def _trace(var_keys, variables, shape=(2,)):
    recs = [OpRecord(i, "ReadVariableOp", (("dtype", "float32"),), (VariableRef(k),),
                     (TensorSpec("float32", shape),), None) for i, k in enumerate(var_keys)]
    return Trace("s", recs, variables=variables)


def test_variable_renaming_is_a_bijection_of_same_typed_variables():
    a, b, c = (tf.Variable(tf.zeros(2)) for _ in range(3))
    wide = tf.Variable(tf.zeros(3))
    va = {id(a.handle): a, id(b.handle): b, id(c.handle): c, id(wide.handle): wide}
    ka, kb, kc, kw = (id(v.handle) for v in (a, b, c, wide))
    base = _trace([ka, kb, ka], va)
    assert variable_renaming(base, _trace([kc, kb, kc], va)) == {ka: kc}
    assert variable_renaming(base, _trace([ka, kb, ka], va)) is None        # nothing renamed
    assert variable_renaming(base, _trace([kc, kb, kb], va)) is None        # a -> c and a -> b
    assert variable_renaming(base, _trace([kb, kb, kb], va)) is None        # a and b -> b
    assert variable_renaming(base, _trace([kw, kb, kw], va)) is None        # another shape


def _epochs_over_a_dataset(Tape, epochs=4):
    """The TF tutorial's shape: a new Mean every epoch and `for x, y in dataset:` (a new data
    iterator every epoch, which only the host op IteratorGetNext takes)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    ds = tf.data.Dataset.from_tensor_slices((rng.normal(size=(64, 4)).astype("float32"),
                                             rng.integers(0, 3, 64))).batch(8)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.05)
    lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = []
    for _ in range(epochs):
        avg = keras.metrics.Mean()
        for x, y in ds:
            with Tape() as tape:
                loss = lossf(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            avg.update_state(loss)
        out.append(float(avg.result()))
    return out, [v.numpy() for v in model.weights]


def test_a_new_data_iterator_and_metric_every_epoch_reuse_the_graph():
    eager_out, eager_w = _epochs_over_a_dataset(tf.GradientTape)
    with CompileCounter() as c:
        terra_out, terra_w = _epochs_over_a_dataset(tf.TerraGradientTape)
    assert terra_out == eager_out
    for a, b in zip(eager_w, terra_w):
        np.testing.assert_array_equal(b, a)
    # epoch 1: a path built; epoch 2: a path of new fetches built; epochs 3 and 4 run epoch 2's
    # graph (their iterators differ too, but no graph op takes an iterator)
    c.assert_counts(traces=6, graph_builds=2, graph_reuses=2, fallbacks=3, path_switches=0)


def test_epochs_of_new_metrics_do_not_exhaust_max_fallbacks():
    """Each epoch's first step falls back (new variables) and its path runs the graph of an
    earlier one: a bounded cost per epoch, not held against max_fallbacks (KNOWN_REUSE_GAP), so
    the site stays compiled however many epochs run."""
    old = terra.config(max_fallbacks=2)
    try:
        eager = _epochs(tf.GradientTape, epochs=7, steps=6)
        with CompileCounter() as c:
            got = _epochs(tf.TerraGradientTape, epochs=7, steps=6)
    finally:
        terra.config(**old)
    assert got[0] == eager[0]
    for a, b in zip(eager[1], got[1]):
        np.testing.assert_array_equal(b, a)
    assert "site stays eager" not in terra.explain(), terra.explain()
    c.assert_counts(traces=9, graph_builds=2, graph_reuses=5, fallbacks=6, path_switches=0)
