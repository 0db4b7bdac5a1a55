"""A trace filed when no next iteration is known to come (`terra.end_iteration()`, `reset()`,
the owner thread's exit) leaves its graph build, and the decisions after it, to the site's
next iteration (runtime/filing.py, `last`): a training loop's last step that diverged into the
program's reads after the loop is a path that may never run again, and its build was paid for
nothing at the program's end.

The program iterates a `tf.data` dataset, so each compiled step ends by taking the next batch
(`IteratorGetNext`); after the loop the program reads the weights instead, and the last
iteration falls back there and is traced as a new path."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

STEPS = 8


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    yield
    terra.reset()


def make():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(1)
    X = rng.normal(size=(4 * (STEPS + 2), 6)).astype(np.float32)
    Y = rng.normal(size=(4 * (STEPS + 2), 1)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)
    return model, opt, data


def epoch(Tape, model, opt, data):
    losses = []
    for x, y in data:
        x = x * 2.0  # (the step's first op comes before its tape)
        with Tape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
        if len(losses) == STEPS:  # (a step budget: the loop leaves before the next batch)
            break
    return losses, [v.numpy() for v in model.weights]  # the reads after the loop


def test_the_last_iterations_new_path_is_built_only_when_the_site_runs_again():
    eager = make()
    e1 = epoch(tf.GradientTape, *eager)
    e2 = epoch(tf.GradientTape, *eager)
    terra_ = make()
    with CompileCounter() as c:
        t1 = epoch(tf.TerraGradientTape, *terra_)
        terra.end_iteration()
    # iteration 1 makes the optimizer's state; 2 and 3 trace the step, built at its second
    # sighting; 4-7 run its graph; 8 runs it too, and Python reads the weights where the path
    # takes the next batch: a fallback, traced as a new path whose graph is not built now
    c.assert_counts(traces=4, new_paths=3, fallbacks=1, graph_builds=1)
    (site,) = SESSION.sites.values()
    assert len(site.deferred) == 1
    assert "waits for the site's next iteration" in terra.explain()
    with CompileCounter() as c2:
        t2 = epoch(tf.TerraGradientTape, *terra_)
        terra.end_iteration()
    # iteration 9 first builds p2's graph (left by iteration 8's end) and predicts p2, the
    # path last taken: Python takes the next batch of the new epoch's iterator where p2 reads
    # the weights, a fallback traced as p3 (the same ops over the new iterator) running p1's
    # graph; 16 switches to p2 and falls back where the program keeps a value p2's graph did
    # not fetch: its rebuild, again, waits for a next iteration
    c2.assert_counts(iterations=8, traces=2, new_paths=1, fallbacks=2, graph_builds=1,
                     graph_reuses=1, path_switches=1)
    assert "iteration 9: graph for path p2" in terra.explain()  # (said by the one building it)
    assert len(site.deferred) == 1
    for got, want in ((t1, e1), (t2, e2)):
        assert got[0] == want[0]
        for a, b in zip(got[1], want[1]):
            np.testing.assert_array_equal(a, b)


def test_reset_ends_the_last_iteration_without_building_its_graph(monkeypatch):
    epoch(tf.TerraGradientTape, *make())
    builds = SESSION.builds
    calls = []
    build = builds.build
    monkeypatch.setattr(builds, "build", lambda *a, **k: calls.append(a) or build(*a, **k))
    (site,) = SESSION.sites.values()
    assert terra.stats()["graph_builds"] == 1
    terra.reset()  # ends iteration 8 (a fallback, traced as a new path), then forgets the site
    assert calls == [] and len(site.deferred) == 1


def test_ending_every_iteration_by_hand_changes_no_decision(monkeypatch):
    """A program that calls `terra.end_iteration()` after every step has each filing's
    decisions made at the next step's start instead of at its own end: the same decisions in
    the same order, so the same counts as with the decisions made at once (the filing's
    `last` ignored), but for the last iteration's, which waits for a next iteration."""
    from terra.runtime import filing

    eager = epoch(tf.GradientTape, *make())

    def run():
        model, opt, data = make()
        losses = []
        for x, y in data:
            x = x * 2.0
            with tf.TerraGradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
            terra.end_iteration()
            if len(losses) == STEPS:
                break
        return losses, [v.numpy() for v in model.weights]

    counts, file = {}, filing.Filing.file
    for deferred in (True, False):
        if not deferred:
            monkeypatch.setattr(filing.Filing, "file", lambda self, it, last=False: file(self, it))
        terra.reset()
        with CompileCounter() as c:
            got = run()
        assert got[0] == eager[0]
        for a, b in zip(got[1], eager[1]):
            np.testing.assert_array_equal(a, b)
        counts[deferred] = {k: getattr(c, k) for k in (
            "iterations", "traces", "new_paths", "fallbacks", "graph_builds", "graph_reuses",
            "path_switches")}
    # (every iteration here is ended by hand: iteration 1 makes the optimizer's state, 2 and
    # 3 trace the step, built when iteration 4 begins, 4-8 run its graph)
    assert counts[True] == counts[False] == dict(iterations=8, traces=3, new_paths=2,
                                                 fallbacks=0, graph_builds=1, graph_reuses=0,
                                                 path_switches=0), counts
