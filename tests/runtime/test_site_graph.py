"""Sites with several compiled paths run one lowered graph (terra/runtime/site_graph.py).

Each program takes a different path from one iteration to the next (a Python-random choice of
model branch, a data-dependent early exit, a generator of varying length, a loop with a varying
trip count). Each must equal eager (per-step losses, final variables) with `site_graph` on and
off; with it on, branches are taken by Case-Select / Loop-Cond puts (`case_switches`) and the
graph is restarted (`path_switches`) less often than with it off."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import random  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(site_graph=True)
    yield
    terra.reset()
    terra.config(**old)


def _data(steps, shape=(8, 4), seed=1):
    return np.random.default_rng(seed).normal(size=(steps,) + shape).astype(np.float32)


def _matrices(n, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.Variable(rng.normal(size=(4, 4)).astype(np.float32) * 0.5) for _ in range(n)]


def _sgd(tape, loss, variables, lr=0.05):
    grads = tape.gradient(loss, variables)
    for v, g in zip(variables, grads):
        if g is not None:
            v.assign_sub(lr * g)


# ------------------------------------------------------------------------------------ programs
def random_branch(Tape, steps=24):
    """A Keras trunk, then one of three heads chosen by Python's `random` per step."""
    keras.utils.set_random_seed(3)
    trunk = keras.layers.Dense(6, activation="tanh")
    heads = [keras.layers.Dense(1), keras.layers.Dense(1, activation="sigmoid"),
             keras.Sequential([keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1)])]
    inp = keras.Input((4,))
    for h in heads:
        h(trunk(inp))
    opt = keras.optimizers.SGD(0.05)
    X, Y = _data(steps), _data(steps, (8, 1), seed=2)
    rnd = random.Random(7)
    variables = trunk.trainable_variables + [v for h in heads for v in h.trainable_variables]
    opt.build(variables)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            head = heads[rnd.randrange(3)]
            out = head(trunk(X[i]))
            loss = tf.reduce_mean((out - Y[i]) ** 2)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        losses.append(float(loss))
    return losses, [v.numpy() for v in variables]


def sequential_heads(Tape, steps=24):
    """A Sequential trunk, then one of three Sequential heads of different widths, chosen by
    Python's `random`: each model's call loops over its layers (Keras' functional run), so the
    trunk's and the head's ops are two runs of one library loop, each from pass 0."""
    keras.utils.set_random_seed(4)
    trunk = keras.Sequential([keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(8, activation="tanh")])
    heads = [keras.Sequential([keras.layers.Dense(4 * (j + 1), activation="relu"),
                               keras.layers.Dense(1)]) for j in range(3)]
    inp = keras.Input((4,))
    for h in heads:
        h(trunk(inp))
    variables = trunk.trainable_variables + [v for h in heads for v in h.trainable_variables]
    opt = keras.optimizers.SGD(0.05)
    opt.build(variables)
    X, Y = _data(steps), _data(steps, (8, 1), seed=5)
    rnd = random.Random(13)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            h = trunk(X[i])
            loss = tf.reduce_mean((heads[rnd.randrange(3)](h) - Y[i]) ** 2)
        grads = tape.gradient(loss, variables)
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        losses.append(float(loss))
    return losses, [v.numpy() for v in variables]


def early_exit(Tape, steps=24):
    """A Python loop of ops that stops when the activations (read by Python) get large."""
    w, u = _matrices(2)
    X = _data(steps) * np.array([0.3, 1.0, 3.0], np.float32)[np.arange(steps) % 3, None, None]
    losses = []
    for i in range(steps):
        with Tape() as tape:
            h = tf.matmul(X[i], w)
            for _ in range(4):
                h = h + tf.tanh(tf.matmul(h, u))
                if float(tf.reduce_max(tf.abs(h))) > 3.0:
                    break
            loss = tf.reduce_mean(h * h)
        _sgd(tape, loss, [w, u], 0.01)
        losses.append(float(loss))
    return losses, [w.numpy(), u.numpy()]


def chunks(x, n):
    for j in range(n):
        yield x[j]


def generator(Tape, steps=24):
    """A generator yields a random number of data rows; each goes through the model."""
    w, u = _matrices(2, seed=4)
    X = _data(steps, (5, 4))
    rnd = random.Random(11)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.constant(0.0)
            for row in chunks(X[i], rnd.choice([2, 3, 4])):
                h = tf.tanh(tf.matmul(row[None, :], w))
                loss = loss + tf.reduce_sum(tf.matmul(h, u) ** 2)
        _sgd(tape, loss, [w, u])
        losses.append(float(loss))
    return losses, [w.numpy(), u.numpy()]


def trip_count(Tape, steps=24):
    """A loop of ops whose trip count Python draws per step."""
    w, u = _matrices(2, seed=5)
    X = _data(steps)
    rnd = random.Random(5)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            h = tf.matmul(X[i], w)
            for _ in range(rnd.choice([1, 2, 3])):
                h = tf.tanh(tf.matmul(h, u)) + h
            loss = tf.reduce_mean(h * h)
        _sgd(tape, loss, [w, u], 0.01)
        losses.append(float(loss))
    return losses, [w.numpy(), u.numpy()]


PROGRAMS = {"random_branch": random_branch, "early_exit": early_exit, "generator": generator,
            "trip_count": trip_count, "sequential_heads": sequential_heads}


def _assert_same(got, eager, what):
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-5, atol=1e-7, err_msg=f"{what}: losses")
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=f"{what}: variables")


def _terra_run(program, site_graph):
    terra.reset()
    terra.config(site_graph=site_graph)
    got = program(tf.TerraGradientTape)
    terra.end_iteration()
    return got, terra.stats(), terra.explain()


# name -> (restarts with path graphs; seamless switches, restarts with the site graph). With the
# site graph no switch restarts: in trip_count and early_exit the one-pass run shares the first
# pass of the unrolled longer runs (merge: a one-iteration run stays in line), so the paths part
# where Python ends the loop. With path graphs, a switch after early_exit's break goes straight
# to the path that breaks: the Mul Python issues takes no variable, so a path that expects the
# next pass's variable read there is not tried
SWITCHES = {
    # (the plain head's eager trace and its trace after a fallback inside its call are one
    # path, sites.borrowed_units: 3 paths, and mispredictions of the random head move)
    "random_branch": (13, 13, 0),
    "generator": (15, 15, 0),
    "trip_count": (18, 18, 0),
    "early_exit": (8, 8, 0),
    "sequential_heads": (11, 11, 0),  # (11, 0, 11) with the trunk and head one loop run
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_equal_to_eager_and_switches_without_restart(name):
    program = PROGRAMS[name]
    eager = program(tf.GradientTape)
    assert len(set(np.round(eager[0], 6))) > 1
    off, stats_off, explain_off = _terra_run(program, False)
    _assert_same(off, eager, f"{name} site_graph=False")
    on, stats_on, explain_on = _terra_run(program, True)
    _assert_same(on, eager, f"{name} site_graph=True")
    assert "site graph" not in explain_off
    assert "site graph (switch_case / while_loop) for" in explain_on, explain_on
    assert stats_off["case_switches"] == 0
    got = (stats_off["path_switches"], stats_on["case_switches"], stats_on["path_switches"])
    assert got == SWITCHES[name], (explain_on, explain_off)
    # most iterations ran in co-execution: the site graph covers every path taken
    assert stats_on["fallbacks"] <= stats_off["fallbacks"], (explain_on, explain_off)


def test_one_path_keeps_its_path_graph():
    """A site with one compiled path builds no site graph."""
    w, u = _matrices(2)
    X = _data(6)
    for i in range(6):
        with tf.TerraGradientTape() as tape:
            loss = tf.reduce_mean(tf.matmul(tf.matmul(X[i], w), u) ** 2)
        _sgd(tape, loss, [w, u])
        float(loss)
    terra.end_iteration()
    assert "site graph" not in terra.explain()
    assert terra.stats()["graph_builds"] == 1
    assert all(s.site_graph is None for s in SESSION.sites.values())


def test_kept_values_and_reads_of_earlier_visits():
    """Values kept past the iteration come from the site graph's fetch channels; reading an
    earlier visit of a node after a later one finds the value taken on the way."""
    w = _matrices(1, seed=8)[0]
    X = _data(16)
    rnd = random.Random(3)

    def run(Tape):
        w.assign(_matrices(1, seed=8)[0])
        kept, read = [], []
        for i in range(16):
            with Tape() as tape:
                hs = [tf.matmul(X[i], w)]
                for _ in range(rnd.choice([2, 3])):
                    hs.append(tf.tanh(hs[-1]) * 1.1)
                loss = tf.reduce_mean(hs[-1] ** 2)
            _sgd(tape, loss, [w])
            read.append([float(tf.reduce_sum(h)) for h in reversed(hs[1:])])
            kept.append(hs[1])
        return read, [k.numpy() for k in kept], w.numpy()

    rnd.seed(3)
    eager = run(tf.GradientTape)
    rnd.seed(3)
    got = run(tf.TerraGradientTape)
    terra.end_iteration()
    for a, b in zip(got[0], eager[0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], eager[2], rtol=1e-5, atol=1e-7)
    assert terra.stats()["case_switches"] == 5, terra.explain()


def test_config_site_graph_is_a_bool():
    with pytest.raises(TypeError, match="site_graph"):
        terra.config(site_graph=1)


@pytest.mark.parametrize("settings", [{"overlap_iterations": False}, {"coexecution": False}],
                         ids=["no_overlap", "lazy"])
def test_equal_to_eager_without_overlap_and_lazy(settings):
    eager = trip_count(tf.GradientTape, steps=16)
    old = terra.config(**settings)
    try:
        got, stats, explain = _terra_run(lambda T: trip_count(T, steps=16), True)
    finally:
        terra.config(**old)
    _assert_same(got, eager, f"trip_count {settings}")
    assert stats["case_switches"] == 12, explain


def _late_error(Tape, steps=14, bad=10):
    """Random branch per step; at step `bad` an out-of-range gather after the last sync point
    (it feeds a variable update only)."""
    w, u, v = _matrices(3, seed=9)
    table, shift = tf.Variable([1.0, 2.0, 3.0, 4.0]), tf.Variable(0.0)
    X = _data(steps)
    rnd = random.Random(2)
    losses, errors, at_error = [], [], None
    for i in range(steps):
        idx = (np.arange(100) % 4).astype(np.int32)
        if i == bad:
            idx[50] = 7
        try:
            with Tape() as tape:
                h = tf.matmul(X[i], w)
                h = tf.tanh(tf.matmul(h, u)) if rnd.random() < 0.5 else tf.nn.relu(tf.matmul(h, v))
                loss = tf.reduce_mean(h * h)
            losses.append(float(loss))
            _sgd(tape, loss, [w, u, v])
            shift.assign_add(tf.reduce_sum(tf.gather(table, idx)) * 1e-3)
        except tf.errors.InvalidArgumentError:
            errors.append(i)
            if at_error is None:
                at_error = [x.numpy() for x in (w, u, v, shift)]
    return losses, errors, at_error


def test_graph_error_after_the_last_sync_point():
    e_losses, e_errors, e_at = _late_error(tf.GradientTape)
    t_losses, t_errors, t_at = _late_error(tf.TerraGradientTape)
    terra.end_iteration()
    explain = terra.explain()
    assert e_errors == [10]
    assert len(t_errors) == 1 and t_errors[0] in (10, 11), (t_errors, explain)
    assert "site graph (switch_case" in explain and terra.stats()["case_switches"] > 0, explain
    for a, b in zip(t_at, e_at):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # losses read before the error are eager's; raised in iteration 11 (its first sync point,
    # the program had left iteration 10), that iteration's update never ran
    np.testing.assert_allclose(t_losses[:11], e_losses[:11], rtol=1e-5, atol=1e-7)
    if t_errors[0] == 10:
        np.testing.assert_allclose(t_losses, e_losses, rtol=1e-5, atol=1e-7)
    else:
        assert len(t_losses) == len(e_losses) - 1


@pytest.mark.slow
def test_paths_with_different_feature_map_sizes_in_a_residual_cnn():
    """SDPoint (benchmarks/programs/sdpoint.py, bench size): paths resize the feature map at a
    random block. Its site graph once aborted the process in TF's oneDNN layout pass (see
    `site_graph._no_remapper`); now it runs, equal to eager. Each point's two ratios are one
    shape group, lowered once: the site graph has the path graphs' traces and fallbacks, and a
    second ratio joins its group's graph speculatively built for it with no build of either."""
    from benchmarks.programs import sdpoint

    steps = 16
    p = sdpoint.build(tf.GradientTape)
    eager = [float(p.step(i)) for i in range(steps)]
    keys = ("traces", "fallbacks", "speculations", "speculation_hits", "graph_builds",
            "case_switches", "path_switches")
    counts = {}
    for on in (False, True):
        terra.reset()
        terra.config(site_graph=on)
        p = sdpoint.build(tf.TerraGradientTape)
        got = [float(p.step(i)) for i in range(steps)]
        terra.end_iteration()
        counts[on] = tuple(terra.stats()[k] for k in keys)
        # (graph and eager kernels round apart from step 7 on; training amplifies it)
        np.testing.assert_allclose(got[:10], eager[:10], rtol=1e-4)
    explain = terra.explain()
    assert "graph error" not in explain and "run failed" not in explain, explain
    # (iteration 9's trace is the no-downsampling path's second sighting since it borrows
    # that path's units, sites.borrowed_units: iteration 10 then starts on p2, the path
    # predicted, and reaches p4 through p1: two switches, where a path of its own took one)
    assert counts[False] == (12, 7, 3, 3, 5, 0, 9), counts
    # (with p1 in the site graph from iteration 9 on, iteration 10 reaches it by a case switch
    # and leaves it for p4 at op #237 by a restart: one path switch)
    assert counts[True] == (12, 7, 3, 3, 9, 8, 1), (counts, explain)
    (site,) = SESSION.sites.values()
    assert [p.id for p in site.site_graph.paths].count(-1) == 4, explain


def test_a_rebuild_for_a_new_path_merges_only_its_trace(monkeypatch):
    """When a site gains a path, its TraceGraph is the last build's extended with the new
    path's trace (not every trace merged again), and is the graph a full merge gives."""
    from terra.compiler.merge import merge, shape_key
    from terra.runtime import site_graph as site_graph_mod
    builds = []
    init = site_graph_mod.SiteGraph.__init__

    def recording(self, paths, timed=True, previous=None):
        init(self, paths, timed, previous)
        builds.append((len(paths), self.merged_traces, self))

    monkeypatch.setattr(site_graph_mod.SiteGraph, "__init__", recording)
    eager = random_branch(tf.GradientTape)
    got = random_branch(tf.TerraGradientTape)
    terra.end_iteration()
    _assert_same(got, eager, "random_branch")
    assert [(n, k) for n, k, _ in builds] == [(2, 2), (3, 1)], terra.explain()
    last = builds[-1][2]
    full = None
    for t in last.traces:
        full = merge(full, t)
    assert shape_key(full) == shape_key(last.lowered.graph)


def test_joined_order_puts_the_last_builds_paths_first():
    """A rebuild lists the last build's paths first, in its order, so its TraceGraph extends
    the last one (on sdpoint a path first seen before the site compiled, and compiled late,
    came first in the site's order: 3 of 9 rebuilds merged every trace again)."""
    from terra.runtime.site_graph import joined_order

    class P:
        pass
    a, b, c, d = P(), P(), P(), P()

    class Previous:
        paths = [c, a]
    assert joined_order([a, b, c, d], Previous) == [c, a, b, d]
    assert joined_order([a, b, d], Previous) == [a, b, d]
    assert joined_order([b, a], None) == [b, a]


def test_with_background_builds_the_site_graph_is_built_on_the_builder_thread():
    """With `background_builds` the site graph is built off the program's thread too, and put in
    place at an iteration boundary; the program equals eager whichever graphs it ran on."""
    eager = random_branch(tf.GradientTape)
    old = terra.config(background_builds=True)
    try:
        got = random_branch(tf.TerraGradientTape)
        terra.end_iteration()
        for _ in range(4):  # a finished path build submits the site graph's
            assert terra.wait_builds(timeout=600)
    finally:
        terra.config(**old)
    _assert_same(got, eager, "random_branch with background builds")
    log = terra.explain()
    (site,) = SESSION.sites.values()
    compiled = [p for p in site.paths.values() if p.graph is not None and not p.stale]
    assert site.site_graph is not None and len(compiled) >= 2
    assert sorted(id(p) for p in site.site_graph.paths) == sorted(id(p) for p in compiled), log
    assert f"site graph (switch_case / while_loop) for {len(compiled)} paths" in log, log
    assert "on the builder thread, in use from iteration" in log, log
    assert "no site graph" not in log, log


# ------------------------------------------------------------------------ commit-gated writes
@pytest.fixture
def takes(monkeypatch):
    """How many variable snapshots were taken (before runs, or by an early commit)."""
    from terra.runtime import fallback
    count = [0]
    original = fallback.Snapshot.take

    def take(self):
        count[0] += 1
        return original(self)
    monkeypatch.setattr(fallback.Snapshot, "take", take)
    return count


def _site_graph():
    (site,) = SESSION.sites.values()
    assert site.site_graph is not None, terra.explain()
    return site.site_graph.lowered


def _counts():
    st = terra.stats()
    return {k: st[k] for k in ("traces", "fallbacks", "graph_builds", "case_switches",
                               "path_switches")}


def random_write_branch(Tape, steps=24):
    """One of two branches per step, by Python's `random`; one of them adds to a counter
    variable and then gathers by a fed index (a failing op after a write, inside a branch)."""
    w, u = _matrices(2, seed=6)
    counter, table = tf.Variable(0.0), tf.constant([1.0, 2.0, 3.0])
    X = _data(steps)
    rnd = random.Random(9)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean(tf.tanh(tf.matmul(tf.matmul(X[i], w), u)) ** 2)
            if rnd.random() < 0.5:
                counter.assign_add(1.0)
                loss = loss * tf.gather(table, np.array([i % 3], np.int32))[0]
        _sgd(tape, loss, [w, u])
        losses.append(float(loss))
    return losses, [w.numpy(), u.numpy(), counter.numpy()]


@pytest.mark.parametrize("name, gated", [("random_branch", True), ("generator", True),
                                         ("random_write_branch", False)])
def test_site_graph_writes_wait_for_the_commit_where_the_graph_allows(takes, name, gated):
    """Each site-graph run writes only once Python has ended its iteration on a compiled path,
    so no run takes a snapshot, with the same counts as with snapshots. A branch that writes
    and then may fail (random_write_branch) leaves the graph ungated: snapshots as before."""
    program = {**PROGRAMS, "random_write_branch": random_write_branch}[name]
    eager = program(tf.GradientTape)
    old = terra.config(commit_writes=False)
    try:
        snap, snap_stats, _ = _terra_run(program, True)
        snap_counts, snap_takes = _counts(), takes[0]
    finally:
        terra.config(**old)
    takes[0] = 0
    got, stats, explain = _terra_run(program, True)
    _assert_same(snap, eager, f"{name} commit_writes=False")
    _assert_same(got, eager, name)
    assert _counts() == snap_counts, explain
    assert stats["case_switches"] > 0, explain
    assert (_site_graph().commit_channel is not None) == gated, explain
    # (a run without the commit channel snapshots on the runner's thread when it starts; one
    # cancelled before it started takes none, so those counts depend on timing)
    assert snap_takes > 0 and stats["commit_snapshots"] == 0, explain
    if gated:
        assert takes[0] == 0, explain
    else:  # its site graph's runs snapshot; its path graphs' runs (gated) do not
        assert takes[0] > 0, explain


def _read_written(Tape, steps=24):
    """random_branch with a read of an updated weight at the end of every iteration."""
    reads = []
    keras.utils.set_random_seed(3)
    trunk = keras.layers.Dense(6, activation="tanh")
    heads = [keras.layers.Dense(1), keras.layers.Dense(1, activation="sigmoid")]
    X, Y = _data(steps), _data(steps, (8, 1), seed=2)
    rnd = random.Random(7)
    trunk.build((None, 4))
    for h in heads:
        h.build((None, 6))
    variables = trunk.trainable_variables + [v for h in heads for v in h.trainable_variables]
    losses = []
    for i in range(steps):
        with Tape() as tape:
            out = heads[rnd.randrange(2)](trunk(X[i]))
            loss = tf.reduce_mean((out - Y[i]) ** 2)
        _sgd(tape, loss, variables)
        losses.append(float(loss))
        reads.append(float(trunk.kernel[0, 0]))
    return losses + reads, [v.numpy() for v in variables]


def test_a_read_of_a_written_value_commits_the_site_graph_run_early(takes):
    """Python reads an updated weight before the iteration ends: that fetch waits for the
    commit, so the run commits early, after a snapshot, once per compiled iteration."""
    eager = _read_written(tf.GradientTape)
    got, stats, explain = _terra_run(_read_written, True)
    _assert_same(got, eager, "read_written")
    lowered = _site_graph()
    assert lowered.commit_channel is not None and lowered.commit_dependent, explain
    assert stats["case_switches"] > 0, explain
    assert takes[0] == stats["commit_snapshots"] == 24 - stats["traces"] == 20, explain


def _branch_error(Tape, steps=14, bad=10):
    """Random branch per step; one branch gathers columns by a fed index, out of range at step
    `bad` (forced into that branch); the update follows. Returns the losses, the error's step
    and line, and the variables when it was raised."""
    import traceback
    w, u, v = _matrices(3, seed=12)
    X = _data(steps)
    rnd = random.Random(4)
    losses, errors, at_error = [], [], None
    for i in range(steps):
        idx = np.array([0, 1, 2, 3], np.int32)
        if i == bad:
            idx[2] = 9
        try:
            with Tape() as tape:
                h = tf.matmul(X[i], w)
                if rnd.random() < 0.5 or i == bad:
                    h = tf.gather(tf.tanh(tf.matmul(h, u)), idx, axis=1)  # fails at `bad`
                else:
                    h = tf.nn.relu(tf.matmul(h, v))
                loss = tf.reduce_mean(h * h)
            losses.append(float(loss))
            _sgd(tape, loss, [w, u, v])
        except tf.errors.InvalidArgumentError as e:
            here = [f.lineno for f in traceback.extract_tb(e.__traceback__)
                    if f.filename == __file__]
            errors.append((i, type(e), here[-1], str(e)))
            if at_error is None:
                at_error = [x.numpy() for x in (w, u, v)]
    return losses, errors, at_error


def test_an_error_inside_a_branch_of_the_gated_site_graph_is_eagers(takes):
    """The gather inside a `switch_case` branch fails in a site-graph run: the run wrote
    nothing (its writes wait for the commit, and the commit for the gather), the iteration
    replays eagerly and raises eager's exception type in the same iteration, with eager's state;
    its message names eager's line, and so does its traceback's last program frame (raised at
    the sync point that found the failure, after Python had passed the gather, it ends in an
    entry for the gather's line: runtime/user_traceback.py)."""
    eager = _branch_error(tf.GradientTape)
    got = _branch_error(tf.TerraGradientTape)
    terra.end_iteration()
    explain = terra.explain()
    ((step, kind, line, _),) = eager[1]
    ((got_step, got_kind, got_line, message),) = got[1]
    assert (got_step, got_kind) == (step, kind) == (10, tf.errors.InvalidArgumentError)
    assert f"GatherV2 recorded at test_site_graph.py:{line} " in message, message
    assert got_line == line, got_line
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(got[2], eager[2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    lowered = _site_graph()
    assert lowered.commit_channel is not None, explain
    assert terra.stats()["case_switches"] > 0 and "graph error" in explain, explain
    # no run snapshotted before it started; the only snapshots are early commits where a
    # path graph's run is waited for at its path's last op (`Iteration.wait_run`)
    assert takes[0] == terra.stats()["commit_snapshots"], explain


def test_the_heads_updates_fuse_into_one_switch_case_per_stretch(takes):
    """sequential_heads: the SGD update writes each head's variables in a switch-case of its
    own, between shared blocks (a library loop and a `Mul`), all following the head's select;
    fused (compiler/fuse.py) the site graph has 2 `switch_case` ops, not 5, stays gated (no
    snapshot per run) and equal to eager."""
    from terra.compiler.lower import lower
    eager = sequential_heads(tf.GradientTape)
    got, stats, explain = _terra_run(sequential_heads, True)
    _assert_same(got, eager, "sequential_heads")
    lw = _site_graph()
    (site,) = SESSION.sites.values()
    unfused = lower(lw.graph, site.site_graph.traces, commit=True, shapes_known=True, fuse=0)
    (run,) = lw.runs
    assert (run.width, len(run.members)) == (3, 7) and run.driver < run.members[0], lw.describe()
    assert (lw.stats["switch_case_ops"], unfused.stats["switch_case_ops"]) == (2, 5)
    assert lw.stats["tf_ops"] < unfused.stats["tf_ops"]
    assert lw.commit_channel is not None and unfused.commit_channel is not None, explain
    assert (stats["case_switches"], stats["path_switches"]) == SWITCHES["sequential_heads"][1:]
    assert takes[0] == stats["commit_snapshots"] == 0, explain


def test_a_random_depth_among_thirteen_is_one_site_graph():
    """A Python-random depth among 13 (a loop of 0-12 passes; 12 of them drawn in 40 steps):
    equal to eager with path graphs and with the site graph. With path graphs every change of
    depth restarts (40); the site graph, rebuilt as paths are compiled (10 of them in it at
    the end), switches by Case-Select every time (40): an op recorded through TF's fast path
    on one path and through its eager fallback on another (an input not computed yet) has one
    location (tracing/locations.py), so two paths share their nodes up to where they part
    (with two locations: 5 restarts)."""
    from tests.runtime.test_new_paths import _random_depth
    eager = _random_depth(tf.GradientTape, 13, steps=40)
    assert len(set(eager[2])) == 12
    keys = ("traces", "new_paths", "graph_builds", "fallbacks", "path_switches",
            "case_switches")
    counts = {}
    for on in (False, True):
        terra.reset()
        terra.config(site_graph=on)
        got = _random_depth(tf.TerraGradientTape, 13, steps=40)
        terra.end_iteration()
        assert got[0] == eager[0] and np.array_equal(got[1], eager[1]), on
        counts[on] = tuple(terra.stats()[k] for k in keys)
    explain = terra.explain()
    assert counts[False] == (17, 12, 10, 13, 40, 0), counts
    assert counts[True] == (17, 12, 19, 13, 0, 40), (counts, explain)
    assert "site graph over 10 paths" in explain, explain


def random_resize(Tape, steps=24):
    """SDPoint in small: each step Python's `random` picks where the feature map is resized
    (nowhere, before the first convolution or before the second) and by how much (0.5 or
    0.75 of its 12 x 12), so the paths at one point differ only in the size and the shapes and
    constants made from it (the mean's count, the gradient's shapes)."""
    rnd = random.Random(5)
    w1 = tf.Variable(tf.random.stateless_normal([3, 3, 2, 4], [1, 2]) * 0.3)
    w2 = tf.Variable(tf.random.stateless_normal([3, 3, 4, 3], [3, 4]) * 0.3)
    x = tf.random.stateless_normal([2, 12, 12, 2], [5, 6])
    losses = []
    for _ in range(steps):
        point, ratio = rnd.choice([None, 1, 2]), rnd.choice([0.5, 0.75])
        with Tape() as tape:
            h = x
            for k, w in ((1, w1), (2, w2)):
                if k == point:
                    n = int(h.shape[1] * ratio)
                    h = tf.image.resize(h, (n, n))
                h = tf.nn.tanh(tf.nn.conv2d(h, w, 1, "SAME"))
            loss = tf.reduce_mean(h ** 2)
        _sgd(tape, loss, [w1, w2])
        losses.append(float(loss))
    return losses, [w1.numpy(), w2.numpy()]


def test_shape_groups_are_one_case_each_in_the_site_graph():
    """A random resize point and ratio (`random_resize`): equal to eager with path graphs and
    with the site graph, and with the same traces, fallbacks and path builds. Each point's two
    ratios are one shape group, lowered once into the site graph (its relaxed trace, the
    member putting its own shape constants): the second ratio joins its group's graph with
    no build, path graph or site graph."""
    eager = random_resize(tf.GradientTape)
    keys = ("traces", "new_paths", "fallbacks", "speculations", "speculation_hits",
            "graph_reuses", "graph_builds", "path_switches", "case_switches")
    counts = {}
    for on in (False, True):
        terra.reset()
        terra.config(site_graph=on)
        got = random_resize(tf.TerraGradientTape)
        terra.end_iteration()
        assert got[0] == eager[0], on
        assert all(np.array_equal(a, b) for a, b in zip(got[1], eager[1])), on
        counts[on] = dict((k, terra.stats()[k]) for k in keys)
    explain = terra.explain()
    same = {"traces": 6, "new_paths": 5, "fallbacks": 4, "speculations": 1,
            "speculation_hits": 0, "graph_reuses": 0}
    # path graphs: 5 builds (the no-resize path, each group twice as it gains its second
    # ratio, the other point's first ratio speculatively); the site graph adds 3 site builds
    assert counts[False] == {**same, "graph_builds": 5, "path_switches": 22,
                             "case_switches": 0}, counts
    assert counts[True] == {**same, "graph_builds": 8, "path_switches": 0,
                            "case_switches": 22}, (counts, explain)
    (site,) = SESSION.sites.values()
    lowered = site.site_graph.paths
    assert sorted(p.id for p in lowered) == [-1, -1, 3], explain
    groups = [g for g in site.shape_groups if g.path in lowered]
    assert [len(g.members) for g in groups] == [2, 2], explain
    # two ratios at one point: a seamless switch between two members of one group
    assert "in the site graph: different constant" in explain, explain
    # the runtime puts the shape constants: their channels do not time the graph's wait for
    # Python (3 Python feed points of the one input, 4 constant feed points)
    timed = sorted(ch.timed for ch in site.site_graph.lowered.feeds.values())
    assert timed == [False] * 4 + [True] * 3, explain


@pytest.mark.parametrize("settings", [{"overlap_iterations": False}, {"coexecution": False}],
                         ids=["no_overlap", "lazy"])
def test_shape_groups_in_the_site_graph_without_overlap_and_lazy(settings):
    eager = random_resize(tf.GradientTape)
    old = terra.config(**settings)
    try:
        got, stats, explain = _terra_run(random_resize, True)
    finally:
        terra.config(**old)
    assert got[0] == eager[0], explain
    assert all(np.array_equal(a, b) for a, b in zip(got[1], eager[1])), explain
    got = tuple(stats[k] for k in ("traces", "fallbacks", "graph_builds", "case_switches",
                                   "path_switches"))
    assert got == (6, 4, 8, 22, 0), explain
    assert "site graph over 3 paths" in explain, explain


def test_shape_groups_in_the_site_graph_with_background_builds():
    """`random_resize` with `background_builds`: the site graph, built on the builder thread,
    lowers each shape group once, and the program equals eager whichever graphs it ran on."""
    from terra.runtime.site_graph import site_paths
    eager = random_resize(tf.GradientTape)
    old = terra.config(background_builds=True)
    try:
        got = random_resize(tf.TerraGradientTape)
        terra.end_iteration()
        for _ in range(4):  # a finished path build submits the site graph's
            assert terra.wait_builds(timeout=600)
    finally:
        terra.config(**old)
    assert got[0] == eager[0]
    assert all(np.array_equal(a, b) for a, b in zip(got[1], eager[1]))
    log = terra.explain()
    (site,) = SESSION.sites.values()
    assert site.site_graph is not None, log
    assert [id(p) for p in site.site_graph.paths] == [id(p) for p in site_paths(site)], log
    assert any(p.id == -1 for p in site.site_graph.paths), log


def test_a_unit_reading_a_value_it_computes_keeps_the_paths_on_their_graphs():
    """Keras' `LossScaleOptimizer.apply_gradients` reads the finite check it computes itself
    (a read at the unit's start of a value past it). Once the skipped update is a path, the two
    paths part inside the unit: on a site graph the read would wait for the Case-Select Python
    puts only past the unit (it timed out), so that site graph is not built (`ReadAhead`) and the
    paths switch by restarting. Equal to eager, with the path graphs' traces and fallbacks (and
    the site graph of the first two paths, which part after the unit)."""
    from tests.counting import CompileCounter
    from tests.e2e.test_unit_reads import _equal, _loss_scaled
    old = terra.config(timeout_s=30.0)
    try:
        eager = _loss_scaled(tf.GradientTape)
        with CompileCounter() as c:
            got = _loss_scaled(tf.TerraGradientTape)
    finally:
        terra.config(**old)
    _equal(got, eager)
    explain = terra.explain()
    # (as in test_unit_reads, iteration 30's path is not built, nor the site graph tried over
    # it: its filing waits for a next iteration, which does not come; runtime/filing.py)
    c.assert_counts(traces=6, graph_builds=4, fallbacks=3)
    assert explain.count("no site graph for") == 1, explain
    assert "ReadAhead: path p2 reads %182 at op #42, inside a unit, before an event of the " \
           "site graph due at op #52" in explain, explain


def episodes(Tape, steps=24):
    """Episodes of a Python-random length (2-4 steps), each step fed its own state; the loss
    weighs each step by its normalized return, which Python computes per episode: a constant
    of the trace whose values differ between paths (actor_critic's returns)."""
    w, u = _matrices(2, seed=4)
    X = _data(steps * 4, shape=(1, 4), seed=5)
    rnd = random.Random(3)
    losses, k = [], 0
    for i in range(steps):
        n = rnd.randrange(2, 5)
        with Tape() as tape:
            values = []
            for _ in range(n):
                values.append(tf.reduce_sum(tf.tanh(tf.matmul(X[k], w)) @ u))
                k += 1
            rewards = np.arange(1, n + 1, dtype=np.float64) * (1 + i % 3)
            returns = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
            loss = 0.0
            for r, v in zip(returns, values):
                loss = loss + (v - float(r)) ** 2
        _sgd(tape, loss, [w, u], lr=0.01)
        losses.append(float(loss))
    return losses, [w.numpy(), u.numpy()]


@pytest.mark.parametrize("fed", [True, False])
def test_constants_that_differ_between_paths_are_put_by_the_plan(monkeypatch, fed):
    """The returns of the first episode of each length are constants of its path's trace
    (later ones were generalized into feeds); the site graph feeds them and each path's plan
    puts its own (terra/compiler/site_constants.py), so the paths share the loss's ops.
    Without that (`fed=False`): 5 more nodes (and about 140 more TF ops). Equal to eager
    either way, bit for bit."""
    from terra.runtime import site_graph as sg_mod
    if not fed:
        monkeypatch.setattr(sg_mod, "feed_constants", lambda traces, places=None: (
            list(traces), [{} for _ in traces]))
    eager = episodes(tf.GradientTape)
    got = episodes(tf.TerraGradientTape)
    terra.end_iteration()
    assert got[0] == eager[0] and all(np.array_equal(a, b) for a, b in zip(got[1], eager[1]))
    assert _counts() == {"traces": 7, "fallbacks": 4, "graph_builds": 9, "case_switches": 22,
                         "path_switches": 0}
    (site,) = SESSION.sites.values()
    sg = site.site_graph
    assert [len(p) for p in sg.puts] == ([2, 0, 3, 0, 0] if fed else [0] * 5)
    assert sg.lowered.stats["nodes"] == (98 if fed else 103)
