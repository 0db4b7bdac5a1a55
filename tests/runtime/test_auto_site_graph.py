"""`site_graph="auto"` (the default): a site takes a site graph once restarts have thrown away
graph work Python waited for (terra/runtime/policy.py, `takes_site_graph`).

A Python-random head after a mid-step read of the loss: with path graphs, each switch of head
cancels a run that has computed the trunk up to the read, and the restart computes it again;
with the site graph the head is a Case-Select put and the run goes on. A random head with no
read before it (Python decides ahead of the graph) keeps its path graphs.

The rule weighs seconds (the waits thrown away against the paths' build times): its arithmetic
is tested on numbers in test_policy.py. Here `free_builds` prices a site graph's build at zero,
so that the outcome depends on counts alone (`READ_RESTARTS`); the program's own trunk is too
small for its restarts ever to cost a build, which the last test shows with the real price."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import random  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime import policy  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    yield
    terra.reset()


@pytest.fixture
def free_builds(monkeypatch):
    monkeypatch.setattr(policy, "SITE_BUILD_FACTOR", 0.0)


def read_then_branch(Tape, steps=24, read=True, late_head=None):
    """A trunk, a read of its loss (a logging check), then one of three heads by Python's
    `random`: two of the same structure (one graph over either's variables) and one other;
    from step `late_head` on, one of four (the fourth another structure again)."""
    keras.utils.set_random_seed(5)
    trunk = keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)])
    heads = [keras.layers.Dense(1), keras.layers.Dense(1),
             keras.layers.Dense(1, activation="sigmoid")]
    if late_head is not None:
        heads.append(keras.layers.Dense(1, activation="relu"))
    inp = keras.Input((4,))
    for h in heads:
        h(trunk(inp))
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(1)
    X = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    Y = rng.normal(size=(steps, 8, 1)).astype(np.float32)
    rnd = random.Random(11)
    variables = trunk.trainable_variables + [v for h in heads for v in h.trainable_variables]
    opt.build(variables)
    losses, logged = [], []
    for i in range(steps):
        with Tape() as tape:
            z = trunk(X[i])
            base = tf.reduce_mean(z ** 2)
            if read:
                logged.append(float(base))
            head = heads[rnd.randrange(4 if late_head is not None and i >= late_head else 3)]
            loss = tf.reduce_mean((head(z) - Y[i]) ** 2) + 0.1 * base
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        losses.append(float(loss))
    return losses, logged, [v.numpy() for v in variables]


def _equal(got, eager):
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-5, atol=1e-7, err_msg="losses")
    np.testing.assert_allclose(got[1], eager[1], rtol=1e-5, atol=1e-7, err_msg="reads")
    for a, b in zip(got[2], eager[2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg="variables")


def _run(site_graph, read=True, **kwargs):
    old = terra.config(site_graph=site_graph)
    try:
        terra.reset()
        with CompileCounter() as c:
            got = read_then_branch(tf.TerraGradientTape, read=read, **kwargs)
        (site,) = SESSION.sites.values()
        return got, c, terra.explain(), site
    finally:
        terra.config(**old)


def test_the_default_is_auto():
    from terra.config import Config
    assert Config().site_graph == "auto"


def test_restarts_after_a_read_give_the_site_a_site_graph(free_builds):
    eager = read_then_branch(tf.GradientTape)
    assert len(set(np.round(eager[0], 6))) > 1
    off, c_off, explain_off, _ = _run(False)
    _equal(off, eager)
    auto, c_auto, explain_auto, site = _run("auto")
    _equal(auto, eager)
    # path graphs: every change of head after the read restarts the run
    assert "site graph" not in explain_off, explain_off
    assert c_off.case_switches == 0
    switches = c_off.path_switches
    # auto: the first READ_RESTARTS of them restart, the rest are Case-Select puts
    assert site.read_restarts == policy.READ_RESTARTS, explain_auto
    assert c_auto.path_switches == policy.READ_RESTARTS, explain_auto
    assert c_auto.case_switches == switches - policy.READ_RESTARTS, explain_auto
    assert (c_auto.traces, c_auto.fallbacks) == (c_off.traces, c_off.fallbacks)
    # one build more than the path graphs: the site graph, over every compiled path (the
    # head that runs another head's graph over its own variables is a path of it too)
    assert c_auto.graph_builds == c_off.graph_builds + 1, explain_auto
    assert site.site_graph is not None
    compiled = [p for p in site.paths.values() if p.graph is not None and not p.stale]
    assert len(site.site_graph.paths) == len(compiled) == 3, explain_auto
    assert "site graph (switch_case / while_loop) for 3 paths" in explain_auto, explain_auto
    assert f"{policy.READ_RESTARTS} restarts cancelled runs Python had read values of" in \
        explain_auto, explain_auto


def test_restarts_that_waited_less_than_a_build_keep_the_path_graphs():
    """At the real price: each restart threw away well under a millisecond of this small
    trunk, far from the site graph's build, so the site keeps its path graphs; the restarts
    after a read are counted all the same."""
    got, c, explain, site = _run("auto")
    c.assert_counts(traces=5, fallbacks=2, graph_builds=3, path_switches=12, case_switches=0)
    assert site.read_restarts == 12 and not site.wants_site_graph and site.site_graph is None
    assert ", 12 restarts after a read (" in explain.splitlines()[-1], explain
    assert 0 < site.read_restart_s < policy.SITE_BUILD_FACTOR * sum(
        p.graph.build_seconds for p in site.paths.values() if p.graph is not None), explain


def test_exact_counts_of_the_read_then_branch_program(free_builds):
    """24 steps, 3 paths (one per head: the sigmoid head's first trace, recorded op by op, and
    its later ones, in skip mode, are one path, its output's `_keras_logits` keeping the call
    from being skipped as one unit), all compiled: 12 compiled iterations started on another
    path than the one Python took (the next path is predicted from the history of paths, which
    a random head leaves no better than a guess)."""
    _, c, _, _ = _run(False)
    c.assert_counts(traces=5, fallbacks=2, graph_builds=3, path_switches=12, case_switches=0)
    _, c, _, _ = _run("auto")
    c.assert_counts(traces=5, fallbacks=2, graph_builds=4, path_switches=3, case_switches=9)
    _, c, _, _ = _run(True)  # (a site graph over the first two compiled paths, then three)
    c.assert_counts(traces=5, fallbacks=2, graph_builds=5, path_switches=0, case_switches=12)


def test_a_path_compiled_after_the_site_graph_runs_its_own_graph_until_restarts_pay(
        free_builds):
    """A fourth head from step 20 on, after the site took its site graph over three paths: the
    site graph is kept (a rebuild lowers the whole site again), the new head's path runs its own
    graph, and a change of head to or from it is a restart. Its restarts after the read throw
    away well under a millisecond each here, far from the price of a rebuild, so the site graph
    stays over three paths; `site_graph=True` rebuilds it at once (three builds more)."""
    eager = read_then_branch(tf.GradientTape, steps=40, late_head=20)
    got, c, explain, site = _run("auto", steps=40, late_head=20)
    _equal(got, eager)
    c.assert_counts(traces=6, fallbacks=3, graph_builds=5, path_switches=9, case_switches=14)
    assert len(site.site_graph.paths) == 3, explain
    late = [p for p in site.paths.values() if p.graph is not None and not p.stale
            and site.site_graph.plan_of(p) is None]
    assert len(late) == 1, explain
    assert f"site graph kept over 3 paths: p{late[0].id} runs its own graph" in explain, explain
    # every restart after the site graph came involved the new head's path
    assert site.outside_restarts == 6 and site.read_restarts == 9, explain
    assert site.outside_restart_s < policy.SITE_REBUILD_FACTOR * site.site_graph.build_seconds
    got, c, explain, site = _run(True, steps=40, late_head=20)
    _equal(got, eager)
    c.assert_counts(traces=6, fallbacks=3, graph_builds=7, path_switches=0, case_switches=23)
    assert len(site.site_graph.paths) == 4 and "kept" not in explain, explain


def test_restarts_outside_the_site_graph_that_cost_a_rebuild_rebuild_it(free_builds,
                                                                       monkeypatch):
    """Priced at zero, the rebuild comes after READ_RESTARTS restarts that involved the new
    head's path: from then on the site graph covers four paths and every change of head is a
    Case-Select put."""
    monkeypatch.setattr(policy, "SITE_REBUILD_FACTOR", 0.0)
    eager = read_then_branch(tf.GradientTape, steps=40, late_head=20)
    got, c, explain, site = _run("auto", steps=40, late_head=20)
    _equal(got, eager)
    c.assert_counts(traces=6, fallbacks=3, graph_builds=6, path_switches=6, case_switches=17)
    assert len(site.site_graph.paths) == 4, explain
    assert site.outside_restarts == 0, explain  # (counted from the rebuild on)
    assert f"{policy.READ_RESTARTS} restarts after a read involved paths outside the site " \
        "graph" in explain, explain
    assert "site graph (switch_case / while_loop) for 4 paths" in explain, explain


def test_restarts_before_any_read_keep_the_path_graphs():
    """The same heads without the read: Python picks the head before the graph has computed
    anything it waits for, so restarts throw little away and no site graph is built."""
    eager = read_then_branch(tf.GradientTape, read=False)
    got, c, explain, site = _run("auto", read=False)
    _equal(got, eager)
    assert c.path_switches > policy.READ_RESTARTS, explain
    assert c.case_switches == 0
    assert site.read_restarts == 0 and site.site_graph is None, explain
    assert "restarts after a read" not in explain, explain
    assert "site graph" not in explain, explain


@pytest.mark.parametrize("value", [1, "yes", None, "Auto"])
def test_site_graph_takes_true_false_or_auto(value):
    with pytest.raises(TypeError, match="site_graph must be True, False or 'auto'"):
        terra.config(site_graph=value)
    for ok in (True, False, "auto"):
        old = terra.config(site_graph=ok)
        terra.config(**old)
