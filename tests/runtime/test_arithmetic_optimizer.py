"""Generated graphs run with Grappler but without its arithmetic optimizer by default
(`terra.config(arithmetic_optimizer=False)`): its rewrites change rounding, which training
amplifies (benchmarks/programs/resnet50.py at bench size: 24% loss difference from eager after 14
steps with it, bit-identical without; docs/usage.md). A small ResNet shows the same: with the
default, losses and every variable equal eager bit for bit."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2  # noqa: E402

import terra  # noqa: E402
from terra import _tf_private as tfp  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

STEPS = 8


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _run(Tape):
    from benchmarks import programs
    p = programs.build("resnet50", Tape, size="tiny")
    losses = [float(p.step(i)) for i in range(STEPS)]
    terra.end_iteration()
    return losses, [np.array(v.numpy()) for v in p.variables()]


def test_default_graphs_equal_eager_bit_for_bit():
    assert terra.config()["arithmetic_optimizer"] is False
    eager_losses, eager_vars = _run(tf.GradientTape)
    with CompileCounter() as c:
        losses, variables = _run(tf.TerraGradientTape)
    # iteration 1 creates the optimizer's variables (not compilable), 2 traces the steady path,
    # 3 sees it again and builds its graph
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    explain = terra.explain()
    assert losses == eager_losses, explain
    for a, b in zip(variables, eager_vars):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arithmetic", [False, True])
def test_the_setting_reaches_each_runs_config(monkeypatch, arithmetic):
    """What each run's ConfigProto says, as the GraphRunner's thread calls the graph."""
    seen = []
    real = tfp.call_concrete_cancellable

    def spy(fn, args, manager):
        config = config_pb2.ConfigProto()
        config.ParseFromString(tfp.context().function_call_options.config_proto_serialized)
        seen.append(config.graph_options.rewrite_options.arithmetic_optimization)
        return real(fn, args, manager)

    monkeypatch.setattr(tfp, "call_concrete_cancellable", spy)
    old = terra.config(arithmetic_optimizer=arithmetic)
    try:
        _run(tf.TerraGradientTape)
    finally:
        terra.config(**old)
    assert seen, "no graph run"
    expected = rewriter_config_pb2.RewriterConfig.DEFAULT if arithmetic else \
        rewriter_config_pb2.RewriterConfig.OFF
    assert set(seen) == {expected}, seen
