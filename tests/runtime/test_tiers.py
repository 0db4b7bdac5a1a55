"""Tiered instantiation (runtime/tiers.py): a site's later graphs run quick (Grappler off) until a
second thread has instantiated them with Grappler; the site's first graph is not tiered. Every
tier computes what eager computes; counts are exact."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.compiler.channels import FetchChannel  # noqa: E402
from terra.runtime.graph_runner import GraphRunner  # noqa: E402
from terra.runtime.tiers import Tiers, quick  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402
from tests.runtime.test_new_paths import _random_depth  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


class _Graph:
    def __init__(self, concrete, run_config=None):
        self.concrete, self.run_config = concrete, run_config


def test_a_graph_runs_quick_until_its_optimized_instantiation_is_done():
    fetch = FetchChannel(tf.float32, [], name="tier_y")
    v = tf.Variable(2.0)

    @tf.function(autograph=False)
    def f():
        y = v * 3.0 + 1.0
        fetch.enqueue_op(y)
        return y

    seen = []

    def optimized(config):
        seen.append(config.graph_options.rewrite_options.disable_meta_optimizer)

    graph = _Graph(f.get_concrete_function(), optimized)
    runner = GraphRunner()
    tiers = Tiers(runner, runner.warm)
    tiers.start(graph)
    assert graph.run_config is not optimized and graph.run_config.terra_quick_of is optimized
    run = runner.start(graph.concrete, config=graph.run_config)  # may run quick or not
    assert float(runner.result(timeout=30)) == 7.0 and run.state == "ok"
    tiers.wait()
    assert graph.run_config is optimized and tiers.tiered_up == 1 and tiers.pending == 0
    runner.start(graph.concrete, config=graph.run_config)
    assert float(runner.result(timeout=30)) == 7.0
    assert [float(runner.fetch(fetch, 30)) for _ in range(2)] == [7.0, 7.0]
    # the quick warm-up, the first run (quick or not), the tier-up and the last run each
    # applied the graph's own config (quick applies it first, then turns the meta optimizer off)
    assert seen == [False] * 4
    proto = tf.compat.v1.ConfigProto()
    quick(optimized)(proto)
    assert proto.graph_options.rewrite_options.disable_meta_optimizer and len(seen) == 5
    assert runner.warmed == 2 and runner.runs_finished == 2
    tiers.shutdown()
    runner.shutdown(timeout=30)


@pytest.mark.parametrize("tiered", [True, False])
def test_later_graphs_of_a_site_are_tiered_and_training_equals_eager(tiered):
    eager = _random_depth(tf.GradientTape, 3)
    old = terra.config(tiered_instantiation=tiered)
    try:
        with CompileCounter() as c:
            got = _random_depth(tf.TerraGradientTape, 3)
        terra.end_iteration()
    finally:
        terra.config(**old)
    assert got[0] == eager[0] and np.array_equal(got[1], eager[1])
    c.assert_counts(traces=5, new_paths=3, graph_builds=3, fallbacks=2)
    session = terra._SESSION
    tiers = session.builds.tiers
    tiers.wait()
    # 3 graphs: the site's first warmed as configured; the other two quick, then tiered up
    assert tiers.tiered_up == (2 if tiered else 0) and tiers.pending == 0
    assert session.runner.warmed == 3 + tiers.tiered_up
    for graph in session.builds.graphs:
        assert not hasattr(graph.run_config, "terra_quick_of")


def test_the_setting_is_checked():
    with pytest.raises(TypeError):
        terra.config(tiered_instantiation="yes")
