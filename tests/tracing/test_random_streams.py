"""terra/tracing/random_streams.py: eager's stateful random draws issued as stateless ops draw
exactly what TF's own kernels draw: new kernels, kernels an op seed given again continues,
float16 to float64, integers, int64 shapes, dropout masks; the stateful op still runs before a kernel
cache reset has been seen, without a seed, and in graphs."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402,F401 - installs the patch
from terra.tracing import random_streams  # noqa: E402


def _draws():
    out = [tf.random.normal((4, 3)), tf.random.uniform((5,), dtype=tf.float64),
           tf.random.truncated_normal((2, 2)), tf.nn.dropout(tf.ones((6, 6)), 0.5)]
    for _ in range(3):  # an op seed given again: eager's cached kernel draws on
        out += [tf.random.normal((3,), seed=7), tf.random.uniform([2, 3], seed=7)]
    out += [tf.random.normal(tf.constant([2, 2], tf.int64), seed=7),   # another kernel (T)
            tf.random.normal((2, 2), dtype=tf.float16, seed=9),
            tf.random.uniform((3,), minval=2.0, maxval=5.0, seed=7)]
    for _ in range(2):  # integers: a new kernel each, then one an op seed continues
        out += [tf.random.uniform((4, 2), 0, 10, dtype=tf.int32),
                tf.random.uniform((3,), -7, 7, dtype=tf.int64, seed=4)]
    return [x.numpy() for x in out]


@pytest.fixture
def reinstalled():
    """The patch as importing terra leaves it, put back after a test took it out."""
    yield
    if not random_streams.installed():
        random_streams.install()
    tf.random.set_seed(None)


def _calls():
    return random_streams.draws()


def test_stateless_draws_equal_tfs_own_stateful_kernels(reinstalled):
    tf.random.set_seed(1)
    before = _calls()
    ours = _draws()
    after = _calls()
    assert after["stateless"] - before["stateless"] == 17
    assert after["stateful"] == before["stateful"]
    random_streams.uninstall()
    tf.random.set_seed(1)
    theirs = _draws()
    assert len(ours) == len(theirs) == 17
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


def test_the_stateful_op_runs_until_a_kernel_cache_reset_is_seen(reinstalled):
    random_streams.uninstall()
    random_streams.install()   # as if terra were imported after some draws: counts unknown
    before = _calls()
    tf.random.normal((2,), seed=3)   # (eager's kernel for these attrs may exist already)
    assert _calls()["stateful"] == before["stateful"] + 1
    tf.random.set_seed(4)      # a reset: from here on every draw is counted
    tf.random.normal((2,), seed=3)
    assert _calls()["stateless"] == before["stateless"] + 1
    tf.random.set_seed(None)   # a reset too, but a draw without any seed is seeded at random
    tf.random.normal((2,))
    assert _calls()["stateful"] == before["stateful"] + 2


def test_a_reset_makes_every_kernel_new_again(reinstalled):
    from tensorflow.python.eager import context
    tf.random.set_seed(2)
    first = tf.random.normal((3,), seed=5).numpy()
    continued = tf.random.normal((3,), seed=5).numpy()
    context.context().clear_kernel_cache()
    again = tf.random.normal((3,), seed=5).numpy()
    assert not np.array_equal(first, continued)
    np.testing.assert_array_equal(first, again)


def test_graphs_keep_the_stateful_op(reinstalled):
    tf.random.set_seed(3)

    @tf.function
    def draw():
        return tf.random.normal((2,))
    ops = {op.type for op in draw.get_concrete_function().graph.get_operations()}
    assert "RandomStandardNormal" in ops and "StatelessRandomNormalV2" not in ops


def test_two_threads_drawing_with_one_op_seed_split_its_stream(reinstalled):
    """TF's kernel reserves each call's outputs under its mutex: threads drawing from one
    kernel get its stream's blocks in some order, never one block twice."""
    import threading

    def blocks(n):
        return [tuple(tf.random.normal((5,), seed=11).numpy().tolist()) for _ in range(n)]
    tf.random.set_seed(1)
    reference = blocks(40)
    tf.random.set_seed(1)
    got = []
    threads = [threading.Thread(target=lambda: got.extend(blocks(20))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(reference)) == 40 and sorted(got) == sorted(reference)
