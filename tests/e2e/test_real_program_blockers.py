"""Regression tests for what kept real training loops from running or compiling: each reproduction
runs eagerly and under Terra and must give the same values, with the counts Terra should reach."""
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.generalize import generalize  # noqa: E402
from terra.ir.records import (ConstRef, Feed, FeedRef, Location, OpRecord, OutputRef,  # noqa: E402
                              TensorSpec, Trace)
from tests.counting import CompileCounter  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


# ------------------------------------------------------------------ 1. values kept past their path
_RUNNING_MEAN = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf, keras, terra
Tape = tf.TerraGradientTape if sys.argv[1] == "terra" else tf.GradientTape
v = tf.Variable(1.0); opt = keras.optimizers.SGD(0.01); total = 0
for i in range(1, 31):
    with Tape() as tape:
        loss = v * v
    opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
    total += loss
    if i % 10 == 0: print(f"{total / i:.6f}")
terra.end_iteration()
print(repr(v.numpy()), int(opt.iterations))
if sys.argv[1] == "terra":
    s = terra.stats()
    print("graph_builds", s["graph_builds"], "fallbacks", s["fallbacks"], file=sys.stderr)
"""


def _run(code, mode):
    p = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"{mode} exited with {p.returncode}:\n{p.stderr[-3000:]}"
    return p.stdout, p.stderr


def test_a_running_total_of_kept_losses_equals_eager():
    """`total += loss` keeps every step's loss; `total / i` after the path has ended ran a TF op
    on a placeholder of the finished path (the process died in TF's execute)."""
    eager, _ = _run(_RUNNING_MEAN, "eager")
    got, err = _run(_RUNNING_MEAN, "terra")
    assert got == eager
    assert len(got.splitlines()) == 4
    assert "graph_builds 1 fallbacks 0" in err, err


def _wgan(Tape, steps=15):
    keras.utils.set_random_seed(0)
    g = tf.random.Generator.from_seed(1)
    gen = keras.Sequential([keras.Input((2,)), keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dense(4)])
    critic = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                               keras.layers.Dense(1)])
    opt_g, opt_c = keras.optimizers.RMSprop(5e-3), keras.optimizers.RMSprop(5e-3)
    real = tf.constant(np.random.default_rng(0).normal(size=(48, 4)).astype(np.float32))
    reals = [real[16 * k:16 * k + 16] for k in range(3)]  # tensors: fed, one path for all three
    kept, printed = [], []
    for step in range(steps):
        for k in range(3):  # three critic steps, each with its own tape
            z = g.normal([16, 2])
            with Tape() as t:
                loss_c = tf.reduce_mean(critic(gen(z))) - \
                    tf.reduce_mean(critic(reals[k]))
            grads = t.gradient(loss_c, critic.trainable_variables)
            opt_c.apply_gradients(zip(grads, critic.trainable_variables))
            for w in critic.trainable_variables:
                w.assign(tf.clip_by_value(w, -0.05, 0.05))
        z = g.normal([16, 2])  # the generator step draws from the Generator too
        with Tape() as t:
            loss_g = -tf.reduce_mean(critic(gen(z)))
        grads = t.gradient(loss_g, gen.trainable_variables)
        opt_g.apply_gradients(zip(grads, gen.trainable_variables))
        kept.append(loss_g)
        if step % 5 == 4:
            printed.append(f"{tf.reduce_mean(kept[-5:]):.7f}")
    return printed, [w.numpy() for w in gen.weights + critic.weights], \
        [float(x) for x in kept]


def test_wgan_shaped_loop_with_kept_generator_losses_equals_eager():
    eager = _wgan(tf.GradientTape)
    with CompileCounter() as c:
        got = _wgan(tf.TerraGradientTape)
    assert got[0] == eager[0]
    assert got[2] == eager[2]
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)
    explain = terra.explain()
    # the critic-only path p1 is built at iteration 4 (iterations 1 and 3 create optimizer
    # state), the path on through the generator step (p3) at iteration 6 after a fallback; each
    # printing step falls back: p4 built at iteration 15 and traced again at 30, p5 traced at
    # 45, the last, and not built (runtime/filing.py, `last`: no next iteration came)
    c.assert_counts(traces=8, graph_builds=3, fallbacks=4)
    # the generator step follows the last critic step inside that iteration: a path that goes
    # on past the critic-only path, not the end of the loop (it ran eagerly every step before)
    assert "[end]" not in explain, explain
    assert "op after the end of the path" in explain, explain


# ------------------------------------------------------------------ 2. generalize compares by value
def _rec(i, op, inputs):
    return OpRecord(i, op, (("T", "int32"),), inputs, (TensorSpec("int32", (2,)),),
                    Location(("t.py:f@1",)))


def test_generalize_compares_a_tensor_feed_value_with_a_constant_by_value():
    """A base slot first merged from two feeds holds an EagerTensor; comparing it with a constant
    must compare values (`==` on a tensor is elementwise, and its truth value raised)."""
    def trace(first, second, third, value):
        t = Trace("s", [_rec(0, "Neg", (first,)), _rec(1, "Neg", (second,)),
                        _rec(2, "Neg", (third,))])
        t.feeds = [Feed(0, TensorSpec("int32", (2,)), "python-constant")]
        t.feed_values = [value]
        return t
    base = trace(FeedRef(0), FeedRef(0), ConstRef((1, 1), "int32"), (3, 5))
    for bounds, same in (((3, 5), True), ((3, 6), False)):
        new = trace(FeedRef(0), ConstRef(bounds, "int32"), ConstRef((2, 2), "int32"),
                    tf.constant([3, 5]))
        new.feeds = [Feed(0, TensorSpec("int32", (2,)), "eager-tensor")]
        g = generalize(base, new)
        assert (g is not None) is same
    g = generalize(base, trace(FeedRef(0), ConstRef((3, 5), "int32"), ConstRef((2, 2), "int32"),
                               tf.constant([3, 5])))
    assert [r.inputs for r in g.records] == [(FeedRef(0),), (FeedRef(0),), (FeedRef(1),)]
    assert g.feed_values[1] == (2, 2)


def _slices(Tape, steps=16):
    """Slice bounds drawn with np.random.choice, as an actor-critic loop picks its window."""
    rng = np.random.RandomState(3)
    w = tf.Variable(tf.linspace(0.5, 1.5, 12))
    losses = []
    for _ in range(steps):
        a = rng.choice(6)
        n = rng.choice([2, 3])
        with Tape() as tape:
            y = (w * 2.0)[a:a + n]
            loss = tf.reduce_sum(y * y)
        w.assign_sub(0.05 * tape.gradient(loss, w))
        losses.append(float(loss))
    return losses, w.numpy()


def test_slice_bounds_from_numpy_random_choice_equal_eager():
    eager = _slices(tf.GradientTape)
    got = _slices(tf.TerraGradientTape)
    terra.end_iteration()
    assert got[0] == eager[0]
    np.testing.assert_array_equal(got[1], eager[1])


# ------------------------------------------------------------------ 3. tf.summary and tf.print
def _summaries(Tape, logdir, steps=8):
    w = tf.Variable(1.0)
    writer = tf.summary.create_file_writer(logdir)
    for step in range(steps):
        with Tape() as tape:
            loss = w * w
        w.assign_sub(0.1 * tape.gradient(loss, w))
        with writer.as_default():
            tf.summary.write("loss", loss, step=step)
    writer.flush()
    return w.numpy()


def _events(logdir):
    out = []
    for name in sorted(os.listdir(logdir)):
        for e in tf.compat.v1.train.summary_iterator(os.path.join(logdir, name)):
            for v in e.summary.value:
                out.append((e.step, v.tag, tf.make_ndarray(v.tensor).item()))
    return out


def test_summary_writes_after_a_terra_tape_equal_eager(tmp_path):
    eager = _summaries(tf.GradientTape, str(tmp_path / "eager"))
    got = _summaries(tf.TerraGradientTape, str(tmp_path / "terra"))
    terra.end_iteration()
    assert got == eager
    assert _events(str(tmp_path / "terra")) == _events(str(tmp_path / "eager"))
    assert len(_events(str(tmp_path / "eager"))) == 8
    s = terra.stats()
    assert (s["graph_builds"], s["fallbacks"]) == (1, 0), terra.explain()


def _prints(Tape, path, steps=8, branch=lambda i: True):
    w = tf.Variable(1.0)
    for i in range(steps):
        with Tape() as tape:
            loss = w * w
            if branch(i):
                tf.print("loss", loss, output_stream=f"file://{path}")
            else:
                tf.print("other", loss * 2.0, output_stream=f"file://{path}")
        w.assign_sub(0.1 * tape.gradient(loss, w))
    return w.numpy()


@pytest.mark.parametrize("branch", ["one_path", "branches"])
def test_tf_print_prints_exactly_when_and_as_often_as_eager(tmp_path, branch):
    """Prints run on the program's thread when it gets there: never from the graph ahead of
    Python, never twice after a path switch or fallback, and the last one before the program
    moves on."""
    pick = (lambda i: True) if branch == "one_path" else (lambda i: i % 3 != 2)
    eager = _prints(tf.GradientTape, tmp_path / "eager.txt", 12, pick)
    with CompileCounter() as c:
        got = _prints(tf.TerraGradientTape, tmp_path / "terra.txt", 12, pick)
    assert got == eager
    lines = (tmp_path / "terra.txt").read_text().splitlines()
    assert lines == (tmp_path / "eager.txt").read_text().splitlines()
    assert len(lines) == 12
    # p0 traced at iteration 1 and built at 2; with branches, the other print at iteration 3
    # (i == 2) falls back once and becomes p1 (built), and later ones switch between the graphs
    c.assert_counts(**{"one_path": dict(traces=2, graph_builds=1, fallbacks=0),
                       "branches": dict(traces=3, graph_builds=2, fallbacks=1)}[branch])


def _two_paths_printing(Tape, out):
    w = tf.Variable(2.0)
    for i in range(10):
        with Tape() as tape:
            loss = w * float(i % 2 + 1) if i < 6 else w - 1.0  # a third path from step 6
            tf.print(loss, output_stream=f"file://{out}")
        w.assign_sub(0.01 * tape.gradient(loss, w))
    return w.numpy()


def test_prints_on_new_paths_and_after_a_fallback_equal_eager(tmp_path):
    """Each path's first iterations print eagerly, skip mode prints fetched values, and the
    fallback to the new path at step 6 replays the prefix without printing again."""
    eager = _two_paths_printing(tf.GradientTape, tmp_path / "eager.txt")
    with CompileCounter() as c:
        got = _two_paths_printing(tf.TerraGradientTape, tmp_path / "terra.txt")
    assert got == eager
    assert (tmp_path / "terra.txt").read_text() == (tmp_path / "eager.txt").read_text()
    assert len((tmp_path / "eager.txt").read_text().splitlines()) == 10
    # p0 generalized to p1 (the factor a feed) and built at iteration 2; iteration 7 (i == 6)
    # falls back to the new path p2 (built), whose gradient call falls back at iterations 8, 9
    # and 10, the last, whose path p3 is not built (runtime/filing.py, `last`: no next
    # iteration came): 6 traces, 2 builds, 4 fallbacks
    c.assert_counts(traces=6, graph_builds=2, fallbacks=4)


def test_placeholder_errors_name_the_eager_tensor_type():
    w = tf.Variable([1.0, 2.0])
    messages = {}
    for Tape in (tf.GradientTape, tf.TerraGradientTape, tf.TerraGradientTape,
                 tf.TerraGradientTape, tf.TerraGradientTape):
        with Tape() as tape:
            y = w * 2.0
        try:
            y[0] = 1.0
        except TypeError as e:
            messages.setdefault(Tape, set()).add(str(e))
        try:
            y.no_such_attribute
        except AttributeError as e:
            messages.setdefault(Tape, set()).add(str(e))
        tape.gradient(y, w)
    terra.end_iteration()
    assert messages[tf.TerraGradientTape] == messages[tf.GradientTape]
    assert all("EagerTensor" in m for m in messages[tf.GradientTape])
    assert terra.stats()["graph_builds"] == 1, terra.explain()


# ------------------------------------------------------------------ 4. attrs=None (LogicalAnd)
def _logical(Tape, steps=8):
    w = tf.Variable(1.0)
    for i in range(steps):
        with Tape() as tape:
            c = tf.logical_and(tf.constant(i) < 5, True)
            loss = w * w * tf.cast(c, tf.float32)
        w.assign_sub(0.1 * tape.gradient(loss, w))
    return w.numpy()


def test_ops_whose_fallback_passes_no_attrs_are_recorded_and_compiled():
    eager = _logical(tf.GradientTape)
    got = _logical(tf.TerraGradientTape)
    terra.end_iteration()
    assert got == eager
    s = terra.stats()
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (2, 1, 0), terra.explain()
    assert "not compilable" not in terra.explain()


def _gru(Tape, steps=6):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.GRU(4), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-2)
    rng = np.random.default_rng(5)
    data = [(rng.normal(size=(2, 5, 3)).astype(np.float32),
             rng.normal(size=(2, 1)).astype(np.float32)) for _ in range(steps)]
    losses = []
    for x, y in data:
        with Tape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy() for v in model.weights]


def test_keras_gru_compiles_and_equals_eager():
    eager = _gru(tf.GradientTape)
    with CompileCounter() as c:
        got = _gru(tf.TerraGradientTape)
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-6)
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # iteration 1 creates Adam's variables, 2 traces the steady path, 3 builds its graph
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert "stays eager" not in terra.explain(), terra.explain()


# ------------------------------------------------------------------ a GRU with its state kept
def _gru_with_state(Tape, steps=8):
    """The NMT tutorial's encoder step: a GRU with an initial state returning its sequences and
    state, and a running total of the losses kept across steps."""
    keras.utils.set_random_seed(0)
    gru = keras.layers.GRU(4, return_sequences=True, return_state=True)
    dense = keras.layers.Dense(1)
    opt = keras.optimizers.Adam(1e-2)
    x, y = tf.random.normal((2, 3, 3)), tf.random.normal((2, 1))
    hidden = tf.zeros((2, 4))
    losses, total = [], 0
    for _ in range(steps):
        with Tape() as tape:
            out, state = gru(x, initial_state=hidden)
            loss = tf.reduce_mean((dense(state) - y) ** 2)
        vs = gru.trainable_variables + dense.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs))
        total += loss
        losses.append(float(loss))
    return losses, float(total), [v.numpy() for v in vs]


def test_a_gru_step_loop_compiles_without_fallbacks():
    """The eager TensorArray bounds-checked a placeholder time index with ops (`index < 0`,
    `index >= size`) where eager reads an EagerTensor's value: every compiled step issued ops
    its path did not have and fell back (5 traces, 2 fallbacks, 3 builds here; the NMT
    tutorial's loop went eager for good after 20 fallbacks)."""
    eager = _gru_with_state(tf.GradientTape)
    got = _gru_with_state(tf.TerraGradientTape)
    terra.end_iteration()
    assert got[0] == eager[0] and got[1] == eager[1]
    for a, b in zip(got[2], eager[2]):
        np.testing.assert_array_equal(a, b)
    s = terra.stats()
    assert (s["traces"], s["fallbacks"], s["graph_builds"]) == (3, 0, 1), terra.explain()


def test_a_placeholder_referenced_only_by_an_unheld_one_is_not_kept():
    """Keras sets `_keras_logits` on an activation's output, pointing at its input: the logits
    count as kept only while the output is (before, any reference counted, and an iteration
    whose gate nothing held fell back with "value kept past the iteration")."""
    from terra.runtime.placeholders import ConstantResolver, Placeholder
    from terra.runtime.held import kept_unresolved

    def ph():
        return Placeholder.create(tf.float32, [], ConstantResolver(1.0))
    phs = {(1, 0): ph(), (2, 0): ph()}  # logits, gate (only this dict holds them)
    phs[(2, 0)]._keras_logits = phs[(1, 0)]
    assert kept_unresolved(phs, {}) == []
    held = phs[(2, 0)]  # noqa: F841 - the program holds the gate: both are kept
    assert kept_unresolved(phs, {}) == [OutputRef(1, 0), OutputRef(2, 0)]
    assert kept_unresolved(phs, {OutputRef(1, 0): None}) == [OutputRef(2, 0)]
    del held
    kept = phs[(1, 0)]  # noqa: F841 - the logits held directly
    assert kept_unresolved(phs, {}) == [OutputRef(1, 0)]
