"""Graph generation against eager on small real programs (Keras 3 layers and optimizers).

Each test runs a program on two twins with `tests.compiler.driver.twin_run`: A eagerly, B in the
tracing phase until the TraceGraph covers its latest trace, then from the lowered graph, driven
with A's trace of the same iteration. Losses fetched from the graph and every variable (weights,
optimizer slots and iteration counts) must be bit-identical to eager after every iteration
(Grappler is off for the graph runs; the ops themselves are deterministic on CPU).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.ir.records import FeedRef  # noqa: E402
from tests.compiler.driver import all_variables, twin_run  # noqa: E402

CE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class State:
    """Layers and optimizers of one twin, as attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    @property
    def variables(self):
        return all_variables(*[v for v in self.__dict__.values()
                               if hasattr(v, "variables")])


def _data(rng, n=4, d=5, classes=3):
    return (tf.constant(rng.normal(size=(n, d)).astype("float32")),
            tf.constant(rng.integers(0, classes, size=n).astype("int32")))


def _check(run, want_driven, want_lowerings=None):
    assert run.driven >= want_driven, (run.driven, run.eager_b)
    if want_lowerings is not None:
        assert run.lowerings == want_lowerings
    return run


# ------------------------------------------------------------------------ (a) three paths
def build_three_paths(adam=False):
    keras.utils.set_random_seed(1)
    s = State(d1=keras.layers.Dense(8, activation="relu"), d2=keras.layers.Dense(8, "tanh"),
              d3=keras.layers.Dense(8, "relu"), head=keras.layers.Dense(3),
              opt=keras.optimizers.Adam(1e-2) if adam else keras.optimizers.SGD(0.1, 0.9))
    x = tf.zeros((1, 5))
    s.head(s.d3(s.d1(x))), s.d2(x)
    s.opt.build([v for l in (s.d1, s.d2, s.d3, s.head) for v in l.trainable_variables])
    return s


def step_three_paths(s, x, y, path):
    layers = [(s.d1,), (s.d2,), (s.d1, s.d3)][path] + (s.head,)
    params = [v for l in layers for v in l.trainable_variables]
    with tf.GradientTape() as tape:
        h = x
        for layer in layers:
            h = layer(h)
        loss = CE(y, h)
    grads = tape.gradient(loss, params)
    s.opt.apply_gradients(zip(grads, params))
    float(loss)
    return loss


@pytest.mark.parametrize("adam", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_three_python_chosen_paths_equal_eager(adam):
    rng = np.random.default_rng(0)
    paths = [0, 1, 2, 0] + list(rng.integers(0, 3, size=6))
    configs = [(*_data(rng), int(p)) for p in paths]
    run = twin_run(lambda: build_three_paths(adam), step_three_paths, configs,
                   variables=lambda s: s.variables)
    _check(run, 6, 1)
    assert run.lowered.stats["switch_case_ops"] >= 1
    assert {c[2] for c in run.configs_driven} == {0, 1, 2}


def test_graph_from_n_traces_replays_each_recorded_path():
    """The graph built from N traces runs every one of the N recorded paths (here in recording
    order again), equal to eager."""
    rng = np.random.default_rng(1)
    paths = [2, 0, 1, 1] + [2, 0, 1]
    configs = [(*_data(rng), p) for p in paths]
    run = twin_run(build_three_paths, step_three_paths, configs,
                   variables=lambda s: s.variables)
    assert len(run.traces) == 3 and run.lowerings == 1
    assert all(run.lowered.covers(t) for t in run.traces)
    assert [c[2] for c in run.configs_driven] == [2, 0, 1]


# ------------------------------------------------------------ (b) loop with varying trip count
def build_cell():
    keras.utils.set_random_seed(2)
    s = State(inp=keras.layers.Dense(6, "tanh"), cell=keras.layers.Dense(6, "tanh"),
              head=keras.layers.Dense(3), opt=keras.optimizers.SGD(0.1))
    s.head(s.cell(s.inp(tf.zeros((1, 5)))))
    return s


def step_trip_count(s, x, y, n):
    params = [v for l in (s.inp, s.cell, s.head) for v in l.trainable_variables]
    with tf.GradientTape() as tape:
        h = s.inp(x)
        for _ in range(n):
            h = s.cell(h) + h
        loss = CE(y, s.head(h))
    s.opt.apply_gradients(zip(tape.gradient(loss, params), params))
    float(loss)
    return loss


def test_loop_trip_count_varies_per_step():
    rng = np.random.default_rng(3)
    trips = [1, 2, 3, 2] + list(rng.integers(1, 4, size=5))
    configs = [(*_data(rng), int(n)) for n in trips]
    run = twin_run(build_cell, step_trip_count, configs, variables=lambda s: s.variables)
    _check(run, 5, 1)
    # The backward pass reads every iteration's activations, so the merge unrolls the forward
    # loop: each trip count is its own branch (switch_case), no while_loop.
    assert not run.lowered.loop_conds and run.lowered.stats["switch_case_ops"] >= 1
    assert len({c[2] for c in run.configs_driven}) >= 2


def step_fed_episode(s, xs, y, w):
    """An unrolled episode of `len(xs)` steps, each fed its own input, then a loss fed `y` and
    `w`: the traces number those feeds by first use, so an episode of another length numbers
    every feed of the loss differently (as actor_critic's returns)."""
    params = [v for l in (s.inp, s.cell, s.head) for v in l.trainable_variables]
    with tf.GradientTape() as tape:
        h = s.inp(xs[0])
        for x in xs[1:]:
            h = s.cell(h) + s.inp(x)
        loss = CE(y, s.head(h)) * w
    s.opt.apply_gradients(zip(tape.gradient(loss, params), params))
    float(loss)
    return loss


def test_feeds_numbered_differently_per_path_share_nodes():
    """Two episode lengths: the loss and its gradient read feeds whose slots differ between
    the two traces; the merge maps each trace's slots onto the graph's, so those ops are one
    node each (not a node per path), and the lowered graph runs both lengths equal to eager."""
    from terra.compiler.merge import merge
    from tests.compiler.driver import record
    rng = np.random.default_rng(4)

    def cfg(n):
        xs = [tf.constant(rng.normal(size=(4, 5)).astype("float32")) for _ in range(n)]
        return xs, _data(rng)[1], tf.constant(float(rng.uniform(0.5, 2.0)))
    s = build_cell()
    t2, _ = record(step_fed_episode, s, *cfg(2))
    t3, _ = record(step_fed_episode, s, *cfg(3))

    def w_slot(t):  # the feed `loss * w` reads
        (slot,) = {r.inputs[1].slot for r in t.records
                   if r.op_type == "Mul" and isinstance(r.inputs[1], FeedRef)}
        return slot
    assert w_slot(t2) != w_slot(t3)
    g = merge(merge(None, t2), t3)
    muls = [n for n in g.op_nodes if n.op is not None and n.op.op_type == "Mul"
            and isinstance(n.inputs[1], FeedRef)]
    # `loss * w` and its gradient's `1.0 * w`: a node each, on both paths (a node per path
    # each when slots were matched by number)
    assert len(muls) == 2 and all(set(n.seen) == {0, 1} for n in muls)
    configs = [cfg(n) for n in (2, 3, 2, 3, 3, 2, 2, 3)]
    run = twin_run(build_cell, step_fed_episode, configs, variables=lambda s: s.variables)
    # (the first step is a path of its own: the optimizer's first apply differs)
    assert (run.driven, run.eager_b, run.lowerings, len(run.traces)) == (4, 4, 1, 3)
    assert sorted(len(c[0]) for c in run.configs_driven) == [2, 2, 3, 3]


def step_infer_loop(s, x, n):
    """No tape: the loop is the only control flow (a while_loop, no unrolled backward)."""
    h = s.inp(x)
    for _ in range(n):
        h = s.cell(h) * 0.5 + h
    s.cell.kernel.assign_add(tf.reduce_mean(h) * 1e-3 * tf.ones_like(s.cell.kernel))
    out = tf.reduce_sum(h)
    float(out)
    return out


def test_while_loop_runs_unseen_trip_counts():
    """First lowering: one trace, trip count 2 -> unrolled; trip count 3 falls back (the unrolled
    graph does not cover it); second lowering: trip counts {2, 3} -> a while_loop, which then
    runs trip counts no trace had."""
    rng = np.random.default_rng(4)
    trips = [2, 3, 3, 1, 4, 6, 2]
    configs = [(_data(rng)[0], n) for n in trips]
    run = twin_run(build_cell, step_infer_loop, configs, variables=lambda s: s.variables)
    assert run.lowerings == 2 and run.driven == 4
    assert [c[1] for c in run.configs_driven] == [1, 4, 6, 2]
    assert len(run.lowered.loop_conds) == 1


# --------------------------------------------------------------- (c) early break on a fetch
def step_early_break(s, x, y, limit):
    params = [v for l in (s.inp, s.cell, s.head) for v in l.trainable_variables]
    with tf.GradientTape() as tape:
        h = s.inp(x)
        for _ in range(4):
            h = s.cell(h) + h
            if float(tf.reduce_max(h)) > limit:  # Python decides on a fetched value
                break
        loss = CE(y, s.head(h))
    s.opt.apply_gradients(zip(tape.gradient(loss, params), params))
    float(loss)
    return loss


def test_early_break_on_fetched_value():
    rng = np.random.default_rng(5)
    limits = [0.0, 100.0, 1.2, 0.0, 100.0, 1.2, 0.0, 100.0, 0.0]
    configs = [(*_data(rng), lim) for lim in limits]
    run = twin_run(build_cell, step_early_break, configs, variables=lambda s: s.variables)
    _check(run, 3)
    assert run.lowered.loop_conds or run.lowered.unrolled


# -------------------------------------------------------------- (d) recursion over tree shapes
TREES = [((0, 1), 2), (0, (1, 2)), ((0, 1), (2, 3))]


def build_tree():
    keras.utils.set_random_seed(3)
    s = State(leaf=keras.layers.Dense(4, "tanh"), comb=keras.layers.Dense(4, "tanh"),
              head=keras.layers.Dense(2), opt=keras.optimizers.SGD(0.05))
    s.head(s.comb(tf.zeros((1, 8)))), s.leaf(tf.zeros((1, 3)))
    return s


def _embed(s, tree, leaves):
    if isinstance(tree, int):
        return s.leaf(leaves[tree:tree + 1])
    return s.comb(tf.concat([_embed(s, tree[0], leaves), _embed(s, tree[1], leaves)], axis=1))


def step_tree(s, leaves, y, shape):
    params = [v for l in (s.leaf, s.comb, s.head) for v in l.trainable_variables]
    with tf.GradientTape() as tape:
        loss = CE(y, s.head(_embed(s, TREES[shape], leaves)))
    s.opt.apply_gradients(zip(tape.gradient(loss, params), params))
    float(loss)
    return loss


def test_recursion_over_three_tree_shapes():
    rng = np.random.default_rng(6)
    shapes = [0, 1, 2, 1] + [2, 0, 1, 0]
    configs = [(tf.constant(rng.normal(size=(4, 3)).astype("float32")),
                tf.constant(rng.integers(0, 2, size=1).astype("int32")), s) for s in shapes]
    run = twin_run(build_tree, step_tree, configs, variables=lambda s: s.variables)
    _check(run, 4, 1)
    assert run.lowered.stats["switch_case_ops"] >= 1


# ------------------------------------------------------- (e) fetch, numpy, feed back (Fig. 3.4)
def build_roundtrip():
    keras.utils.set_random_seed(4)
    s = State(d1=keras.layers.Dense(6, "tanh"), head=keras.layers.Dense(3),
              opt=keras.optimizers.SGD(0.1, momentum=0.9))
    s.head(s.d1(tf.zeros((1, 5))))
    s.opt.build(s.d1.trainable_variables + s.head.trainable_variables)
    return s


def step_roundtrip(s, x, y, scale):
    params = s.d1.trainable_variables + s.head.trainable_variables
    with tf.GradientTape() as tape:
        h = s.d1(x)
        fed = np.tanh(h.numpy()) * scale  # processed in NumPy, fed back
        loss = CE(y, s.head(tf.constant(fed))) + tf.reduce_mean(tf.square(h))
    s.opt.apply_gradients(zip(tape.gradient(loss, params), params))
    float(loss)
    return loss, fed, scale


def feed_back_roundtrip(trace, out):
    """The fed value, computed by the driver from the value it fetched from the graph, exactly as
    the program computes it from the eager value."""
    _, fed, scale = out
    (slot,) = [k for k, v in enumerate(trace.feed_values) if v is fed]
    (ref,) = [(f.ref.record, f.ref.index) for f in trace.fetches if f.how == "numpy"]
    return {slot: lambda fetched: np.tanh(fetched[ref]) * scale}


def test_value_fetched_processed_with_numpy_and_fed_back():
    rng = np.random.default_rng(7)
    configs = [(*_data(rng), s) for s in (0.5, 2.0, 0.5, 2.0, 2.0, 0.5)]
    run = twin_run(build_roundtrip, step_roundtrip, configs, variables=lambda s: s.variables,
                   loss_of=lambda out: out[0], feed_back=feed_back_roundtrip)
    _check(run, 4, 1)


# ---------------------------------------------------------------------- (f) two tapes, one step
def build_gan():
    keras.utils.set_random_seed(5)
    s = State(g=keras.layers.Dense(5), d1=keras.layers.Dense(6, "relu"), d2=keras.layers.Dense(1),
              opt_g=keras.optimizers.Adam(1e-3), opt_d=keras.optimizers.SGD(0.05))
    s.d2(s.d1(s.g(tf.zeros((1, 3)))))
    s.opt_g.build(s.g.trainable_variables)
    return s


def step_gan(s, z, x, train_g):
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    dv = s.d1.trainable_variables + s.d2.trainable_variables
    with tf.GradientTape() as tg, tf.GradientTape() as td:
        fake = s.g(z)
        real_logits, fake_logits = s.d2(s.d1(x)), s.d2(s.d1(fake))
        ld = bce(tf.ones_like(real_logits), real_logits) + bce(tf.zeros_like(fake_logits),
                                                               fake_logits)
        lg = bce(tf.ones_like(fake_logits), fake_logits)
    s.opt_d.apply_gradients(zip(td.gradient(ld, dv), dv))
    if train_g:
        s.opt_g.apply_gradients(zip(tg.gradient(lg, s.g.trainable_variables),
                                    s.g.trainable_variables))
    float(ld)
    return ld


def test_two_tapes_in_one_step():
    rng = np.random.default_rng(8)
    flags = [True, False, True, False, True, True, False]
    configs = [(tf.constant(rng.normal(size=(4, 3)).astype("float32")),
                tf.constant(rng.normal(size=(4, 5)).astype("float32")), f) for f in flags]
    run = twin_run(build_gan, step_gan, configs, variables=lambda s: s.variables)
    _check(run, 4, 1)


# ------------------------------------------------------------------ growth with traces (docs)
def _growth(build, step, configs):
    """Rows (traces, nodes, switch-cases, switch_case ops, while ops, TF ops, build s) after
    merging each trace of `configs` the current lowered graph does not cover."""
    from tests.compiler.driver import record
    from terra.compiler.lower import lower
    from terra.compiler.merge import merge
    s, g, traces, rows, lw = build(), None, [], [], None
    for cfg in configs:
        t, _ = record(step, s, *cfg)
        if lw is not None and lw.covers(t):
            continue
        g = merge(g, t)
        traces.append(t)
        lw = lower(g, traces)
        st = lw.stats
        rows.append((len(traces), st["nodes"], st["switch_cases"], st["switch_case_ops"],
                     st["while_ops"], st["tf_ops"], round(lw.build_seconds, 2)))
    return rows


@pytest.mark.slow
def test_growth_with_number_of_traces():
    rng = np.random.default_rng(20)
    programs = {
        "three paths (SGD)": (lambda: build_three_paths(False), step_three_paths,
                              [(*_data(rng), p) for p in (0, 1, 2)]),
        "trip count 1..4 (tape)": (build_cell, step_trip_count,
                                   [(*_data(rng), n) for n in (1, 2, 3, 4)]),
        "tree recursion": (build_tree, step_tree,
                           [(tf.constant(rng.normal(size=(4, 3)).astype("float32")),
                             tf.constant([1], "int32"), k) for k in (0, 1, 2)]),
        "two tapes, G every other step": (build_gan, step_gan,
                                          [(tf.zeros((4, 3)), tf.zeros((4, 5)), f)
                                           for f in (True, False)]),
        "inference loop (while)": (build_cell, step_infer_loop,
                                   [(_data(rng)[0], n) for n in (2, 3, 5)]),
    }
    for name, (build, step, cfgs) in programs.items():
        rows = _growth(build, step, cfgs)
        for r in rows:
            print(f"| {name} | " + " | ".join(map(str, r)) + " |")
        nodes = [r[1] for r in rows]
        assert nodes == sorted(nodes) and rows
