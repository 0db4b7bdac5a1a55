"""Lowering of each TraceGraph construct, on small programs of raw TF ops, against eager.

Every program runs on two twins (`twin_run`): eager, and through the lowered graph driven by the
Python side of the same iteration; losses fetched from the graph and all variables must be
bit-identical to eager after every iteration.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.compiler.driver import (drive, plan, record, remap_variables, twin_run,  # noqa: E402
                                  variable_keys)
from terra.compiler.lower import TOP, lower  # noqa: E402
from terra.compiler.merge import merge  # noqa: E402
from terra.ir.records import ConstRef  # noqa: E402


class Vars:
    def __init__(self, **shapes):
        rng = np.random.default_rng(42)
        for name, shape in shapes.items():
            setattr(self, name, tf.Variable(rng.normal(size=shape).astype("float32") * 0.3))
        self.variables = [getattr(self, n) for n in shapes]


def _x(rng, shape=(2, 3)):
    return tf.constant(rng.normal(size=shape).astype("float32"))


def _run(build, step, configs, **kw):
    return twin_run(build, step, configs, variables=lambda s: s.variables, **kw)


def _all_ops(concrete):
    gd = concrete.graph.as_graph_def()
    return list(gd.node) + [n for f in gd.library.function for n in f.node_def]


# ------------------------------------------------------------------ switch_case and while_loop
def step_branch_loop(s, x, path, n):
    h = tf.matmul(x, s.v)
    if path == 0:
        h = tf.nn.relu(h)
    else:
        h = tf.tanh(h) * 2.0
    for _ in range(n):
        h = tf.sin(h) + h
    loss = tf.reduce_sum(h)
    s.v.assign_sub(0.01 * tf.ones_like(s.v) * loss)
    float(loss)
    return loss


def test_switch_case_and_while_loop_equal_eager():
    rng = np.random.default_rng(0)
    # (0, 3) is covered by the first two traces: lowering 1 unrolls both loops (one trip count
    # each); (0, 4) and (1, 1) fall back and turn them into while_loops (lowerings 2 and 3).
    cfgs = [(0, 2), (1, 3), (0, 3), (0, 4), (1, 1), (0, 5), (1, 2), (0, 1), (1, 4)]
    run = _run(lambda: Vars(v=(3, 3)), step_branch_loop, [(_x(rng), p, n) for p, n in cfgs])
    assert run.lowerings == 3 and run.driven == 4
    lw = run.lowered
    assert lw.stats["switch_case_ops"] == 1 and lw.stats["while_ops"] == 2
    assert len(lw.case_selects) == 1 and len(lw.loop_conds) == 2 and len(lw.fetches) == 1
    text = lw.describe()
    assert "switch_case" in text and "while_loop (Loop-Cond)" in text


def test_loop_with_one_trip_count_is_unrolled():
    rng = np.random.default_rng(1)
    cfgs = [(0, 2), (1, 2), (0, 2), (1, 2), (0, 2)]
    run = _run(lambda: Vars(v=(3, 3)), step_branch_loop, [(_x(rng), p, n) for p, n in cfgs])
    lw = run.lowered
    assert run.driven == 2 and lw.stats["while_ops"] == 0 and not lw.loop_conds
    # one loop node per branch, both x2 (and TF's own conversion loop, x1)
    assert sorted(t for t in lw.unrolled.values() if t > 1) == [2, 2]


def step_nested(s, x, n, m):
    h = tf.matmul(x, s.v)
    for _ in range(n):
        h = h * 0.9
        for _ in range(m):
            h = tf.sin(h) + h
    loss = tf.reduce_sum(h)
    s.v.assign_add(tf.ones_like(s.v) * 1e-3 * loss)
    float(loss)
    return loss


def test_nested_while_loops():
    rng = np.random.default_rng(2)
    cfgs = [(2, 1), (1, 3), (1, 3), (3, 2), (2, 2), (1, 1)]
    run = _run(lambda: Vars(v=(3, 3)), step_nested, [(_x(rng), n, m) for n, m in cfgs])
    # the first two traces both add to the TraceGraph, so each loop has two trip counts: while
    assert run.lowerings == 1 and run.driven == 3 and run.lowered.stats["while_ops"] == 2


# ----------------------------------------------------------------------- paths that end early
def step_early_end(s, x, stop):
    h = tf.matmul(x, s.v)
    loss = tf.reduce_sum(h)
    s.v.assign_sub(0.01 * tf.ones_like(s.v))
    if stop:
        float(loss)
        return loss
    s.w.assign_add(tf.reduce_mean(h) * tf.ones_like(s.w))
    loss = loss + tf.reduce_sum(s.w)
    float(loss)
    return loss


def test_default_branch_for_paths_that_reached_end():
    rng = np.random.default_rng(3)
    flags = [True, False, True, False, True, True, False]
    run = _run(lambda: Vars(v=(3, 3), w=(2,)), step_early_end, [(_x(rng), f) for f in flags])
    assert run.driven == 4
    top = run.lowered.levels[TOP]
    assert any(top.default), top  # a switch-case that finished paths skip: extra default branch
    k = top.default.index(True)
    assert len(top.switch_cases[k].cases) == 1 and top.has_op[k]


# ------------------------------------------------------------------------------------ phis
def step_phi_shapes(s, x, path):
    if path == 0:
        h = tf.tanh(x[:, :2])
    else:
        h = tf.sin(x)
    loss = tf.reduce_sum(h) + tf.reduce_sum(s.v)  # input is a phi; its shape differs by path
    s.v.assign_add(loss * tf.ones_like(s.v))
    float(loss)
    return loss


def test_phi_with_different_shapes():
    rng = np.random.default_rng(4)
    paths = [0, 1, 0, 1, 1, 0]
    run = _run(lambda: Vars(v=(2,)), step_phi_shapes, [(_x(rng), p) for p in paths])
    assert run.driven == 3
    phis = [n for n in run.graph.op_nodes if n.phis]
    assert phis, "the program should merge into a phi"


# ------------------------------------------------------------------------- stateful order
def step_stateful(s, x, path, n):
    mx = tf.reduce_mean(x, axis=[0, 1])  # explicit axes: constants, not NumPy feeds
    s.v.assign(s.v * 2.0)
    if path == 0:
        s.v.assign_add(tf.reduce_sum(x, axis=[0, 1]) * tf.ones_like(s.v))
        a = s.v * 3.0
    else:
        a = s.v * 1.0
        s.v.assign_sub(tf.ones_like(s.v))
    b = s.v.read_value()
    for _ in range(n):
        s.v.assign(s.v * 0.5 + mx)
        b = b + s.v
    loss = tf.reduce_sum(a, axis=0) + tf.reduce_sum(b, axis=0) + tf.reduce_sum(s.v, axis=0)
    float(loss)
    return loss


def test_variable_reads_and_writes_keep_program_order_across_branches_and_loops():
    rng = np.random.default_rng(5)
    cfgs = [(0, 1), (1, 2), (1, 3), (0, 3), (1, 1), (0, 4), (1, 2), (0, 2), (1, 5)]
    run = _run(lambda: Vars(v=(2,)), step_stateful, [(_x(rng), p, n) for p, n in cfgs])
    assert run.driven >= 4 and run.lowered.stats["while_ops"] >= 1


# --------------------------------------------------------------- feeds, fetches, Figure 3.4
def step_iter_feeds(s, x, chunks):
    h = tf.matmul(x, s.v)
    for c in chunks:  # a new NumPy value every iteration: a per-iteration feed
        h = h + tf.constant(c)
    h = h + x[:, :1]  # `x` again, after the loop: not fed twice
    out = h.numpy()   # read after the loop: the fetch channel's last element
    s.v.assign_add(tf.ones_like(s.v) * 1e-2)
    return out


def test_per_iteration_feeds_and_fetch_of_last_iteration():
    rng = np.random.default_rng(6)
    trips = [2, 3, 1, 4, 2, 5]
    cfgs = [(_x(rng), [rng.normal(size=(2, 3)).astype("float32") for _ in range(n)])
            for n in trips]
    run = _run(lambda: Vars(v=(3, 3)), step_iter_feeds, cfgs)
    assert run.lowerings == 2 and run.driven == 3  # the first lowering unrolled x2
    lw = run.lowered
    body_feeds = [fp for n, pts in lw.feed_points.items() for fp in pts
                  if type(fp.source).__name__ == "IterFeed"]
    assert len(body_feeds) == 1
    x_points = [fp for pts in lw.feed_points.values() for fp in pts
                if getattr(fp.source, "slot", None) == 0]
    assert len(x_points) == 1, lw.describe()


def step_fetch_feed(s, x):
    a = tf.reduce_sum(tf.matmul(x, s.v))
    k = float(a) * 0.5 + 1.0  # Python needs `a` before it can supply `k`
    b = tf.reduce_sum(s.w) * tf.constant(np.float32(k) * np.ones((1,), "float32"))
    s.w.assign_add(b)
    float(tf.reduce_sum(b))
    return a


def _ancestors(op):
    seen, stack = set(), [op]
    while stack:
        o = stack.pop()
        for p in [t.op for t in o.inputs] + list(o.control_inputs):
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def test_fetch_before_feed_gets_a_control_dependency():
    """Figure 3.4: the feed Python computes from a fetched value waits for that Output-Fetching
    op; the feed Python supplies earlier does not."""
    rng = np.random.default_rng(7)
    s = Vars(v=(3, 3), w=(1,))
    traces = [record(step_fetch_feed, s, _x(rng))[0]]
    lw = lower(merge(None, traces[0]), traces)
    g = lw.function.graph
    ops = g.get_operations()
    enq = [o for o in ops if o.type == "QueueEnqueueV2"]
    deq = [o for o in ops if o.type == "QueueDequeueV2"]
    assert len(enq) == 2 and len(deq) >= 2
    first_fetch = min(enq, key=lambda o: len(_ancestors(o)))
    before = [d for d in deq if d in _ancestors(first_fetch)]
    after = [d for d in deq if first_fetch in _ancestors(d)]
    # every Input-Feeding op either feeds the fetched value or waits for its Output-Fetching op
    assert before and after and len(before) + len(after) == len(deq)


# --------------------------------------------------------------------------------- errors
def test_bad_input_errors():
    rng = np.random.default_rng(8)
    s = Vars(v=(3, 3))
    t0, _ = record(step_branch_loop, s, _x(rng), 0, 2)
    g = merge(None, t0)
    with pytest.raises(TypeError, match="TraceGraph"):
        lower("graph", [t0])
    with pytest.raises(ValueError, match="need the 1 traces"):
        lower(g, [])
    lw = lower(g, [t0])
    t1, _ = record(step_branch_loop, s, _x(rng), 1, 2)
    assert not lw.covers(t1)
    with pytest.raises(ValueError, match="not covered"):
        plan(lw, t1)


def test_plan_puts_choices_when_known_and_reads_fetches_when_python_does():
    rng = np.random.default_rng(9)
    a, b = Vars(v=(3, 3)), Vars(v=(3, 3))
    traces, g = [], None
    for p, n in [(0, 2), (1, 3), (1, 2)]:
        t, _ = record(step_branch_loop, b, _x(rng), p, n)
        traces.append(t)
        g = merge(g, t)
    lw = lower(g, traces)
    t, _ = record(step_branch_loop, a, _x(rng), 1, 4)
    t = remap_variables(t, dict(zip(variable_keys(a.variables), variable_keys(b.variables))))
    events = plan(lw, t)
    kinds = [e.kind for e in events]
    assert kinds.count("cond") == 5 and kinds[-1] == "get"
    sel = kinds.index("select")
    assert events[sel].value == 1 and events[sel].at == next(
        r.index for r in t.records if r.op_type == "Tanh")
    conds = [e for e in events if e.kind == "cond"]
    assert [c.value for c in conds] == [True] * 4 + [False]
    assert conds[-1].at > conds[-2].at  # False only once Python has left the loop
    res = drive(lw, t)
    assert len(res.fetched) == 1


def test_graph_runner_no_grappler_uses_the_runner_option():
    from tests.compiler.driver import GraphRunnerNoGrappler
    from terra.runtime.graph_runner import GraphRunner
    r = GraphRunnerNoGrappler(name="x")
    assert isinstance(r, GraphRunner) and r.grappler is False and r.name == "x"
    assert "_worker" not in GraphRunnerNoGrappler.__dict__  # no private override


def step_small_array(s, scale):
    w = tf.convert_to_tensor(np.array([scale, 2.0 * scale], "float32"))
    s.v.assign_add(tf.reshape(w, (2, 1)) * tf.ones((2, 3)))
    loss = tf.reduce_sum(s.v)
    float(loss)
    return loss


def test_small_numpy_value_that_changes_is_a_branch_never_a_stale_constant(monkeypatch):
    # Record the step's small array by value, as the recorder does for arrays TF makes itself.
    import terra.tracing.recorder as recorder_mod
    monkeypatch.setattr(recorder_mod, "_made_in_library", lambda array: True)
    scales = [1.0, 2.0, 1.0, 2.0, 3.0, 1.0, 3.0, 2.0]
    run = _run(lambda: Vars(v=(2, 3)), step_small_array, [(s,) for s in scales])
    assert run.driven >= 3  # seen values run from the graph (and equal eager: checked by _run)
    consts = {s.value for n in run.lowered.graph.op_nodes if n.op is not None
              for s in n.inputs if isinstance(s, ConstRef) and s.dtype == "float32"
              and isinstance(s.value, tuple)}
    assert {(1.0, 2.0), (2.0, 4.0), (3.0, 6.0)} <= consts  # one branch per value


# --------------------------------------------------------------------- commit-gated writes
def _lowered_paths(step, cfgs, **kw):
    rng = np.random.default_rng(5)
    s = Vars(v=(2,))
    graph, traces = None, []
    for cfg in cfgs:
        trace, _ = record(step, s, _x(rng), *cfg)
        graph = merge(graph, trace)
        traces.append(trace)
    return lower(graph, traces, **kw)


def test_commit_gates_the_writes_of_branches_and_names_the_fetches_that_wait():
    """With `commit=True` every write waits for the commit op, a `switch_case` whose branches
    write as one op, and the fetched loss (it reads the written variable) waits for it too."""
    lw = _lowered_paths(step_stateful, [(0, 1), (1, 1)], commit=True)
    assert lw.commit_channel is not None and lw.commit_channel in lw.channels()
    assert lw.commit_dependent == frozenset(lw.fetches) and len(lw.fetches) == 1
    ops = lw.function.graph.get_operations()
    (commit_op,) = [op for op in ops if op.name.startswith("terra_commit")]
    gated = [op for op in ops if commit_op in op.control_inputs]
    assert {op.type for op in gated} == {"AssignVariableOp", "Case"}, gated
    assert lw.stats["switch_case_ops"] == 1
    assert _lowered_paths(step_stateful, [(0, 1), (1, 1)]).commit_channel is None  # default


def step_write_then_gather(s, x, path):
    loss = tf.reduce_sum(x, axis=[0, 1])
    if path == 0:
        s.v.assign_add(tf.ones_like(s.v))
        loss = loss * tf.gather(tf.constant([1.0, 2.0]), np.array([1], np.int32))[0]
    float(loss)
    return loss


def test_a_branch_that_writes_then_may_fail_leaves_the_graph_ungated():
    """The gather could fail after the write in the same branch: the commit cannot both wait
    for it and precede it, so nothing is gated."""
    lw = _lowered_paths(step_write_then_gather, [(0,), (1,)], commit=True)
    assert lw.stats["switch_case_ops"] == 1
    assert lw.commit_channel is None and lw.commit_dependent == frozenset()
    assert not any(op.name.startswith("terra_commit")
                   for op in lw.function.graph.get_operations())


# ------------------------------------------------------------------------- derived selects
def step_two_branches(s, x, a, b):
    """Two branches with a shared op between them: Python's choice `a`, then `b`."""
    h = tf.matmul(x, s.v)
    h = tf.nn.relu(h) if a == 0 else tf.tanh(h)
    h = h * 3.0
    h = h + 1.0 if b == 0 else h * h
    loss = tf.reduce_sum(h)
    s.v.assign_sub(0.01 * tf.ones_like(s.v) * loss)
    float(loss)
    return loss


def test_a_switch_case_whose_case_follows_from_an_earlier_one_takes_its_index():
    """Paths (0, 0) and (1, 1): the second switch-case's case follows from the first's, so it
    looks its index up from the first's select (one Case-Select per iteration, not two);
    a trace that chooses (0, 1) is covered by the TraceGraph but not by this graph, and the
    lowering for three paths gives each switch-case its own select again."""
    rng = np.random.default_rng(3)
    cfgs = [(0, 0), (1, 1), (0, 0), (1, 1), (1, 1), (0, 0), (0, 1), (0, 1), (1, 1), (0, 0)]
    run = _run(lambda: Vars(v=(3, 3)), step_two_branches, [(_x(rng),) + c for c in cfgs])
    # lowerings: once both paths were seen (at the second (0, 0)), and after (0, 1), which
    # the first graph does not run; driven: the iterations each graph covers
    assert run.lowerings == 2 and run.driven == 6, run
    assert [c[1:] for c in run.configs_driven] == [(1, 1), (1, 1), (0, 0), (0, 1), (1, 1),
                                                  (0, 0)]
    lw = run.lowered
    assert lw.stats["switch_case_ops"] == 2 and len(lw.case_selects) == 2
    assert lw.derived_selects == {}


def test_derived_select_lowering():
    """The graph of paths (0, 0) and (1, 1): one Case-Select; the second switch-case's index is
    the first's through the table (0, 1); `match` refuses (0, 1) and takes (1, 1)."""
    rng = np.random.default_rng(4)
    s = Vars(v=(3, 3))
    graph, traces = None, []
    for a, b in [(0, 0), (1, 1)]:
        trace, _ = record(step_two_branches, s, _x(rng), a, b)
        graph = merge(graph, trace)
        traces.append(trace)
    lw = lower(graph, traces, fuse=0)
    assert lw.stats["switch_case_ops"] == 2 and lw.runs == ()
    ((key, (j, table)),) = lw.derived_selects.items()
    assert list(lw.case_selects) == [(TOP, j)] and key[0] == TOP and key[1] > j
    assert table == (0, 1) and f"(index from s{j + 1})" in lw.describe()
    trace, _ = record(step_two_branches, s, _x(rng), 0, 1)
    assert merge(graph, trace) is not None and lw.match(trace) is None
    trace, _ = record(step_two_branches, s, _x(rng), 1, 1)
    assert lw.match(trace) is not None


# ----------------------------------------------------------------------- switch-case fusion
def test_switch_cases_on_one_select_fuse_across_a_shared_block():
    """Paths (0, 0) and (1, 1): the two switch-cases (relu | tanh, then + 1 | square) take their
    cases from one select, and the shared `* 3` between them is one node, so they are one
    `switch_case` whose branches run relu, * 3, + 1 and tanh, * 3, square; the runs equal eager
    bit for bit. With `fuse=0` the shared block stays between two switch-cases."""
    rng = np.random.default_rng(5)
    cfgs = [(0, 0), (1, 1), (0, 0), (1, 1), (1, 1), (0, 0), (0, 0), (1, 1)]
    run = _run(lambda: Vars(v=(3, 3)), step_two_branches, [(_x(rng),) + c for c in cfgs])
    assert run.lowerings == 1 and run.driven == 5
    lw = run.lowered
    (r,) = lw.runs
    assert r.driver == r.members[0] and r.width == 2 and len(r.members) == 3
    assert lw.stats["switch_case_ops"] == 1 and len(lw.case_selects) == 1
    assert set(lw.derived_selects) == {(TOP, r.members[-1])}
    assert f"in {r!r}" in lw.describe()
    # the shared `Mul` is copied into both branches: one more TF op than without fusion
    unfused = lower(run.graph, run.traces, fuse=0)
    assert unfused.stats["switch_case_ops"] == 2 and unfused.runs == ()
    mul = [n.op for n in _all_ops(lw.function) if n.op == "Mul"]
    assert len(mul) == len([n for n in _all_ops(unfused.function) if n.op == "Mul"]) + 1
