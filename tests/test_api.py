"""Public API: tf.TerraGradientTape, terra.config / stats / explain / reset, tape semantics."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

STATS_KEYS = {"traces", "fallbacks", "graph_builds", "python_exec_s", "python_stall_s",
              "graph_exec_s", "graph_stall_s", "phase"}


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _train(Tape, steps=6, **tape_kwargs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(0.05)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        x = rng.normal(size=(5, 3)).astype(np.float32)
        with Tape(**tape_kwargs) as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    terra.end_iteration()
    return losses, [v.numpy() for v in model.variables]


def test_import_installs_tape():
    assert tf.TerraGradientTape is terra.GradientTape
    assert issubclass(terra.GradientTape, tf.GradientTape)


def test_stats_keys_and_types():
    s = terra.stats()
    assert STATS_KEYS <= set(s)
    assert s["phase"] == "idle" and s["traces"] == 0


def test_config_validation_and_restore():
    with pytest.raises(ValueError, match="unknown setting 'nope'"):
        terra.config(nope=1)
    with pytest.raises(TypeError, match="max_traces must be int"):
        terra.config(max_traces="3")
    with pytest.raises(ValueError, match="max_traces must be >= 1"):
        terra.config(max_traces=0)
    old = terra.config(verbose=2)
    assert old == {"verbose": 0} and terra.config()["verbose"] == 2
    terra.config(**old)
    assert terra.config()["verbose"] == 0


def test_coexecution_equals_eager_and_counts():
    le, ve = _train(tf.GradientTape)
    lt, vt = _train(tf.TerraGradientTape)
    np.testing.assert_allclose(lt, le, rtol=1e-6)
    for a, b in zip(ve, vt):
        np.testing.assert_allclose(b, a, rtol=1e-6)
    s = terra.stats()
    assert s["traces"] == 3 and s["graph_builds"] == 1 and s["fallbacks"] == 0
    assert s["graph_exec_s"] > 0 and s["python_exec_s"] > 0


def test_a_path_graph_times_its_feeds_in_one_variable():
    """graph_stall_s of path graphs: each timed feed's wait goes to its graph's one StallTimer,
    summed once per run, not to a variable and an update per channel."""
    from terra.runtime.session import SESSION
    _train(tf.TerraGradientTape)
    graphs = [p.graph for site in SESSION.sites.values() for p in site.paths.values()
              if p.graph is not None]
    assert len(graphs) == 1
    (g,) = graphs
    timed = [ch for ch in dict.fromkeys(g.feed_channels) if ch is not None and ch.timed]
    assert timed and g.stall is not None
    assert all(ch._stall is None for ch in timed)
    types = [op.type for op in g.concrete.graph.get_operations()]
    assert types.count("Timestamp") == 2 * len(timed)
    assert terra.stats()["graph_stall_s"] == g.stall.seconds


def test_disabled_is_plain_tape():
    terra.config(enabled=False)
    try:
        le, ve = _train(tf.GradientTape)
        lt, vt = _train(tf.TerraGradientTape)
        assert terra.stats()["traces"] == 0
        np.testing.assert_array_equal(lt, le)
    finally:
        terra.config(enabled=True)


def test_lazy_evaluation_mode_equals_eager():
    le, _ = _train(tf.GradientTape)
    terra.config(coexecution=False)
    try:
        lt, _ = _train(tf.TerraGradientTape)
    finally:
        terra.config(coexecution=True)
    np.testing.assert_allclose(lt, le, rtol=1e-6)
    assert terra.stats()["graph_builds"] == 1


def test_explain_names_user_line_of_fallback():
    keras.utils.set_random_seed(0)
    v = tf.Variable([1.0, 2.0])
    with CompileCounter() as c:
        for i in range(6):
            with tf.TerraGradientTape() as tape:
                loss = tf.reduce_sum(v * v) if i != 4 else tf.reduce_sum(v * v * v)  # explain-me
            g = tape.gradient(loss, [v])
            v.assign_sub(0.1 * g[0])
    text = terra.explain()
    assert "[fallback]" in text and "test_api.py" in text, text
    # p0 traced at iteration 1 and built at 2; the extra multiply at iteration 5 (i == 4)
    # falls back once and becomes p1 (built); iteration 6 switches back to p0
    c.assert_counts(traces=3, graph_builds=2, fallbacks=1)


def test_max_traces_goes_eager_with_one_warning():
    terra.config(max_traces=2)
    try:
        v = tf.Variable(1.0)
        with pytest.warns(RuntimeWarning, match="runs eagerly from now on"):
            for i in range(5):
                with tf.TerraGradientTape() as tape:
                    loss = v * float(i) * tf.constant(np.ones(i + 1, np.float32))  # new shapes
                tape.gradient(loss, v)
        assert "stays eager" in terra.explain()
    finally:
        terra.config(max_traces=8)


def test_watch_persistent_nested_and_jacobian_equal_eager():
    def prog(Tape):
        x0 = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        w = tf.Variable([[0.5], [-0.5]])
        out = []
        for i in range(5):
            x = x0 * float(i + 1)
            with Tape(persistent=True, watch_accessed_variables=False) as outer:
                outer.watch(x)
                outer.watch(w)
                with Tape() as inner:
                    inner.watch(x)
                    y = tf.reduce_sum(tf.matmul(x, w) ** 2)
                dy_dx = inner.gradient(y, x)
                z = tf.reduce_sum(dy_dx * x)
            gw, gx = outer.gradient(z, [w, x])
            jac = outer.jacobian(dy_dx, x) if i == 3 else tf.zeros([2, 2, 2, 2])
            del outer
            w.assign_sub(0.01 * gw)
            out += [float(z), float(tf.reduce_sum(gx)), float(tf.reduce_sum(jac))]
        terra.end_iteration()
        return out, w.numpy()
    le, we = prog(tf.GradientTape)
    lt, wt = prog(tf.TerraGradientTape)
    np.testing.assert_allclose(lt, le, rtol=1e-6)
    np.testing.assert_allclose(wt, we, rtol=1e-6)


def test_reset_clears_everything():
    _train(tf.TerraGradientTape, steps=4)
    s = terra.stats()
    assert (s["traces"], s["graph_builds"]) == (3, 1), terra.explain()
    terra.reset()
    s = terra.stats()
    assert s["traces"] == 0 and s["graph_builds"] == 0 and terra.explain().startswith("terra:")
