"""Commit-gated writes at run time (`terra.config(commit_writes=...)`, terra/compiler/commit.py):
the same counts and the same values as the snapshot before every run, no snapshot where the
iteration ends on its path, one where Python reads a written value mid-iteration, and variables
exactly as eager leaves them after a divergence past the update and after a graph error."""
import os
import random

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime import fallback  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")

STEPS = 10


@pytest.fixture(autouse=True)
def _settings():
    old = terra.config()
    yield
    terra.config(**old)


@pytest.fixture
def takes(monkeypatch):
    """How many variable snapshots were taken (before runs, or by an early commit)."""
    count = [0]
    original = fallback.Snapshot.take

    def take(self):
        count[0] += 1
        return original(self)
    monkeypatch.setattr(fallback.Snapshot, "take", take)
    return count


def _model():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _train(Tape, read_written=False, branch_after_update=False, bad_index_at=None, keep=None):
    model, opt = _model(), keras.optimizers.Adam(0.01)
    if keep is not None:
        keep.extend([model, opt])
    rng = np.random.default_rng(2)
    X = rng.normal(size=(STEPS, 8, 4)).astype(np.float32)
    Y = rng.normal(size=(STEPS, 8, 1)).astype(np.float32)
    table = tf.constant([1.0, 2.0, 3.0])
    coin = random.Random(7)
    losses, reads = [], []
    for i in range(STEPS):
        with Tape() as tape:
            h = model(X[i])
            loss = tf.reduce_mean((h - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # after the update, independent of it: out of range once, where eager has updated.
        # The index waits for some compute, so that a graph whose writes did not wait for the
        # gather would have made them before it fails (the run fails after the iteration ended)
        slow = tf.constant(np.full((256, 256), 1 / 256, np.float32))
        for _ in range(24):
            slow = tf.matmul(slow, slow)
        late = tf.cast(tf.minimum(tf.reduce_sum(slow), 0.0), tf.int32)
        index = 3 if i == bad_index_at else 1
        loss = loss * tf.gather(table, np.array([index], np.int32) + late)[0]  # (fed)
        if i == bad_index_at:
            continue  # not read: the error surfaces at the next sync point
        if read_written:  # a value that depends on the update, read before the iteration ends
            reads.append(float(model.layers[0].kernel[0, 0]))
        if branch_after_update and coin.random() < 0.5:  # a Python-random path past the update
            loss = loss + tf.reduce_sum(model.layers[1].kernel)
        losses.append(float(loss))
    return losses, reads, [v.numpy() for v in model.variables + opt.variables]


def _same(a, b):
    for x, y in zip(a[:2], b[:2]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
    for x, y in zip(a[2], b[2]):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)


def _counted(**kwargs):
    with CompileCounter() as c:
        got = _train(tf.TerraGradientTape, **kwargs)
    return got, {k: getattr(c, k) for k in ("traces", "fallbacks", "graph_builds",
                                             "path_switches")}


def _graphs_gated():
    session = terra._SESSION
    return {p.graph.commit_channel is not None for s in session.sites.values()
            for p in s.paths.values() if p.graph is not None}


def test_a_training_loop_takes_no_snapshot_and_counts_as_with_one(takes):
    eager = _train(tf.GradientTape)
    terra.config(commit_writes=False)
    old, old_counts = _counted()
    snapshots_before = takes[0]
    terra.reset()
    terra.config(commit_writes=True)
    takes[0] = 0
    new, new_counts = _counted()
    _same(old, eager)
    _same(new, eager)
    assert new_counts == old_counts == {"traces": 3, "fallbacks": 0, "graph_builds": 1,
                                        "path_switches": 0}
    assert snapshots_before == STEPS - 3  # one per compiled iteration's run
    assert takes[0] == 0 and terra.stats()["commit_snapshots"] == 0
    assert _graphs_gated() == {True}


def test_a_read_of_a_written_value_commits_early_with_a_snapshot(takes):
    eager = _train(tf.GradientTape, read_written=True)
    got, counts = _counted(read_written=True)
    _same(got, eager)
    assert counts == {"traces": 3, "fallbacks": 0, "graph_builds": 1, "path_switches": 0}
    assert _graphs_gated() == {True}
    assert takes[0] == terra.stats()["commit_snapshots"] == STEPS - 3


def test_a_random_branch_after_the_update_equals_eager_as_with_snapshots(takes):
    eager = _train(tf.GradientTape, branch_after_update=True)
    terra.config(commit_writes=False)
    old, old_counts = _counted(branch_after_update=True)
    terra.reset()
    terra.config(commit_writes=True)
    new, new_counts = _counted(branch_after_update=True)
    _same(old, eager)
    _same(new, eager)
    assert new_counts == old_counts
    assert new_counts["fallbacks"] + new_counts["path_switches"] > 0, new_counts


def _state_at_error(Tape):
    keep = []
    with pytest.raises(tf.errors.InvalidArgumentError):
        _train(Tape, bad_index_at=STEPS - 1, keep=keep)
        terra.end_iteration()  # (Terra: the last run's error surfaces at the iteration's end)
    model, opt = keep
    opt.build(model.trainable_variables)
    return [v.numpy() for v in model.variables + opt.variables]


def test_a_graph_error_leaves_the_variables_as_eager_does():
    """The gather after the update fails in the last iteration (compiled, committed, its
    error surfacing at its end): eager raises there with every update made; so does Terra,
    whose writes of that iteration waited for the gather (the run wrote nothing) and whose
    replay of the iteration made them."""
    eager = _state_at_error(tf.GradientTape)
    got = _state_at_error(tf.TerraGradientTape)
    assert _graphs_gated() == {True}
    assert len(got) == len(eager)
    for x, y in zip(got, eager):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7)
