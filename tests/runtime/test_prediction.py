"""Which compiled path an iteration starts on, and what a divergence costs: the most frequent
successor of the latest paths is predicted (a period of paths is learned, a random branch is
not over-fitted); a switch goes straight to a path that takes the op Python
issued; a value Python read once is fetched by the path's next build; fallbacks at an epoch's
end do not make a site eager. Every case equals eager, with exact counts."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    before = terra.config()
    yield
    terra.reset()
    terra.config(**before)


def _counts():
    s = terra.stats()
    return s["traces"], s["graph_builds"], s["fallbacks"], s["path_switches"]


def _read_every_fifth(Tape, steps=30):
    w = tf.Variable(tf.ones((4, 4)))
    x = tf.constant(np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
    seen = []

    def step(i):
        with Tape() as tape:
            h = tf.tanh(x @ w)           # dropped when `step` returns: not kept past the step
            loss = tf.reduce_sum(h)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        if i % 5 == 4:
            seen.append(h.numpy()[0, 0])  # Python reads it every fifth step,
            seen.append(float(tf.reduce_max(h)))  # and then runs an op more
    for i in range(steps):
        step(i)
    terra.end_iteration()
    return seen, w.numpy()


def test_a_value_read_every_fifth_step_stops_falling_back():
    eager = _read_every_fifth(tf.GradientTape)
    got = _read_every_fifth(tf.TerraGradientTape)
    assert got[0] == eager[0]
    np.testing.assert_array_equal(got[1], eager[1])
    # p0 built at iteration 2. Iteration 5 reads `h`, which p0 does not fetch: a fallback, p1
    # (p0 and a Max) is filed and built, and p0, which learned to fetch `h`, is rebuilt. From
    # then on a read step fetches `h` from p0's graph and switches to p1 at the Max (five
    # switches); iteration 6 started on p1 and switched to p0 where it ended: no more fallbacks.
    # (The four p0s before each p1 predict it from iteration 15 on, but not by a lead of more
    # than PREDICT_MARGIN before the end: the previous path alone goes on predicting p0)
    assert _counts() == (3, 3, 1, 6), terra.explain()


def _three_way(Tape, choices):
    w = tf.Variable(1.0)
    for c in choices:
        with Tape() as tape:
            if c == 0:
                y = tf.sin(w)
            elif c == 1:
                y = tf.cos(w)
            else:
                y = tf.exp(-w)
        w.assign_sub(0.1 * tape.gradient(y, w))
    terra.end_iteration()
    return w.numpy()


def test_a_switch_goes_to_the_path_that_takes_the_op():
    # p0, p1, p2 compiled (each seen twice), then 0 -> 2: the switch skips p1, whose first op
    # (Cos) is not Python's (Exp)
    choices = [0, 0, 1, 1, 2, 2, 0, 2, 0, 2]
    eager = _three_way(tf.GradientTape, choices)
    got = _three_way(tf.TerraGradientTape, choices)
    np.testing.assert_array_equal(got, eager)
    explain = terra.explain()
    assert "p0 -> p1" not in explain.split("[switch]", 1)[-1].split("\n")[0]
    # p0 built at 2; p1 and p2 built at their first trace (a compiled path existed), each after
    # a fallback; the later 0 -> 2 and 2 -> 0 changes are one switch each, never through p1
    assert _counts() == (4, 3, 2, 4), explain
    switches = [line for line in explain.splitlines() if line.startswith("[switch]")]
    assert len(switches) == 4 and not any("p1" in line for line in switches), explain


def _branch_before_a_read(Tape, choices):
    w, v = tf.Variable(tf.fill((2, 2), 0.5)), tf.Variable(tf.fill((2, 2), 0.25))
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    for c in choices:
        with Tape() as tape:
            h = tf.matmul(x, w)
            if c == 1:
                h = tf.sin(h)
            elif c == 2:
                h = tf.cos(h)
            y = tf.reduce_sum(h * v)  # path 0 reads `v` where paths 1 and 2 take Sin / Cos
        gw, gv = tape.gradient(y, [w, v])
        w.assign_sub(0.1 * gw)
        v.assign_sub(0.1 * gv)
    terra.end_iteration()
    return w.numpy(), v.numpy()


def test_a_switch_skips_paths_that_read_a_variable_where_python_issued_a_variable_free_op():
    # Python issues Cos on p1 (which expected Sin). p0 expects a read of `v` there: an op that
    # takes a variable on TF's fast route reads it only then, so a read may stand for the op,
    # but Cos takes only a placeholder: p0 is not tried (before, it was: two restarts per change)
    choices = [0, 0, 1, 1, 2, 2, 1, 2, 1, 2]
    eager = _branch_before_a_read(tf.GradientTape, choices)
    got = _branch_before_a_read(tf.TerraGradientTape, choices)
    for a, b in zip(got, eager):
        np.testing.assert_array_equal(a, b)
    explain = terra.explain()
    switches = [line for line in explain.splitlines() if line.startswith("[switch]")]
    assert not any("-> p0" in line for line in switches), explain
    # p0 built at 2, p1 and p2 at their first traces after a fallback each; then one switch per
    # change of branch (7, 8, 9; iteration 10 starts on p2, the successor p1 had most often)
    assert _counts() == (4, 3, 2, 3), explain


def _epochs(Tape, epochs, steps=10, state_at_end=False):
    """The next element is taken before the next step's tape, as Keras' `fit` does: at an
    epoch's end Python makes a new iterator where the path takes the next element.
    `state_at_end`: the epoch's last step makes a variable inside its tape (a path that cannot
    be compiled, met once per epoch)."""
    w = tf.Variable(tf.ones((3,)))
    data = tf.data.Dataset.from_tensor_slices(
        np.arange(3 * steps, dtype=np.float32).reshape(steps, 3) / 30).batch(1)
    for _ in range(epochs):
        it = iter(data)
        x = next(it)
        for s in range(steps):
            with Tape() as tape:
                loss = tf.reduce_sum(tf.square(x * w - 1.0))
                if state_at_end and s + 1 == steps:
                    loss = loss * tf.Variable(0.5)
            w.assign_sub(0.05 * tape.gradient(loss, w))
            if s + 1 < steps:
                x = next(it)
    terra.end_iteration()
    return w.numpy()


def test_an_epochs_new_iterator_ends_the_iteration_without_a_fallback():
    """Where the path takes the next element (a host op, after the step), the epoch's last
    iteration makes a new iterator instead: the graph has done all its work, so the iteration
    ends there (`path_view.host_tail`) and the iterator is made eagerly."""
    eager = _epochs(tf.GradientTape, 6)
    got = _epochs(tf.TerraGradientTape, 6)
    np.testing.assert_array_equal(got, eager)
    explain = terra.explain()
    # (the sixth epoch's last iteration is ended by the program, not by a new iterator)
    assert explain.count("where only host ops were left of the path") == 5, explain
    assert _counts() == (2, 1, 0, 0), explain


def test_fallbacks_at_each_epochs_end_do_not_make_the_site_eager():
    terra.config(max_fallbacks=3)
    eager = _epochs(tf.GradientTape, 6, state_at_end=True)
    got = _epochs(tf.TerraGradientTape, 6, state_at_end=True)
    np.testing.assert_array_equal(got, eager)
    explain = terra.explain()
    assert "stays eager" not in explain and terra.stats()["phase"] == "idle"
    # each epoch's last step falls back once (it makes a variable); the first files its path,
    # the next four repeat it (not held against max_fallbacks=3); the last one makes no new
    # iterator after it: a path of its own
    assert explain.count("not held against max_fallbacks") == 4, explain
    assert _counts()[2] == 6, explain


def test_fallbacks_onto_new_paths_still_count():
    terra.config(max_fallbacks=2)
    choices = [0, 0, 1, 1, 2, 2]
    with pytest.warns(RuntimeWarning, match="2 fallbacks"):
        _three_way(tf.TerraGradientTape, choices)
    assert "site stays eager: 2 fallbacks" in terra.explain()


def _random_activation(Tape, steps=40, seed=3):
    """SDPoint in small: Python's `random` picks the activation in the middle of every step."""
    import random
    rnd = random.Random(seed)
    w, v = tf.Variable(tf.fill((4, 4), 0.3)), tf.Variable(tf.fill((4, 4), 0.2))
    x = tf.constant(np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
    acts = [None, tf.sin, tf.cos, tf.tanh]
    losses = []
    for _ in range(steps):
        with Tape() as tape:
            h = tf.matmul(x, w)
            act = rnd.choice(acts)
            if act is not None:
                h = act(h)
            loss = tf.reduce_sum(tf.matmul(h, v))
        gw, gv = tape.gradient(loss, [w, v])
        w.assign_sub(0.01 * gw)
        v.assign_sub(0.01 * gv)
        losses.append(float(loss))
    terra.end_iteration()
    return losses, w.numpy(), v.numpy()


def test_a_site_whose_predictions_keep_missing_holds_its_runs():
    from tests.counting import CompileCounter
    eager = _random_activation(tf.GradientTape)
    with CompileCounter() as c:
        got = _random_activation(tf.TerraGradientTape)
    assert got[0] == eager[0]
    for a, b in zip(got[1:], eager[1:]):
        np.testing.assert_array_equal(a, b)
    explain = terra.explain()
    # four paths, each compiled at its first trace once one was (a fallback each); from then on
    # a wrong prediction is a switch. After iteration 7 four of the five compiled iterations
    # had left their path (three fallbacks, a switch): from iteration 8 on every run waits for
    # op #3, past the op where the paths part, and each of the 22 later switches is made before
    # its run starts (nothing to cancel or restore); runs start on the path Python takes
    c.assert_counts(iterations=40, traces=5, graph_builds=4, fallbacks=3, path_switches=23,
                    held_iterations=33, held_switches=22)
    assert "[hold]" in explain and "runs wait until Python has told" in explain, explain


def test_a_site_whose_predictions_come_right_starts_its_runs_with_the_iteration_again():
    from tests.counting import CompileCounter
    choices = [0, 0, 1, 1, 2, 2] + [0, 1, 2] * 8
    eager = _three_way(tf.GradientTape, choices)
    with CompileCounter() as c:
        got = _three_way(tf.TerraGradientTape, choices)
    np.testing.assert_array_equal(got, eager)
    explain = terra.explain()
    # two fallbacks and the switches of iterations 7 and 8 make four misses in six: runs are
    # held from iteration 9. By then each path's successor is learnt (0 -> 1 -> 2 -> 0), the
    # predictions come right, and from iteration 15 (four misses have left the window of eight)
    # runs start with the iteration again: 7 held iterations, no switch after iteration 10
    c.assert_counts(iterations=30, traces=4, graph_builds=3, fallbacks=2, path_switches=4,
                    held_iterations=7, held_switches=2)
    assert "iteration 15: predictions hold again" in explain, explain


def _critic_steps(Tape, steps=10, d_steps=3):
    """A GAN's step in small (keras-io's WGAN-GP): `d_steps` critic updates, each its own tape,
    then the generator's input and update. Once both optimizers have their state, the critic
    site's iterations run p1 p1 p3 p1 p1 p3: p3 is the critic step that goes on into the
    generator's."""
    import keras
    d, g = tf.Variable(tf.fill((3, 3), 0.2)), tf.Variable(tf.fill((3, 3), 0.1))
    x = tf.constant(np.arange(9, dtype=np.float32).reshape(3, 3) / 9)
    d_opt, g_opt = keras.optimizers.SGD(0.05, momentum=0.5), keras.optimizers.SGD(0.05)

    def train_step():
        for _ in range(d_steps):
            with Tape() as tape:
                loss = tf.reduce_sum(tf.tanh(x @ d))
            d_opt.apply_gradients([(tape.gradient(loss, d), d)])
        z = tf.sin(x) + 1.0
        with Tape() as tape:
            gen = tf.reduce_sum(tf.sin(z @ g) @ d)
        g_opt.apply_gradients([(tape.gradient(gen, g), g)])
    for _ in range(steps):
        train_step()
    terra.end_iteration()
    return d.numpy(), g.numpy()


@pytest.mark.parametrize("order", [1, None])
def test_a_period_of_paths_is_predicted(order, monkeypatch):
    """The previous path alone predicts p1 after p1 at every third critic step, which then
    switches to p3 where the generator's ops come (a restart of the run: the critic's work is
    done twice); the run of the latest two paths tells the places in the period apart, and
    takes over once it has predicted more than PREDICT_MARGIN iterations more."""
    from terra.runtime import sites
    if order is not None:
        monkeypatch.setattr(sites, "PREDICT_ORDER", order)
    eager = _critic_steps(tf.GradientTape)
    got = _critic_steps(tf.TerraGradientTape)
    for a, b in zip(got, eager):
        np.testing.assert_array_equal(a, b)
    explain = terra.explain()
    traces, builds, fallbacks, switches = _counts()
    # p0 makes the critic's optimizer state, p2 the generator's; p1 built at iteration 4, p3 at
    # its first trace (6), after a fallback at p1's end. Iteration 7 starts on p3 (p1's only
    # successor so far) and switches to p1; then one switch per generator step (9, 12, ..., 30)
    # with the previous path alone; with the latest paths, longer runs have taken the lead
    # after iteration 15's switch: no switch after it
    assert (traces, builds, fallbacks) == (5, 2, 1), explain
    assert switches == (9 if order == 1 else 4), explain
