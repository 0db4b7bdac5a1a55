"""A new graph's function is instantiated ahead of its first run (GraphRunner.warm): the call
runs no op, consumes no feed, writes no variable, and the runs after it compute as before; every
graph a session builds is warmed exactly once, and training stays equal to eager."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.compiler.channels import FeedChannel, FetchChannel  # noqa: E402
from terra.runtime.graph_runner import GraphRunner  # noqa: E402


def test_warm_instantiates_without_running_an_op():
    feed = FeedChannel(tf.float32, [], name="wx")
    fetch = FetchChannel(tf.float32, [], name="wy")
    v = tf.Variable(1.0)

    @tf.function(autograph=False)
    def f():
        a = feed.dequeue_op()
        v.assign_add(a)
        fetch.enqueue_op(a * 2.0)
        return v.read_value()

    concrete = f.get_concrete_function()
    r = GraphRunner()
    feed.put(3.0)
    r.warm(concrete)
    r.warm(concrete)  # instantiated already: returns at once, the same way
    run = r.start(concrete)  # runs go after the warm-ups queued before them
    assert float(r.result(timeout=30)) == 4.0 and run.state == "ok"
    assert r.warmed == 2 and r.runs_finished == 1
    assert float(r.fetch(fetch, 30)) == 6.0 and fetch.size() == 0 and feed.size() == 0
    # a warm-up of a function whose feed is empty neither blocks nor takes a later put
    r.warm(concrete)
    feed.put(5.0)
    r.start(concrete)
    assert float(r.result(timeout=30)) == 9.0 and r.warmed == 3
    assert float(v.numpy()) == 9.0
    r.shutdown(timeout=30)


def test_cancel_and_shutdown_drop_the_warm_ups_still_queued():
    feed = FeedChannel(tf.float32, [], name="wz")

    @tf.function(autograph=False)
    def blocked():
        return feed.dequeue_op()

    concrete = blocked.get_concrete_function()
    r = GraphRunner()
    run = r.start(concrete)  # waits on its feed until cancelled
    r.warm(concrete)
    assert r.cancel(timeout=30) == [run] and not r._work and r.warmed == 0
    run = r.start(concrete)
    r.warm(concrete)
    r.shutdown(timeout=30)
    assert run.state == "cancelled" and r.warmed == 0 and r._thread is None
    assert not r._work


@pytest.fixture
def fresh():
    terra.reset()
    yield
    terra.reset()


def _train(tape_cls, steps=6):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(2)
    xs = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    ys = rng.normal(size=(steps, 8, 1)).astype(np.float32)
    losses = []
    for i in range(steps):
        with tape_cls() as tape:
            loss = tf.reduce_mean(tf.square(model(xs[i]) - ys[i]))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, [v.numpy() for v in model.trainable_variables]


def test_every_built_graph_is_warmed_once_and_training_equals_eager(fresh):
    eager_losses, eager_vars = _train(tf.GradientTape)
    losses, variables = _train(terra.GradientTape)
    terra.end_iteration()
    assert losses == eager_losses
    for a, b in zip(variables, eager_vars):
        np.testing.assert_array_equal(a, b)
    stats = terra.stats()
    assert stats["graph_builds"] == 1
    assert terra._SESSION.runner.warmed == stats["graph_builds"]
