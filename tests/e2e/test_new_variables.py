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


def _epochs(Tape, epochs=5, steps=8, alternate=False):
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
        if alternate and epoch % 2:  # made in two places in turn: two roles (roles.py)
            avg = keras.metrics.Mean()
            acc = keras.metrics.SparseCategoricalAccuracy()
        else:
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
    # graph and falls back (new variables, made before Terra filed roles), its path runs epoch
    # 1's graph over its own variables; every later epoch starts on epoch 2's graph over its
    # own metrics' variables (made in the same place: roles.py): no fallback, no trace.
    c.assert_counts(traces=4, graph_builds=1, graph_reuses=4, role_renames=3, fallbacks=1,
                    path_switches=0)
    assert "path p3 is p2 over 4 variable(s) made anew in the same place" in terra.explain()


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
    # (new weights); from then on its path runs task 0's graph. On a path renamed onto a
    # task's new variables (roles.py) the units of the old model and optimizer are left out
    # (`sites._names_old_object`: their guards name the old objects), so their ops are matched
    # one by one, and they match the new task's: tasks 2 and 3 predict their second step over
    # their new variables without a fallback. (Task 2's second step was once built anew: the
    # slice gradients' copies of their bounds were reads that a fallback left among its
    # fetches; the gradient now takes the bounds themselves.)
    c.assert_counts(traces=7, graph_builds=1, graph_reuses=6, role_renames=5, fallbacks=4,
                    path_switches=0)


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
    # epoch 1: a path built; epoch 2: its path runs epoch 1's graph over the new metric; epochs
    # 3 and 4 start on epoch 2's graph over their own metric (their iterators differ too, but
    # no graph op takes an iterator): no fallback
    c.assert_counts(traces=4, graph_builds=1, graph_reuses=3, role_renames=2, fallbacks=1,
                    path_switches=0)


def test_epochs_of_new_metrics_do_not_exhaust_max_fallbacks():
    """Each epoch's first step falls back (new variables, made in turn in two places, so that
    no epoch's metrics are predicted from the previous epoch's: roles.py) and its path runs
    the graph of an earlier one: a bounded cost per epoch, not held against max_fallbacks
    (KNOWN_REUSE_GAP), so the site stays compiled however many epochs run."""
    old = terra.config(max_fallbacks=2)
    try:
        eager = _epochs(tf.GradientTape, epochs=7, steps=6, alternate=True)
        with CompileCounter() as c:
            got = _epochs(tf.TerraGradientTape, epochs=7, steps=6, alternate=True)
    finally:
        terra.config(**old)
    assert got[0] == eager[0]
    for a, b in zip(eager[1], got[1]):
        np.testing.assert_array_equal(b, a)
    assert "site stays eager" not in terra.explain(), terra.explain()
    c.assert_counts(traces=9, graph_builds=1, graph_reuses=6, fallbacks=6, path_switches=0)


def _a_first_tape(Tape):
    with Tape():  # a site of its own, in a frame that returns
        tf.constant(0.0)


def _metric_kept_an_epoch_longer(Tape, epochs=6, steps=5):
    """A new Mean every epoch, but each one is used for two epochs: the epoch after one is made
    still updates the previous one (a prediction by role is wrong there)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(4, 1)).astype("float32"))
    opt = keras.optimizers.SGD(0.05)
    _a_first_tape(Tape)  # Terra files roles from here on (roles.py)
    made, out = [], []
    for epoch in range(epochs):
        made.append(keras.metrics.Mean())
        avg = made[epoch - epoch % 2]
        for _ in range(steps):
            x = tf.constant(rng.normal(size=(8, 4)).astype("float32"))
            with Tape() as tape:
                loss = tf.reduce_mean(tf.matmul(x, w) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
            avg.update_state(loss)
        out.append(float(avg.result()))
    return out, [w.numpy()] + [m.result().numpy() for m in made]


def test_a_metric_made_anew_but_not_used_yet_switches_back():
    eager = _metric_kept_an_epoch_longer(tf.GradientTape)
    with CompileCounter() as c:
        got = _metric_kept_an_epoch_longer(tf.TerraGradientTape)
    assert got[0] == eager[0]
    for a, b in zip(eager[1], got[1]):
        np.testing.assert_array_equal(b, a)
    # one trace at the first site; epoch 0 compiles (2 traces, 1 build); each of the 5 later
    # epochs starts on the last path over the newest Mean. On odd epochs that is wrong (the
    # previous Mean is still the one updated): the run diverges at the update and switches back
    # to the path over the previous Mean (a restart, no fallback). On even epochs it is right.
    c.assert_counts(traces=4, graph_builds=1, role_renames=5, fallbacks=0, path_switches=3)


def _layer_kept_an_epoch_longer(Tape, epochs=6, steps=5):
    """A new Dense layer and optimizer every epoch, each pair trained for two epochs: the epoch
    after one is made still trains the previous one."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    _a_first_tape(Tape)
    made, out = [], []
    for epoch in range(epochs):
        dense = keras.layers.Dense(1)
        dense.build((None, 4))
        made.append((dense, keras.optimizers.SGD(0.05)))
        layer, opt = made[epoch - epoch % 2]
        for _ in range(steps):
            x = tf.constant(rng.normal(size=(8, 4)).astype("float32"))
            with Tape() as tape:
                loss = tf.reduce_mean(layer(x) ** 2)
            opt.apply_gradients(zip(tape.gradient(loss, layer.trainable_variables),
                                    layer.trainable_variables))
            out.append(float(loss))
    return out, [v.numpy().tolist() for layer, opt in made for v in
                 (*layer.variables, *opt.variables)]


def test_a_layer_made_anew_but_trained_an_epoch_longer_switches_back():
    """As with the metric above; here the layer's call and the optimizer's update are units
    guarded on their objects, which a renamed path would let the old objects pass (their
    graph ops over the new variables: no gradient for the old ones). The renamed path leaves
    them out (`sites._names_old_object`): matched op by op, the old layer's variables diverge
    at its first read and the run switches back."""
    eager = _layer_kept_an_epoch_longer(tf.GradientTape)
    with CompileCounter() as c:
        got = _layer_kept_an_epoch_longer(tf.TerraGradientTape)
    assert got == eager
    c.assert_counts(traces=4, graph_builds=1, role_renames=5, fallbacks=0, path_switches=3)


def test_roles_match_variables_made_anew_in_the_same_place():
    from terra.runtime.roles import VariableRoles
    roles = VariableRoles()

    def make(n, shape=(2,)):
        vs = []
        for _ in range(n):  # one place for all n: one role
            v = tf.Variable(tf.zeros(shape))
            roles.created_at(v, ("here",))
            vs.append(v)
        return vs

    def keyed(vs):
        return {id(v.handle): v for v in vs}

    old = make(3)
    assert roles.superseding(keyed(old)) == {}           # made together: not made anew
    new = make(3)
    assert roles.superseding(keyed(old)) == {id(o.handle): n for o, n in zip(old, new)}
    assert roles.superseding(keyed(new)) == {}
    assert roles.superseding(keyed(old[:2])) == {id(o.handle): n for o, n in zip(old, new[1:])}
    more = make(2)
    assert roles.superseding(keyed(new)) == {}           # fewer new than old: left as it is
    wide = make(3, shape=(3,))
    assert roles.superseding(keyed(more)) == {}          # another shape: left as it is
    del wide
    unfiled = tf.Variable(tf.zeros((2,)))
    assert roles.superseding(keyed([unfiled])) == {}
