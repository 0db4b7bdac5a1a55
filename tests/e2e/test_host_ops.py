"""Host ops (terra/ir/op_kinds.py): tf.data's next element runs on the program's thread, as in
eager, and its outputs enter the graph as feeds. Stateful random draws with a global seed are
issued as the stateless ops that draw the same numbers (terra/tracing/random_streams.py), which
the graph computes from a fed counter. Loops over a dataset and programs drawing with
tf.random.* compile and give eager's numbers bit for bit."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.tracing import random_streams  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _data(n=40):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 4)).astype(np.float32),
            rng.normal(size=(n, 1)).astype(np.float32))


def _mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])


def _dataset_loop(Tape, epochs=3, noise=False, batch=8, n=40):
    tf.random.set_seed(7)
    model, opt = _mlp(), keras.optimizers.Adam(1e-2)
    ds = tf.data.Dataset.from_tensor_slices(_data(n)).shuffle(16, seed=1).batch(batch)
    losses = []
    for _ in range(epochs):
        for x, y in ds:  # a new iterator every epoch
            with Tape() as tape:
                if noise:
                    x = x + 0.1 * tf.random.normal(tf.shape(x))
                h = model(x, training=True)
                if noise:
                    h = tf.nn.dropout(h, 0.3)
                loss = tf.reduce_mean((h - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
    return losses, [w.numpy() for w in model.weights] + [opt.iterations.numpy()]


def _assert_equal(got, eager):
    assert got[0] == eager[0]
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)


def test_for_x_y_in_dataset_compiles_and_equals_eager():
    eager = _dataset_loop(tf.GradientTape)
    got = _dataset_loop(tf.TerraGradientTape)
    terra.end_iteration()
    _assert_equal(got, eager)
    s, explain = terra.stats(), terra.explain()
    # the first iteration holds the model's first build (it creates variables); then one path
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (3, 1, 0), explain
    assert s["overlapped_iterations"] == 12, explain
    assert "stays eager" not in explain


def test_a_smaller_last_batch_is_another_path_and_equals_eager():
    eager = _dataset_loop(tf.GradientTape, epochs=4, n=44)
    got = _dataset_loop(tf.TerraGradientTape, epochs=4, n=44)
    terra.end_iteration()
    _assert_equal(got, eager)
    assert terra.stats()["graph_builds"] == 2, terra.explain()


def test_unseeded_random_ops_are_drawn_by_the_graph_as_eager_draws_them():
    """tf.random.normal and tf.nn.dropout without a Generator, with a global seed: eager's draws
    depend on per-call seeds that TF derives in Python; each call is issued as the stateless op
    with its kernel's key and counter, which the graph computes: the same draws, and the site
    compiles."""
    eager = _dataset_loop(tf.GradientTape, noise=True)
    stateful = random_streams.draws()["stateful"]
    got = _dataset_loop(tf.TerraGradientTape, noise=True)
    assert random_streams.draws()["stateful"] == stateful  # (no stateful kernel ran)
    terra.end_iteration()
    _assert_equal(got, eager)
    s, explain = terra.stats(), terra.explain()
    # x = x + noise is computed by the graph; at the first epoch's end the loop variable x still
    # holds it (within an epoch the next element rebinds x before the next tape), which the
    # path had not seen: one fallback, and the rebuilt graph returns it from then on
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (4, 2, 1), explain
    assert "value kept past the iteration" in explain
    assert "stateful random" not in explain


def _dcgan_noise(Tape, steps=10):
    """The DCGAN tutorial's shape: noise from tf.random.normal every step, no Generator."""
    tf.random.set_seed(11)
    keras.utils.set_random_seed(1)
    gen = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    opt = keras.optimizers.SGD(0.1)
    kept = []
    for _ in range(steps):
        noise = tf.random.normal([5, 3])
        with Tape() as tape:
            loss = tf.reduce_mean(gen(noise) ** 2) + tf.reduce_mean(tf.random.uniform([2]))
        opt.apply_gradients(zip(tape.gradient(loss, gen.trainable_variables),
                                gen.trainable_variables))
        kept.append(float(loss))
    return kept, [w.numpy() for w in gen.weights]


def test_noise_drawn_before_and_inside_the_tape_equals_eager():
    eager = _dcgan_noise(tf.GradientTape)
    got = _dcgan_noise(tf.TerraGradientTape)
    terra.end_iteration()
    _assert_equal(got, eager)
    s = terra.stats()
    # the last iteration's path expects the next step's draw, and the program reads the weights
    # instead: the loop's end is one fallback, whose path's graph waits for a next iteration
    # (runtime/filing.py, `last`)
    assert (s["graph_builds"], s["fallbacks"]) == (1, 1), terra.explain()
    assert "expected StatelessRandomNormalV2, observed ReadVariableOp" in terra.explain()


def _noise_of_the_batchs_size(Tape, steps=8):
    """keras-io's WGAN-GP shape: noise of the batch's size, the size a value the graph computes
    (`tf.shape(x)[0]`, taken before the tape)."""
    tf.random.set_seed(5)
    w = tf.Variable(tf.fill((3, 2), 0.5))
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3) / 12)
    out = []
    for _ in range(steps):
        n = tf.shape(x)[0]
        with Tape() as tape:
            z = tf.random.normal((n, 3))
            alpha = tf.random.uniform([n, 1])
            loss = tf.reduce_sum(tf.sin((x + alpha * z) @ w))
        w.assign_sub(0.05 * tape.gradient(loss, w))
        out.append(float(loss))
    return out, [w.numpy()]


def test_a_draw_of_a_computed_size_has_a_shape_the_graph_knows():
    """The draw's shape reaches the stateless op as the constant it is this step: the graph
    knows the draw's shape, as it knew a fed draw's, so the gradient's unit has no shape of
    unknown size to check (each check would wait for the graph)."""
    from terra.runtime.session import SESSION
    eager = _noise_of_the_batchs_size(tf.GradientTape)
    got = _noise_of_the_batchs_size(tf.TerraGradientTape)
    terra.end_iteration()
    _assert_equal(got, eager)
    s = terra.stats()
    # (the last iteration's path expects the next step's `tf.shape`; the program reads the
    # weights instead: a fallback, and a path of its own, not built: no next iteration came)
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (3, 1, 1), terra.explain()
    graphs = [p.graph for site in SESSION.sites.values() for p in site.paths.values()
              if p.graph is not None]
    assert graphs and all(not g.unknown_shapes for g in graphs)


def test_a_print_of_a_drawn_value_happens_once_per_step(tmp_path):
    def run(Tape, out):
        tf.random.set_seed(3)
        w = tf.Variable(1.0)
        for _ in range(6):
            with Tape() as tape:
                r = tf.random.uniform([])
                tf.print(r, output_stream=f"file://{out}")
                loss = w * r
            w.assign_sub(0.1 * tape.gradient(loss, w))
        return w.numpy()
    eager = run(tf.GradientTape, tmp_path / "e.txt")
    got = run(tf.TerraGradientTape, tmp_path / "t.txt")
    terra.end_iteration()
    assert got == eager
    assert (tmp_path / "t.txt").read_text() == (tmp_path / "e.txt").read_text()
    assert terra.stats()["graph_builds"] == 1, terra.explain()


# ------------------------------------------------------------------ empty iterations
def _raises_first(Tape, steps=8):
    w = tf.Variable(3.0)
    caught = 0
    for i in range(steps):
        try:
            with Tape() as tape:
                if i < 2:
                    raise RuntimeError("not ready")
                loss = w * 2.0
            w.assign_sub(0.1 * tape.gradient(loss, w))
        except RuntimeError:
            caught += 1
    return caught, w.numpy()


def test_iterations_that_raise_before_any_op_do_not_make_the_site_eager():
    eager = _raises_first(tf.GradientTape)
    got = _raises_first(tf.TerraGradientTape)
    terra.end_iteration()
    assert got == eager
    s, explain = terra.stats(), terra.explain()
    assert s["graph_builds"] == 1, explain
    assert "empty iteration (no TF op ran): not filed" in explain
    assert "stays eager" not in explain


# ------------------------------------------------------------------ tf.py_function
def _py_function_step(Tape, steps=8):
    w = tf.Variable([[0.5], [-0.3]])
    x = tf.constant([[1.0, 2.0]])
    calls, losses = [], []
    for step in range(steps):
        def square_plus_step(v, step=step):  # a closure over this step's Python value
            calls.append(step)
            return v * v + float(step)
        with Tape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
            loss = loss + 0.01 * tf.py_function(square_plus_step, [loss], tf.float32)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss))
    terra.end_iteration()
    return losses, calls, w.numpy()


def test_a_py_function_keeps_its_site_eager_after_one_repeat_and_says_why():
    """A py_function's op calls whatever Python function its per-call `token` names: a graph
    would call the first step's closure every step. Its path is one path whatever the token, not
    compilable, so the site stays eager once it repeats (2 traces, not `max_traces`), with the
    reason in explain(); the closure runs once per step with that step's value, as in eager."""
    eager = _py_function_step(tf.GradientTape)
    terra.reset()
    with pytest.warns(RuntimeWarning, match="tf.py_function"):
        got = _py_function_step(tf.TerraGradientTape)
    assert got[0] == eager[0] and got[1] == eager[1] == list(range(8))
    np.testing.assert_array_equal(got[2], eager[2])
    s = terra.stats()
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (2, 0, 0), terra.explain()
    assert "runs Python inside an op (tf.py_function)" in terra.explain()


def _py_function_every_fourth(Tape, steps=16):
    w = tf.Variable([[0.5], [-0.3]])
    x = tf.constant([[1.0, 2.0]])
    losses = []
    for step in range(steps):
        with Tape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
            if step % 4 == 3:
                loss = loss + 0.01 * tf.py_function(lambda v: v * v, [loss], tf.float32)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss))
    terra.end_iteration()
    return losses, w.numpy()


def test_a_py_function_branch_falls_back_and_the_other_path_stays_compiled():
    """The path without the py_function compiles; each step that calls it falls back at the
    op and is traced, as one path seen again (its token is not part of it)."""
    eager = _py_function_every_fourth(tf.GradientTape)
    terra.reset()
    got = _py_function_every_fourth(tf.TerraGradientTape)
    assert got[0] == eager[0]
    np.testing.assert_array_equal(got[1], eager[1])
    s = terra.stats()
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (6, 1, 4), terra.explain()
    assert "path p1 seen 4 times; not compilable" in terra.explain()
