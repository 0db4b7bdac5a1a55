"""Sites whose paths keep changing, and values NumPy reads in every pass of a loop.

A Python loop under the tape whose trip count changes every iteration (an episode until `done`)
gives a new path each time: the site gives up once graphs built for paths seen once never ran,
well before its build limit. A few trip counts in turn are paths seen twice: they compile.
NumPy's functions (`np.squeeze(t)`) read a tensor where tracing sees it (the hook's
`__array_function__`); `np.asarray(t)` reads it through the buffer protocol, which tracing
cannot see: the first compiled iteration finds the read, and one fallback teaches the path every
pass's read."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _program(Tape, lengths, read=None):
    """One step per entry of `lengths`: that many passes of a Keras layer under the tape; with
    `read` (a NumPy function), Python takes every pass's output as a NumPy array (as a policy
    samples an action)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, activation="softmax")])
    opt = keras.optimizers.SGD(0.1)
    x0 = tf.constant(np.random.default_rng(0).normal(size=(1, 3)).astype("float32"))
    losses, seen = [], []
    for n in lengths:
        with Tape() as tape:
            h, total = x0, 0.0
            for _ in range(n):
                h = model(h)
                if read is not None:
                    seen.append(np.array(read(h)))
                total += tf.reduce_sum(h * h)
        grads = tape.gradient(total, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(total))
    return losses, seen, [v.numpy() for v in model.variables]


def _counts():
    s = terra.stats()
    return s["traces"], s["fallbacks"], s["graph_builds"]


def _same(got, eager):
    """Equal to eager; the graph's softmax rounds an ulp differently from eager's kernel."""
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-6, atol=0)
    assert len(got[1]) == len(eager[1])
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
    for a, b in zip(got[2], eager[2]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


def test_numpy_buffer_reads_in_every_pass_are_learned_in_one_fallback():
    lengths = [4] * 12
    eager = _program(tf.GradientTape, lengths, read=np.asarray)
    got = _program(tf.TerraGradientTape, lengths, read=np.asarray)
    terra.end_iteration()
    _same(got, eager)
    why = terra.explain()
    assert why.count("value needed by Python that the graph does not fetch") == 1, why
    assert _counts() == (4, 1, 2), why
    assert "site stays eager" not in why, why


def test_numpy_function_reads_are_seen_while_tracing():
    lengths = [4] * 12
    eager = _program(tf.GradientTape, lengths, read=np.squeeze)
    got = _program(tf.TerraGradientTape, lengths, read=np.squeeze)
    terra.end_iteration()
    _same(got, eager)
    why = terra.explain()
    assert _counts() == (3, 0, 1), why
    assert "site stays eager" not in why, why


def test_a_new_trip_count_every_step_stays_eager_after_four_paths_seen_once():
    lengths = [2, 2, 2] + list(range(3, 15))   # the first step also makes the optimizer's state
    eager = _program(tf.GradientTape, lengths)
    got = _program(tf.TerraGradientTape, lengths)
    terra.end_iteration()
    _same(got, eager)
    why = terra.explain()
    assert "site stays eager: 4 graph builds and 4 paths seen once since it compiled served " \
           "no compiled iteration: its paths keep changing" in why, why
    # builds: p1 (seen twice), then p2-p4 at first sight (a site that has compiled builds a new
    # path at once while fewer than 2 graphs so built are unused 2 iterations on); p5 finds p2
    # and p3 unused and waits for a second sighting; 4 paths seen once and no compiled
    # iteration: eager
    assert _counts() == (7, 4, 4), why


def test_a_few_trip_counts_in_turn_keep_compiling():
    lengths = [2, 3, 4, 5] * 6
    eager = _program(tf.GradientTape, lengths)
    got = _program(tf.TerraGradientTape, lengths)
    terra.end_iteration()
    _same(got, eager)
    why = terra.explain()
    assert "site stays eager" not in why, why
    assert _counts() == (9, 3, 4), why


def test_the_build_limit_is_named_when_it_ends_a_site_that_compiled():
    """A site whose graphs serve fewer iterations than it builds graphs stays eager at
    2 x max_traces builds, and says so (not that its graphs served nothing)."""
    lengths = [2, 2, 2, 2, 3, 4, 3, 4, 5, 6, 5, 6, 7, 8, 7, 8, 2, 2]
    old = terra.config(max_traces=3)
    try:
        eager = _program(tf.GradientTape, lengths)
        got = _program(tf.TerraGradientTape, lengths)
        terra.end_iteration()
    finally:
        terra.config(**old)
    _same(got, eager)
    why = terra.explain()
    assert "site stays eager: 6 graph builds, the limit of 2 x max_traces, for 5 compiled " \
           "iterations: its paths keep changing" in why, why
    assert "served no compiled iteration" not in why, why
    # traces: 1 (optimizer state), 2 and 3 (p1, built, served at 4), then each new trip count a
    # fallback and a build at first sight, served when seen again: 6 builds, 5 served iterations
    assert _counts() == (8, 5, 6), why


def test_a_site_whose_graphs_serve_more_iterations_than_it_builds_keeps_building():
    """Past 2 x max_traces builds a site keeps compiling while its graphs serve more iterations
    than it has built graphs (a common path, and rarer ones that come back)."""
    lengths = [2, 2, 2, 2]
    for n in range(3, 9):
        lengths += [n, 2, 2, n, 2, 2]
    lengths += list(range(3, 9))
    old = terra.config(max_traces=3)
    try:
        eager = _program(tf.GradientTape, lengths)
        got = _program(tf.TerraGradientTape, lengths)
        terra.end_iteration()
    finally:
        terra.config(**old)
    _same(got, eager)
    why = terra.explain()
    assert "site stays eager" not in why, why
    # traces: p0 (optimizer state), p1 twice (built); then each trip count 3-8 a fallback, a
    # trace and a build at first sight: 7 builds, one over the limit of 6; the last six steps
    # run compiled graphs, each switching from p1 to its own
    assert _counts() == (9, 6, 7), why
    assert terra.stats()["path_switches"] == 63, why


def _rare_after_two_unused(rare):
    """Steps of 2 passes, with two trip counts seen once early on (their graphs, built at first
    sight, stay unused), then each entry of `rare` once every 10 steps."""
    lengths = [2, 2, 2, 2, 4, 2, 2, 5, 2, 2, 2]
    for n in rare:
        lengths += [n] + [2] * 9
    return lengths


def test_a_rare_path_is_built_at_its_fifth_sighting():
    """Past the first-sight budget, a path whose sightings come more than 8 iterations apart
    waits for its fifth: its graph would serve few iterations, and a build costs a few traces."""
    lengths = _rare_after_two_unused([3] * 5) + [3, 2, 2, 3]
    eager = _program(tf.GradientTape, lengths)
    got = _program(tf.TerraGradientTape, lengths)
    terra.end_iteration()
    _same(got, eager)
    why = terra.explain()
    assert "site stays eager" not in why, why
    # builds: p1 (2 passes, seen twice), p2 and p3 (4 and 5 passes, at first sight, never
    # served); 3 passes (p4) is traced at each of its five sightings 10 steps apart (the last
    # four known paths after compiled iterations) and built at the fifth; its last two steps
    # switch to it
    assert "[graph_build] test_churn.py:35 iteration 52: graph for path p4" in why, why
    assert why.count("[trace] test_churn.py:35 iteration ") == 10, why
    assert _counts() == (10, 7, 4), why


def test_fallbacks_onto_rare_paths_do_not_end_a_site_whose_graphs_serve_more():
    """max_fallbacks ends a site only while its fallbacks are not outnumbered by the iterations
    its graphs served: a new trip count every 10 steps costs a fallback each, the steps between
    run compiled."""
    lengths = _rare_after_two_unused([6, 7, 8, 9])
    old = terra.config(max_fallbacks=3)
    try:
        eager = _program(tf.GradientTape, lengths)
        got = _program(tf.TerraGradientTape, lengths)
        terra.end_iteration()
    finally:
        terra.config(**old)
    _same(got, eager)
    why = terra.explain()
    assert "site stays eager" not in why, why
    # fallbacks: 4 and 5 passes (built at first sight), then 6-9 (rare, not built): 6 > 3
    assert _counts() == (9, 6, 3), why
