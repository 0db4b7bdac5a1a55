"""Feeds and fetches in adversarial orders: no deadlock, bounded time, values equal eager.

The program runs a loop whose trip count and per-iteration branch Python chooses; every
iteration fetches the running value, computes the next feed from it in NumPy (a fetch-then-feed
dependency, Figure 3.4) and takes a branch (a Case-Select inside a while_loop body). The driver
plays the Python side with random sleeps before its actions (patterns: before every action,
only before puts so the graph starves, only before gets so the graph runs ahead), computing every
fed value from what it actually fetched. Every wait is bounded (a hang fails with
TerraTimeoutError); losses and variables must stay bit-identical to eager.
"""
import os
import random
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.compiler.driver import (GraphRunnerNoGrappler, drive, record,  # noqa: E402
                                  remap_variables, twin_run, variable_keys)
from terra.compiler.lower import lower  # noqa: E402
from terra.compiler.merge import merge  # noqa: E402
from terra.errors import TerraTimeoutError  # noqa: E402


class Vars:
    def __init__(self):
        rng = np.random.default_rng(7)
        self.v = tf.Variable(rng.normal(size=(3, 3)).astype("float32") * 0.3)
        self.w = tf.Variable(rng.normal(size=(3,)).astype("float32") * 0.3)
        self.variables = [self.v, self.w]


def _next_feed(k, p):
    return (np.tanh(k) * 0.5 if p == 0 else np.cos(k) * 0.25).astype("float32")


def step_stress(s, x, paths):
    h = tf.matmul(x, s.v)
    fed = []
    for p in paths:
        k = h.numpy()  # fetch ...
        arr = _next_feed(k, p)
        c = tf.constant(arr)  # ... and feed back what NumPy made of it
        fed.append((arr, p))
        if p == 0:
            h = tf.tanh(h) * c + s.w
        else:
            h = tf.sin(h) + c
            s.w.assign_add(tf.reduce_mean(h, axis=0) * 1e-2)
        h = h * 0.9  # one producer of the loop-carried value (the merge folds only such loops)
    s.v.assign_add(tf.ones_like(s.v) * tf.reduce_mean(h, axis=[0, 1]) * 1e-2)
    loss = tf.reduce_sum(h, axis=[0, 1])
    float(loss)
    return loss, fed


def feed_back(trace, out):
    """slot -> value computed from the graph's own fetch of the same iteration."""
    _, fed = out
    refs = [(f.ref.record, f.ref.index) for f in trace.fetches if f.how == "numpy"]
    assert len(refs) == len(fed)
    table = {}
    for (c, p), ref in zip(fed, refs):
        (slot,) = [k for k, v in enumerate(trace.feed_values) if v is c]
        table[slot] = lambda fetched, ref=ref, p=p: _next_feed(fetched[ref], p)
    return table


def _configs(seed, n):
    rng = np.random.default_rng(seed)
    warm = [[0], [1, 0], [0, 1, 1], [1]]  # both branches, several trip counts: a while_loop
    out = []
    for i in range(n):
        paths = warm[i] if i < len(warm) else list(rng.integers(0, 2, size=rng.integers(1, 6)))
        out.append((tf.constant(rng.normal(size=(2, 3)).astype("float32")),
                    [int(p) for p in paths]))
    return out


def _delay(pattern, seed):
    rnd = random.Random(seed)
    state = {"n": 0}

    def delay():
        state["n"] += 1
        if pattern == "all" or (pattern == "alternate" and state["n"] % 2):
            time.sleep(rnd.uniform(0, 0.003))
    return delay


@pytest.mark.parametrize("pattern", ["none", "all", "alternate"])
def test_adversarial_python_timing_no_deadlock(pattern):
    t0 = time.perf_counter()
    run = twin_run(Vars, step_stress, _configs(11, 14), variables=lambda s: s.variables,
                   loss_of=lambda out: out[0], feed_back=feed_back,
                   delay=_delay(pattern, 3), timeout=20.0)
    assert run.driven >= 8, (run.driven, run.lowerings)
    assert run.lowered.loop_conds and run.lowered.case_selects
    round_trips = sum(len(f) for f in run.fetched)
    assert round_trips >= 3 * run.driven
    assert time.perf_counter() - t0 < 120


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_adversarial_python_timing_many_seeds(seed):
    run = twin_run(Vars, step_stress, _configs(100 + seed, 30), variables=lambda s: s.variables,
                   loss_of=lambda out: out[0], feed_back=feed_back,
                   delay=_delay("all", seed), timeout=20.0)
    assert run.driven >= 20


def test_a_wait_that_cannot_be_served_fails_in_bounded_time():
    """Python waiting on a fetch whose Loop-Cond it never put: TerraTimeoutError, not a hang;
    the run is cancelled and the channels are usable again."""
    s = Vars()
    rng = np.random.default_rng(1)
    traces, g = [], None
    for paths in ([0, 1], [1]):
        t, _ = record(step_stress, s, tf.constant(rng.normal(size=(2, 3)).astype("float32")),
                      paths)
        traces.append(t)
        g = merge(g, t)
    lw = lower(g, traces)
    runner = GraphRunnerNoGrappler()
    run = runner.start(lw.function)
    (fetch,) = [ch for (n, i), ch in lw.fetches.items() if lw.graph.nodes.get(n) is None]
    t0 = time.perf_counter()
    with pytest.raises(TerraTimeoutError):
        runner.fetch(fetch, timeout=0.5)
    assert time.perf_counter() - t0 < 5
    runner.cancel(timeout=10)
    assert run.done and run.state == "cancelled"
    lw.drain()
    # the same graph and channels then run a full iteration, equal to eager on a twin
    twin = Vars()
    for a, b in zip(twin.variables, s.variables):
        a.assign(b)
    x = tf.constant(rng.normal(size=(2, 3)).astype("float32"))
    t, (loss, _) = record(step_stress, twin, x, [0, 1])
    t = remap_variables(t, dict(zip(variable_keys(twin.variables), variable_keys(s.variables))))
    res = drive(lw, t, runner=runner, timeout=20)
    assert loss.numpy() in [v for v in res.fetched.values() if v.shape == ()]
    for a, b in zip(twin.variables, s.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
