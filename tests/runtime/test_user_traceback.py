"""runtime/user_traceback.py: a graph's error ends its traceback at the op's program line."""
import os
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.ir.records import FRAME_SOURCES, Location  # noqa: E402
from terra.runtime.user_traceback import at_recorded_line  # noqa: E402


def _gathers(Tape, bad=7, steps=10):
    """A gather by a fed index that is out of range at step `bad`; `float(loss)` is the sync
    point where a graph's failure is met. Returns (step, type, last line of this file in the
    traceback, the traceback's text, the first line of this file in it) of the error."""
    w = tf.Variable(tf.ones((3, 3)))
    for i in range(steps):
        idx = np.array([0, 1, 5 if i == bad else 2], np.int32)
        try:
            with Tape() as tape:
                h = tf.gather(tf.matmul(tf.ones((2, 3)), w), idx, axis=1)  # the failing op
                loss = tf.reduce_sum(h)
            w.assign_sub(0.01 * tape.gradient(loss, w))
            float(loss)
        except tf.errors.InvalidArgumentError as e:
            lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                     if f.filename == __file__]
            return i, type(e), lines[-1], "".join(traceback.format_exception(e)), lines[0]
    return None


def test_a_graph_error_ends_its_traceback_at_the_ops_line():
    eager = _gathers(tf.GradientTape)
    terra.reset()
    got = _gathers(tf.TerraGradientTape)
    terra.end_iteration()
    stats, explain = terra.stats(), terra.explain()
    assert (stats["fallbacks"], stats["traces"]) == (1, 3) and "graph error" in explain, explain
    assert got[:3] == eager[:3], (got[3], eager[3])
    # the traceback shows the gather's source text and no caret under a part of it
    text = got[3]
    assert "h = tf.gather(tf.matmul(tf.ones((2, 3)), w), idx, axis=1)  # the failing op" in text
    after = text.split("# the failing op\n", 1)[1]
    assert "^" not in after.splitlines()[0], text
    # the frames it really passed through come first: Python's line when the failure was met
    # (a later one: the update's first op, which needs the graph's gradient)
    assert got[4] > got[2] and eager[4] == eager[2], text


def test_an_error_without_a_known_program_frame_is_left_as_it_is():
    err = ValueError("x")
    assert at_recorded_line(err, Location(("nowhere.py:f@0",))) is err
    assert err.__traceback__ is None
    FRAME_SOURCES["lib.py:g@2"] = ("/lib.py", 3, "g", True)  # library frames are not shown
    try:
        assert at_recorded_line(err, Location(("lib.py:g@2",))) is err
        assert err.__traceback__ is None
    finally:
        del FRAME_SOURCES["lib.py:g@2"]
