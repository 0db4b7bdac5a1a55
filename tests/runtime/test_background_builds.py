"""Graph builds off the critical path (`background_builds`, terra/runtime/builder.py).

The builder thread is gated here: a build ends only when the test opens its gate, and
`terra.wait_builds()` installs it, so each count below is exact whatever the machine's speed.
Every program must equal eager (losses and variables, bit for bit) however long a build takes.
"""
import os
import subprocess
import sys
import textwrap
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime import builds as builds_module  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402


@pytest.fixture(autouse=True)
def _background():
    terra.reset()
    old = terra.config(background_builds=True)
    yield
    terra.reset()
    terra.config(**old)


class Gate:
    """Stands in for `PathGraph` on the builder thread: each build waits until `open()`."""

    def __init__(self, monkeypatch, fail=False):
        self.event = threading.Event()
        self.started = 0
        self.fail = fail
        real = builds_module.PathGraph

        def build(inputs):
            self.started += 1
            self.event.wait(60)
            if self.fail:
                raise RuntimeError("lowering failed")
            return real(inputs)

        monkeypatch.setattr(builds_module, "PathGraph", build)

    def open(self):
        self.event.set()
        assert terra.wait_builds(timeout=60)


def _program(Tape, steps, branch=None, on_step=None):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05)
    data = np.random.default_rng(0).normal(size=(steps, 4, 3)).astype("float32")
    losses = []
    for step in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean(model(data[step]) ** 2)
            if branch is not None and branch(step):
                loss = loss + 0.1 * tf.reduce_sum(tf.abs(model.trainable_variables[0]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
        if on_step is not None:
            on_step(step)
    terra.end_iteration()
    return losses, [v.numpy() for v in model.variables]


def _assert_equal(got, eager):
    assert got[0] == eager[0]
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)


def test_the_program_goes_on_eagerly_while_its_graph_is_built(monkeypatch):
    """Iterations 1 and 2 trace the path, whose build is submitted when iteration 2 ends.
    While the gate is shut (steps 2-6) the program goes on tracing, eagerly; the gate opens
    after step 6 and the graph is installed at step 7, which runs compiled with the rest."""
    eager = _program(tf.GradientTape, 12)
    gate = Gate(monkeypatch)
    got = _program(terra.GradientTape, 12, on_step=lambda s: s == 6 and gate.open())
    _assert_equal(got, eager)
    s = terra.stats()
    assert gate.started == 1
    assert (s["traces"], s["fallbacks"], s["graph_builds"]) == (7, 0, 1), terra.explain()
    assert "on the builder thread, installed at iteration 8" in terra.explain()


def test_a_fallback_onto_a_path_being_built_does_not_count_against_the_site(monkeypatch):
    """Path A is compiled at step 4 (the gate opens after step 3). Path B (even steps from 6)
    falls back from A's graph at step 6; a site with a compiled path builds a new path at once,
    so B's build is submitted then, and waits behind the shut gate while B falls back again at
    steps 8, 10, 12 and 14. From step 16 it runs its own graph. With max_fallbacks 2 the site
    would give up at step 8; the four fallbacks while B is built are the cost of not waiting
    for its graph, and do not count."""
    branch = lambda step: step >= 6 and step % 2 == 0  # noqa: E731
    eager = _program(tf.GradientTape, 20, branch)
    gate = Gate(monkeypatch)

    def on_step(step):
        if step == 3:
            gate.open()
            gate.event.clear()
        if step == 15:
            gate.open()

    old = terra.config(max_fallbacks=2)
    try:
        got = _program(terra.GradientTape, 20, branch, on_step)
    finally:
        terra.config(**old)
    _assert_equal(got, eager)
    s = terra.stats()
    text = terra.explain()
    assert "stays eager" not in text, text
    assert (s["graph_builds"], s["fallbacks"]) == (2, 5), text
    assert text.count("its graph is being built: not held against max_fallbacks") == 4, text


def test_a_build_that_raises_leaves_the_site_eager_and_says_why(monkeypatch):
    eager = _program(tf.GradientTape, 8)
    gate = Gate(monkeypatch, fail=True)
    with pytest.warns(RuntimeWarning, match="raised RuntimeError: lowering failed"):
        got = _program(terra.GradientTape, 8, on_step=lambda s: s == 3 and gate.open())
    _assert_equal(got, eager)
    s = terra.stats()
    assert (s["graph_builds"], s["fallbacks"]) == (0, 0)
    assert "site stays eager: building the graph of path p1 raised RuntimeError" in \
        terra.explain()


def test_reset_with_a_build_in_flight_ends_the_builder_thread(monkeypatch):
    gate = Gate(monkeypatch)
    _program(terra.GradientTape, 4)
    assert gate.started == 1 and SESSION.builds.builder.jobs
    gate.event.set()
    terra.reset()
    assert not SESSION.builds.builder.jobs
    assert not [t for t in threading.enumerate() if t.name.startswith("terra-builder")]
    # the next program builds afresh
    monkeypatch.undo()
    eager = _program(tf.GradientTape, 6)
    got = _program(terra.GradientTape, 6, on_step=lambda s: s == 3 and terra.wait_builds(60))
    _assert_equal(got, eager)
    assert terra.stats()["graph_builds"] == 1


def test_the_interpreter_exits_cleanly_with_a_build_in_flight():
    """A program that ends right after its graph's build was submitted: the builder thread is
    joined before TF is torn down (no crash at exit, exit status 0)."""
    script = textwrap.dedent("""
        import numpy as np, tensorflow as tf, terra
        terra.config(background_builds=True)
        w = tf.Variable(np.ones((64, 64), "float32"))
        for step in range(3):
            with tf.TerraGradientTape() as tape:
                loss = tf.reduce_sum(tf.tanh(w @ w))
            w.assign_sub(0.001 * tape.gradient(loss, w))
        terra.end_iteration()
        print("jobs", len(terra.runtime.session.SESSION.builds.builder.jobs))
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "jobs 1" in out.stdout


def _lengths_program(Tape, batches, on_step=None):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(1)
    losses = []
    for n in batches:
        x = tf.constant(rng.normal(size=(n, 3)).astype("float32"))
        with Tape() as tape:  # (a multiple no shape gives: a constant the group's runs put)
            loss = tf.reduce_mean(model(tf.tile(x, [1 if n == 4 else 2, 1])) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
        if on_step is not None:
            on_step(len(losses) - 1)
    terra.end_iteration()
    return losses, [v.numpy() for v in model.variables]


def test_a_path_that_joins_a_shape_group_while_its_graph_is_built_runs_the_groups(monkeypatch):
    """Batches of 4 rows, one of 6 at step 3. The 4-row path's build is submitted when iteration
    2 ends and waits behind the gate; the 6-row path, traced at step 3, forms a shape group with
    it when that iteration ends (at step 4's tape), and the group's graph is built at once on
    the program's thread. The gate opens after step 4, and the 4-row path's own graph, done
    then, is dropped: a member runs the group's graph (it puts the group's constants, which its
    own graph has no channel for; installed, that graph failed step 5 with an IndexError).
    Steps 4-9 run compiled, equal to eager."""
    batches = [4, 4, 4, 6] + [4] * 6
    eager = _lengths_program(tf.GradientTape, batches)
    gate = threading.Event()
    real = builds_module.PathGraph

    def gated(*args, **kwargs):
        if threading.current_thread().name.startswith("terra-builder"):
            gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(builds_module, "PathGraph", gated)
    def open_after_step_4(step):
        if step == 4:
            gate.set()
            assert terra.wait_builds(timeout=60)

    got = _lengths_program(terra.GradientTape, batches, open_after_step_4)
    _assert_equal(got, eager)
    text = terra.explain()
    assert "is dropped: the path has joined shape group g0" in text, text
    s = terra.stats()
    assert (s["traces"], s["fallbacks"], s["graph_builds"]) == (4, 0, 1), text
    assert s["iterations"] - s["traces"] == 6  # steps 4-9
