"""Ops whose output shape depends on a tensor's *value* (`Range`, `Fill`, `Tile`, `Reshape`,
`StridedSlice` with tensor bounds): a placeholder may only claim the shape the graph guarantees
for every value of its feeds; what it does not guarantee is known once fetched. Each program runs
eagerly and under Terra and must give the same values, shapes and Python-visible lengths."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True, params=[False, True], ids=["path-graph", "site-graph"])
def _fresh(request):
    terra.reset()
    old = terra.config(timeout_s=30.0, site_graph=request.param)
    yield
    terra.reset()
    terra.config(**old)


def _both(program):
    eager = program(tf.GradientTape)
    with CompileCounter() as c:
        got = program(tf.TerraGradientTape)
    assert got == eager, terra.explain()
    return c


def test_range_of_a_variable_times_an_input_reads_its_real_length():
    def program(Tape):
        one = tf.Variable(1)
        out = []
        for v in [0, 0, 0, 2, 2, 0, 3]:
            n = tf.constant(v)
            with Tape():
                r = tf.range(n * one)
                items = [int(x) for x in r]
            out.append((v, items, tuple(r.shape)))
        return out
    # the loop over the range runs inside the tape's block: a longer range goes past the end
    # of the path of a shorter one while the tape is open, which falls back and traces the
    # new length (iterations 4 and 7; the site graph is rebuilt with each new path, except the
    # last iteration's, whose builds wait for a next iteration that never comes:
    # runtime/filing.py, `last`)
    site = terra.config()["site_graph"] is True
    _both(program).assert_counts(traces=4, graph_builds=3 if site else 2, fallbacks=2)


def test_shape_read_without_iteration_is_the_real_shape():
    def program(Tape):
        w = tf.Variable(2)
        out = []
        for v in [1, 1, 1, 3, 1, 4, 4]:
            n = tf.constant(v)
            with Tape():
                f = tf.fill(tf.stack([n * w]), 7.0)
                s = tf.reduce_sum(f)
                rows = f.shape[0]
            out.append((rows, float(s)))
        return out
    _both(program).assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_fill_value_matches_eager_with_no_python_read_of_the_shape():
    def program(Tape):
        x = tf.Variable(1)
        out = []
        for v in [1, 1, 1, 2, 1, 3]:
            n = tf.constant(v)
            with Tape():
                f = tf.fill([n * x], 7)
            out.append(f.numpy().tolist())
        return out
    _both(program).assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_tile_and_reshape_by_tensor_multiples_then_keras_reads_the_shape():
    def program(Tape):
        k = tf.Variable(1)
        base = tf.constant([[1.0, 2.0]])
        out = []
        for v in [1, 1, 1, 3, 3, 2]:
            reps = tf.constant(v)
            with Tape():
                t = tf.tile(base, tf.stack([reps * k, 1]))
                y = tf.reshape(t, [-1])
                z = y * 2.0 + tf.cast(tf.shape(y)[0], tf.float32)
            out.append((tuple(t.shape), z.numpy().tolist()))
        return out
    _both(program).assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_slice_with_tensor_bounds_is_as_long_as_in_eager():
    def program(Tape):
        data = tf.constant(np.arange(10, dtype=np.float32))
        start = tf.Variable(0)
        out = []
        for v in [3, 3, 3, 5, 3, 7]:
            stop = tf.constant(v)
            with Tape():
                s = data[start:stop + start]
                m = tf.reduce_mean(s)
            out.append((len(s), float(m)))
        return out
    _both(program).assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_a_shape_the_graph_guarantees_is_not_a_sync_point():
    """`x.shape` of a value whose shape holds for every feed value reads no value: a reshape to
    a Python shape, here `[-1, 4]` of a fixed-size input, keeps its static shape."""
    def program(Tape):
        w = tf.Variable(tf.ones((4, 2)))
        out = []
        for step in range(6):
            x = tf.constant(np.full((3, 8), step, np.float32))
            with Tape():
                h = tf.reshape(x, [-1, 4])
                y = tf.matmul(h, w)
                rows = y.shape[0]
            out.append((rows, float(tf.reduce_sum(y))))
        return out
    _both(program).assert_counts(traces=2, graph_builds=1, fallbacks=0)


def test_two_branches_each_with_a_computed_length():
    """Two compiled paths (a site graph where it is on): each branch's length is computed."""
    def program(Tape):
        one = tf.Variable(1)
        out = []
        for step, v in enumerate([1, 1, 1, 1, 1, 1, 3, 2, 4, 1, 5, 2]):
            n = tf.constant(v)
            with Tape():
                if step % 2:
                    r = tf.range(n * one) * 2
                else:
                    r = tf.range(n * one + 1)
                total = tf.reduce_sum(r)
                length = r.shape[0]
            out.append((length, int(total)))
        return out
    site_graph = terra.config()["site_graph"]  # one more build: the graph of both paths
    _both(program).assert_counts(traces=4, graph_builds=3 if site_graph else 2, fallbacks=1)
