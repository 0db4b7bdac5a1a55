"""Every bundled program builds at size "tiny" and trains eagerly with a finite loss."""
import math

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import programs


@pytest.mark.parametrize("name", programs.PROGRAMS)
def test_tiny_program_runs_two_eager_steps(name):
    p = programs.build(name, tf.GradientTape, seed=0, size="tiny")
    before = [v.numpy().copy() for v in p.variables()]
    losses = [p.step(i) for i in range(2)]
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses), losses
    after = p.variables()
    assert all(hasattr(v, "assign") and hasattr(v, "numpy") for v in after)
    assert len(after) >= len(before)  # optimizer slots are created on the first update
    trained = [not np.array_equal(b, a.numpy()) for b, a in zip(before, after)]
    assert sum(trained) > 0, "no variable changed"
    assert programs.load(name).build(tf.GradientTape, size="tiny").name == name


def test_same_seed_gives_same_initial_state_and_data():
    a = programs.build("dropblock", tf.GradientTape, seed=3, size="tiny")
    b = programs.build("dropblock", tf.GradientTape, seed=3, size="tiny")
    for va, vb in zip(a.variables(), b.variables()):
        np.testing.assert_array_equal(va.numpy(), vb.numpy())
    np.testing.assert_array_equal(a.batch(1)[0].numpy(), b.batch(1)[0].numpy())
    assert a.step(0) == b.step(0)


def test_dropblock_schedule_mutates_keep_prob():
    p = programs.build("dropblock", tf.GradientTape, size="tiny")
    p.step(0)
    assert p.model.dropblock.keep_prob == 1.0
    p.step(3)
    assert p.model.dropblock.keep_prob == pytest.approx(1 - 0.5 * (1 - p.final_keep_prob))


def test_music_transformer_reads_loss_back_from_self():
    p = programs.build("music_transformer", tf.GradientTape, size="tiny")
    loss = p.step(0)
    assert loss == float(p.loss_value)


def test_bert_cls_logs_sklearn_metric_each_step():
    p = programs.build("bert_cls", tf.GradientTape, size="tiny")
    p.step(0), p.step(1)
    assert len(p.f1_history) == 2 and all(0.0 <= f <= 1.0 for f in p.f1_history)


def test_bad_arguments():
    with pytest.raises(ValueError, match="huge"):
        programs.build("gpt2", tf.GradientTape, size="huge")
    with pytest.raises(ValueError, match="nope"):
        programs.load("nope")
    with pytest.raises(TypeError, match="tape_cls"):
        programs.build("gpt2", None, size="tiny")
