"""Ops whose output shape depends on data (`tf.where`, `tf.boolean_mask`, `tf.unique`,
non-max suppression) compile: their outputs have unknown dimensions in the graph, Python waits
for the value only where it reads a shape, and a coarse unit (`tape.gradient`, whose gradient
functions build ops from the forward values' shapes) is skipped only while those shapes are the
traced ones; another shape takes the path traced with it, or falls back. Each program runs
eagerly and under Terra and must give the same values, shapes and variables."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True, params=[False, True], ids=["path-graph", "site-graph"])
def site_graph(request):
    terra.reset()
    old = terra.config(timeout_s=30.0, site_graph=request.param, grappler=True)
    yield request.param
    terra.reset()
    terra.config(**old)


def _both(program):
    eager = program(tf.GradientTape)
    with CompileCounter() as c:
        got = program(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    assert "data-dependent" not in terra.explain()
    return c


def test_where_output_feeds_later_ops_without_a_shape_read():
    """No Python read, no gradient through it: one path serves every count."""
    def program(Tape):
        v = tf.Variable([0.5, -1.0, 2.0, -3.0, 4.0])
        out = []
        for i in range(8):
            with Tape():
                idx = tf.where(v > float(i % 3) - 1.0)
                total = tf.reduce_sum(tf.gather_nd(v, idx))
            v.assign_add(tf.fill([5], 0.25) * tf.sign(v))
            out.append(float(total))
        return out, v.numpy().tolist()
    _both(program).assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_boolean_mask_shape_read_by_python_and_by_the_gradient():
    """`picked.shape` is a sync point; the gradient of `reduce_sum(picked ** 2)` tiles by the
    traced size, so each size is a path of its own (here the threshold, which sets the size,
    is a constant each path keeps). Each path's graph fetches `picked` from its first build:
    its trace noted that Python read its shape (`Trace.shape_reads`). Its gradient waits for
    Python's shape check, which the site graph cannot do: the site keeps its path graphs.
    Without the site graph the two sizes' paths differ only in that size and the constants made
    from it: they share one graph (a shape group), so the second size costs a trace and no
    build of its own."""
    def program(Tape):
        v = tf.Variable([1.0, -2.0, 3.0, -4.0])
        sizes = []
        for i in range(10):
            with Tape() as tape:
                picked = tf.boolean_mask(v, v > float(i % 2) * 2.0 - 3.0)
                sizes.append(int(picked.shape[0]))
                loss = tf.reduce_sum(picked ** 2)
            v.assign_sub(0.01 * tape.gradient(loss, v))
        return sizes, v.numpy().tolist()
    # (with the site graph too: one group is one graph, which needs no site graph)
    _both(program).assert_counts(traces=2, graph_builds=1, fallbacks=0)
    assert "shape group g0" in terra.explain()


def test_unique_and_nms_in_the_forward_with_a_gradient_through_the_kept_boxes():
    """The kept boxes' count is read after the step (one fallback learns the fetch, one the
    value kept past the iteration); the gradient's shape checks need no fallback of their
    own (the graph fetches what they read from its first build)."""
    def program(Tape):
        v = tf.Variable(tf.random.stateless_normal([20, 4], [1, 2]))
        out = []
        for _ in range(8):
            with Tape() as tape:
                boxes = tf.concat([v[:, :2], v[:, :2] + tf.abs(v[:, 2:])], 1)
                scores = tf.reduce_sum(v, 1)
                keep = tf.image.non_max_suppression(boxes, scores, 10, 0.3)
                sel = tf.gather(boxes, keep)
                u, _ = tf.unique(tf.cast(tf.where(scores > 0.0)[:, 0] % 3, tf.int32))
                loss = tf.reduce_sum(sel ** 2) + tf.cast(tf.size(u), tf.float32)
            v.assign_sub(0.01 * tape.gradient(loss, v))
            out.append((float(loss), int(keep.shape[0])))
        return out, v.numpy().tolist()
    # (the kept boxes' count, read by Python while traced, is fetched from the first build:
    # learning it cost one more trace, build and fallback)
    _both(program).assert_counts(traces=3, graph_builds=2, fallbacks=1)


def test_unique_labels_for_a_python_metric():
    """A count of distinct labels read by Python each step (`len(classes)`: one fallback
    learns the fetch); the gradient does not depend on it, so its size is never checked."""
    def program(Tape):
        w = tf.Variable([[0.5], [-0.5]])
        rng = np.random.default_rng(3)
        out = []
        for _ in range(9):
            x = tf.constant(rng.standard_normal((6, 2)), tf.float32)
            y = tf.constant(rng.integers(0, 3, 6), tf.int32)
            with Tape() as tape:
                classes, _ = tf.unique(y)
                loss = tf.reduce_mean((x @ w) ** 2)
            w.assign_sub(0.1 * tape.gradient(loss, w))
            out.append((len(classes), float(loss)))
        return out, w.numpy().tolist()
    _both(program).assert_counts(traces=3, graph_builds=2, fallbacks=1)


def test_mask_size_set_by_the_data_alternates_between_two_traced_paths():
    """The same ops every step; only the data sets how many values the mask keeps, so the
    gradient's recorded ops differ by size: a path per size. The gradient's ops wait until
    Python has checked the size at `tape.gradient` (a gate in the graph), so the other size
    switches paths there instead of running, and failing, with the wrong shape; once the two
    sizes form a shape group, its graph computes the gradient's constants (the tile multiples)
    from the size it holds, and either size runs on whichever member was predicted. (Without
    Grappler: its constant folding pushes the constant `x` into the gradient's products, an
    ulp away from eager's order: `config.grappler` says "to about an ulp".)"""
    terra.config(grappler=False)

    def program(Tape):
        v = tf.Variable([1.0, -2.0, 3.0, -4.0])
        rows = [[1.0, -2.0, 3.0, -4.0], [1.0, 2.0, 3.0, -4.0]]
        out = []
        for i in range(12):
            x = tf.constant(rows[(i // 3) % 2])
            with Tape() as tape:
                picked = tf.boolean_mask(v * x, x > 0.0)
                loss = tf.reduce_sum(picked ** 2)
            v.assign_sub(0.01 * tape.gradient(loss, v))
            out.append(float(loss))
        return out, v.numpy().tolist()
    _both(program).assert_counts(traces=3, graph_builds=2, fallbacks=1, path_switches=0)
    (g,) = [g for s in SESSION.sites.values() for g in s.shape_groups]
    assert set(g.derived) == set(g.relaxed.const_sites)


def test_a_python_read_of_a_data_dependent_length_is_this_iterations():
    """`int(tf.shape(idx)[0])` of a `tf.where` whose count the data sets: the value is this
    iteration's count, never the count of the iteration the path was traced with (a shape the
    path's record fixes only where it does not depend on data). The gradient is an
    `IndexedSlices` whose dense shape TF's gradient code makes from the variable's static shape:
    the unit returns that constant, so `tape.gradient` is skipped whole."""
    def program(Tape):
        v = tf.Variable(tf.ones((6,)))
        rng = np.random.default_rng(0)
        data = [tf.constant(rng.normal(size=(6,)), tf.float32) for _ in range(3)]
        out = []
        for i in range(12):
            y = data[i % 3]
            with Tape() as tape:
                idx = tf.where(y > 0.0)[:, 0]
                n = int(tf.shape(idx)[0])
                loss = tf.reduce_sum(tf.gather(v, idx) * tf.gather(y, idx))
            grad = tape.gradient(loss, v)
            v.assign_sub(0.1 * tf.convert_to_tensor(grad))
            out.append((n, float(loss), type(grad).__name__))
        return out, v.numpy().tolist()
    # counts 4 and 3 form a shape group, whose graph fetches the count from its first build;
    # count 0 (a special case of TF's Python) is traced and joins it with no build; from then
    # on every step runs the group's graph (with the site graph too: one group needs none)
    _both(program).assert_counts(traces=3, graph_builds=1, fallbacks=1)


def _selected_rows(Tape, counts, steps):
    """A Keras MLP trained on the rows a `tf.where` keeps; the data set how many (`counts`,
    in turn)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(0)
    data = []
    for n in counts:
        y = np.concatenate([rng.uniform(0.1, 1.0, n), -rng.uniform(0.1, 1.0, 12 - n)])
        data.append((tf.constant(rng.normal(size=(12, 4)), tf.float32),
                     tf.constant(rng.permutation(y), tf.float32)))
    out = []
    for i in range(steps):
        x, y = data[i % len(data)]
        with Tape() as tape:
            idx = tf.where(y > 0.0)[:, 0]
            xs, ys = tf.gather(x, idx), tf.gather(y, idx)
            loss = tf.reduce_mean((model(xs)[:, 0] - ys) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        out.append(float(loss))
    terra.end_iteration()
    return out, [v.numpy().tolist() for v in model.variables]


def test_every_count_runs_on_one_graph_that_computes_the_gradients_constants():
    """Six counts, 30 steps. The gradient's constants (a mean's count, the tile multiples, a
    slice's gradient shape) differ with the count: once two counts form a shape group, its
    graph computes them from the count it holds, and every later count runs on it, with no
    trace of its own. A count of 1 is a member of its own (TF may build other ops for size-1
    dimensions)."""
    counts = [5, 3, 8, 1, 6, 2]
    eager = _selected_rows(tf.GradientTape, counts, 30)
    with CompileCounter() as c:
        got = _selected_rows(tf.TerraGradientTape, counts, 30)
    assert got == eager, terra.explain()
    # counts 5 and 3 form the group, whose graph fetches the gathered lengths Python read
    # while traced (`Trace.shape_reads`); 8 runs on it; 1 is traced and joins the group as a
    # member of its own (a rebuild); 6 and 2 run on the graph, and so does every count from
    # then on (learning the two reads cost two more traces, fallbacks and builds); with the
    # site graph too (one group needs none)
    c.assert_counts(traces=3, graph_builds=2, fallbacks=1, graph_reuses=0)
    (g,) = [g for s in SESSION.sites.values() for g in s.shape_groups]
    assert set(g.derived) == set(g.relaxed.const_sites) and len(g.derived) == 3
    assert "computed from shapes" in terra.explain()


def _sparse_rows(Tape, counts, halve_at=None):
    """An optimizer's sparse update of the rows a `tf.where` keeps (an `IndexedSlices`
    gradient, whose update filters rows by a length set by the data); at step `halve_at` the
    program halves the gradient before the update (a new branch after `tape.gradient`)."""
    v = tf.Variable(tf.ones((8,)))
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    data = []
    for n in counts:
        y = np.concatenate([rng.uniform(0.1, 1.0, n), -rng.uniform(0.1, 1.0, 8 - n)])
        data.append(tf.constant(np.stack([rng.permutation(y), rng.normal(size=8)], 1),
                                tf.float32))
    out = []
    for i, y in enumerate(data):
        with Tape() as tape:
            idx = tf.where(y[:, 0] > 0.0)[:, 0]
            loss = tf.reduce_sum(tf.gather(v, idx) * tf.gather(y[:, 1], idx))
        grad = tape.gradient(loss, v)
        if i == halve_at:
            grad = tf.IndexedSlices(grad.values * 0.5, grad.indices, grad.dense_shape)
        opt.apply_gradients([(grad, v)])
        out.append(float(loss))
    terra.end_iteration()
    return out, v.numpy().tolist()


def test_a_sparse_optimizer_update_of_a_data_set_length_runs_its_ops_one_by_one():
    """The update's unit is dropped (its row filter has a length set by the data): its ops
    are matched one by one, in every step; before, every step fell back there."""
    counts = [3, 2, 4] * 4
    eager = _sparse_rows(tf.GradientTape, counts)
    with CompileCounter() as c:
        got = _sparse_rows(tf.TerraGradientTape, counts)
    assert got == eager, terra.explain()
    if terra.config()["site_graph"]:
        return  # (a path per count there; counted by the tests above)
    # counts 3 and 2 form the group, and every later count runs on it (its graph fetches the
    # count Python read while traced; learning that read cost a trace, a build and a fallback)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_a_fallback_after_the_gradient_on_a_count_no_member_has():
    """Count 5 first comes with a new branch after `tape.gradient`: the gradient's results
    claim the graph's shapes (a length set by the data, through the tile multiples the graph
    computes from it), not a member's, and the fallback replays the gradient's ops on this
    step's count with their shape constants computed from the shapes replayed (before, both
    took a member's: a shape error eager does not raise)."""
    counts = [3, 2, 4, 3, 2, 4, 5, 3]
    eager = _sparse_rows(tf.GradientTape, counts, halve_at=6)
    with CompileCounter() as c:
        got = _sparse_rows(tf.TerraGradientTape, counts, halve_at=6)
    assert got == eager, terra.explain()
    if terra.config()["site_graph"]:
        return
    # the halving branch is a new path (traced at its fallback and built); the count Python
    # reads is fetched from the group's first build
    c.assert_counts(traces=3, graph_builds=2, fallbacks=1)
