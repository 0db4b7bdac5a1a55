"""The recorder widens the collector's young generation while it records, and gives the
program's thresholds back."""
import gc
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
import tensorflow as tf

from terra.tracing import Recorder, gc_window


@pytest.fixture(autouse=True)
def _thresholds():
    old = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*old)


def test_recording_widens_the_young_generation_and_restores_it():
    seen = []
    with Recorder(young_gc=50000):
        seen.append(gc.get_threshold())
        tf.add(tf.constant(1.0), 2.0)
    assert seen == [(50000, 10, 10)]
    assert gc.get_threshold() == (700, 10, 10)


def test_zero_leaves_the_collector_alone():
    with Recorder():
        assert gc.get_threshold() == (700, 10, 10)
    with Recorder(young_gc=0):
        assert gc.get_threshold() == (700, 10, 10)


def test_a_wider_threshold_of_the_program_is_kept():
    gc.set_threshold(100000, 10, 10)
    with Recorder(young_gc=50000):
        assert gc.get_threshold() == (100000, 10, 10)
    assert gc.get_threshold() == (100000, 10, 10)


def test_disabled_collection_by_threshold_zero_stays_disabled():
    gc.set_threshold(0, 10, 10)
    with Recorder(young_gc=50000):
        assert gc.get_threshold() == (0, 10, 10)
    assert gc.get_threshold() == (0, 10, 10)


def test_nested_windows_restore_at_the_outermost():
    gc_window.widen(50000)
    gc_window.widen(80000)
    assert gc.get_threshold() == (50000, 10, 10)
    gc_window.restore()
    assert gc.get_threshold() == (50000, 10, 10)
    gc_window.restore()
    assert gc.get_threshold() == (700, 10, 10)
    gc_window.restore()  # unmatched: nothing to undo
    assert gc.get_threshold() == (700, 10, 10)


def test_a_change_the_program_made_while_recording_wins():
    with Recorder(young_gc=50000):
        gc.set_threshold(2000, 5, 5)
    assert gc.get_threshold() == (2000, 5, 5)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="young_gc"):
        Recorder(young_gc=-1)
    import terra
    with pytest.raises(ValueError, match="tracing_gc_threshold"):
        terra.config(tracing_gc_threshold=-5)
    with pytest.raises(TypeError, match="tracing_gc_threshold"):
        terra.config(tracing_gc_threshold=1.5)
