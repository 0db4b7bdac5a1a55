"""benchmarks/breakdown.py's graph alone: every channel its runs dequeue is filled before they
start (a run would wait for a missing element forever, uninterruptibly)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from benchmarks import breakdown  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def test_queue_runs_fills_every_channel_a_run_dequeues():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(3)])
    opt = keras.optimizers.Adam(0.01)
    x, y = np.ones((8, 4), np.float32), np.zeros((8, 3), np.float32)
    for _ in range(5):
        with tf.TerraGradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        float(loss)
    terra.end_iteration()
    (path,) = [p for s in terra._SESSION.sites.values() for p in s.paths.values()
               if p.graph is not None]
    graph = path.graph
    assert graph.commit_channel is not None
    breakdown.queue_runs(path, graph, 3)
    channels = [ch for ch in (*graph.feed_channels, *graph.gate_channels.values(),
                              graph.commit_channel) if ch is not None]
    assert channels and all(ch.size() == 3 for ch in channels)
    fn = graph.function_for(path)
    for _ in range(3):
        fn()
    assert all(ch.size() == 0 for ch in channels)


def test_rotation_keeps_the_proportions_and_spreads_the_members():
    assert breakdown.rotation({"a": 2, "b": 1}, 6) == ["a", "b", "a", "a", "b", "a"]
    order = breakdown.rotation({"a": 30, "b": 10, "c": 20}, 12)
    assert [order.count(m) for m in "abc"] == [6, 2, 4]
    assert breakdown.rotation({"a": 5}, 3) == ["a", "a", "a"]


def test_graph_alone_runs_a_shape_groups_graph_over_its_members_feeds():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.01)
    batches = [np.ones((n, 4), np.float32) for n in (8, 6)]
    for i in range(8):
        x = batches[i % 2]
        with tf.TerraGradientTape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        float(loss)
    terra.end_iteration()
    paths = [p for s in terra._SESSION.sites.values() for p in s.paths.values()
             if p.graph is not None]
    assert len(paths) == 2 and paths[0].graph is paths[1].graph and paths[0].group is not None
    graph = paths[0].graph
    before = [v.numpy() for v in model.variables]
    times = breakdown.graph_alone(5, hits={paths[0]: 1, paths[1]: 1})
    assert len(times) == 5
    channels = [ch for ch in (*graph.feed_channels, *graph.gate_channels.values(),
                              graph.commit_channel, *graph.fetch_channels.values())
                if ch is not None]
    assert all(ch.size() == 0 for ch in channels)
    # the runs trained: six steps of the two batch sizes in turn moved the kernel
    assert not np.array_equal(before[0], model.variables[0].numpy())
