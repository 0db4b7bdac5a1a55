"""A path's build takes the shapes that depend on data from its own graph's inference, with no
separate inference pass over the trace before it (path_graph.py)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.compiler import shapes  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(timeout_s=30.0)
    yield
    terra.reset()
    terra.config(**old)


def test_a_path_graph_finds_data_dependent_shapes_with_its_own_inference(monkeypatch):
    """`tape.gradient` of a mean over axes reads the input's shape in its Python: whether that
    read is static decides the fetch points, and with them the graph. The build takes it from
    its own graph's inference (no separate pass); with a `tf.where` in the path as well, the
    graph's inference finds its length unknown, and the results equal eager's either way."""
    import terra.runtime.static_values as sv
    calls = []
    original = shapes.unknown_shapes
    monkeypatch.setattr(sv, "unknown_shapes", lambda t: calls.append(t) or original(t))
    v = tf.Variable(tf.ones((1, 1, 1, 3)))

    def run(Tape, where):
        out = []
        xs = [tf.reshape(tf.range(24, dtype=tf.float32) - 11.5 + i, (2, 4, 1, 3))
              for i in range(6)]
        for x in xs:
            with Tape() as tape:
                h = tf.nn.relu(x * v)
                if where:
                    h = tf.gather(tf.reshape(h, (-1,)), tf.where(tf.reshape(x, (-1,)) > 0)[:, 0])
                    h = tf.reshape(h, (1, -1, 1, 1)) * v
                loss = tf.reduce_sum(tf.reduce_mean(h, axis=[1, 2]))
            v.assign_sub(0.01 * tape.gradient(loss, v))
            out.append(float(loss))
        return out + v.numpy().ravel().tolist()
    for where in (False, True):
        terra.reset()
        v.assign(tf.ones((1, 1, 1, 3)))
        eager = run(tf.GradientTape, where)
        v.assign(tf.ones((1, 1, 1, 3)))
        with CompileCounter() as c:
            got = run(tf.TerraGradientTape, where)
        assert got == eager, terra.explain()
        c.assert_counts(traces=2, graph_builds=1, fallbacks=0)
    assert calls == [], len(calls)  # no separate pass, for either path
