"""tests/counting.py's CompileCounter counts exactly, and fails loudly on a difference."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.counting import CompileCounter  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _loop(steps=6):
    w = tf.Variable(2.0)
    for _ in range(steps):
        with tf.TerraGradientTape() as tape:
            y = w * w
        w.assign_sub(0.1 * tape.gradient(y, w))


def test_counts_what_ran_inside_the_block_only():
    _loop()  # before the block: not counted
    with CompileCounter() as c:
        _loop()
    # the same site with a new variable: the first iteration falls back at op #0 and its trace,
    # a new path, runs the graph of the first loop's path over the new variable (the site had a
    # compiled path); the other five skip
    c.assert_counts(iterations=6, traces=1, graph_builds=0, graph_reuses=1, fallbacks=1,
                    path_switches=0)


def test_a_difference_fails_and_names_it():
    with CompileCounter() as c:
        _loop()
    with pytest.raises(AssertionError, match=r"traces: 2 \(expected 3\)"):
        c.assert_counts(traces=3, graph_builds=1)
    with pytest.raises(ValueError, match="not counted"):
        c.assert_counts(tracez=2)
