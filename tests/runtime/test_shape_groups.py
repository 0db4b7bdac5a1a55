"""Shape groups: paths that differ only in shapes share one graph (terra/runtime/shape_groups.py).

A sequence length or batch size that changes gives the same ops with other shapes and other
constants made from them (a reshape's target, a causal mask's size, a mean's count). The second
such path builds one graph with those dimensions unknown and those constants fed; every later
length costs one trace and no build. Every program is bit-identical to eager."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.ir.records import ConstRef, Feed, FeedRef, OpRecord, OutputRef, TensorSpec, Trace  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from terra.runtime.shape_groups import (SHAPE_CONSTANT, Relaxed, derive, member_values,  # noqa: E402
                                        relax, rules_hold)
from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


class _Block(keras.layers.Layer):
    def __init__(self, d, **kw):
        super().__init__(**kw)
        self.attn = keras.layers.MultiHeadAttention(2, d // 2)
        self.ln = keras.layers.LayerNormalization()
        self.ff = keras.layers.Dense(d)

    def call(self, x):
        x = self.ln(x + self.attn(x, x, use_causal_mask=True))
        return x + self.ff(x)


def _lm(Tape, lengths, vocab=17, d=8, batch=2):
    """A small causal language model trained on batches of the given sequence lengths."""
    keras.utils.set_random_seed(0)
    tok = keras.layers.Embedding(vocab, d)
    pos = keras.layers.Embedding(16, d)
    block = _Block(d)
    params = None
    opt = keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(0)
    data = {n: tf.constant(rng.integers(0, vocab, (batch, n + 1)), tf.int32) for n in set(lengths)}
    losses = []
    for n in lengths:
        tokens = data[n]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        with Tape() as tape:
            h = tok(inputs) + pos(tf.range(tf.shape(inputs)[1]))[None]
            h = block(h)
            logits = tf.matmul(h, tok.embeddings, transpose_b=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
        params = params or tok.trainable_variables + pos.trainable_variables + \
            block.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, params), params))
        losses.append(float(loss))
    terra.end_iteration()  # the loop is over: reading the variables below is not a step
    return losses, [v.numpy() for v in params + opt.variables]


def _assert_same(got, eager):
    assert got[0] == eager[0]
    assert len(got[1]) == len(eager[1])
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)


def _groups():
    sites = list(SESSION.sites.values())
    return [g for s in sites for g in s.shape_groups]


def test_sequence_lengths_in_turn_share_one_graph():
    lengths = [8, 6, 4] * 6
    eager = _lm(tf.GradientTape, lengths)
    with CompileCounter() as c:
        got = _lm(tf.TerraGradientTape, lengths)
    _assert_same(got, eager)
    # step 1 builds the optimizer (its own path); lengths 6 and 4 form the group (one build),
    # whose graph computes every shape constant from the sequence length it is fed; length 8
    # seen again runs on it untraced, as does every later step
    c.assert_counts(traces=3, graph_builds=1, graph_reuses=0, fallbacks=0)
    (g,) = _groups()
    assert len(g.members) == 2 and len(g.derived) == len(g.relaxed.const_sites) > 0
    assert g.relaxed.trace.feeds[0].spec.shape == (2, None)


def test_lengths_drawn_from_a_range_cost_two_traces_and_one_build():
    rng = np.random.default_rng(1)
    lengths = [5, 6, 7] + [int(n) for n in rng.integers(3, 9, 27)]
    eager = _lm(tf.GradientTape, lengths)
    with CompileCounter() as c:
        got = _lm(tf.TerraGradientTape, lengths)
    _assert_same(got, eager)
    distinct = len(set(lengths[1:]))
    assert distinct == 6
    # the first step (it builds the optimizer), then lengths 6 and 7 form the group; its
    # graph computes the shape constants from the length it is fed, so every other length
    # runs on it with no trace of its own (its placeholders take TF's inferred shapes)
    c.assert_counts(traces=3, graph_builds=1, graph_reuses=0, fallbacks=0)
    (g,) = _groups()
    assert sorted(m.trace.feeds[0].spec.shape[1] for m in g.members) == [6, 7]


def _classifier(Tape, batches, epochs=3):
    """An epoch loop whose last batch is smaller."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="relu"),
                              keras.layers.Dense(3)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    data = [(tf.constant(rng.normal(size=(b, 5)), tf.float32),
             tf.constant(rng.integers(0, 3, b), tf.int32)) for b in batches]
    model(data[0][0])
    opt.build(model.trainable_variables)
    losses = []
    for _ in range(epochs):
        for x, y in data:
            with Tape() as tape:
                loss = loss_fn(y, model(x))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
    terra.end_iteration()
    return losses, [v.numpy() for v in model.variables]


def test_a_last_batch_of_another_size_every_epoch_runs_on_the_same_graph():
    batches = [4, 4, 4, 2]
    eager = _classifier(tf.GradientTape, batches)
    with CompileCounter() as c:
        got = _classifier(tf.TerraGradientTape, batches)
    _assert_same(got, eager)
    # batch 4 traced twice (then built), batch 2 traced once, joining the group: one rebuild
    # for the group graph, then every epoch runs it
    c.assert_counts(traces=3, graph_builds=2, graph_reuses=0)
    (g,) = _groups()
    assert g.relaxed.trace.feeds[0].spec.shape == (None, 5)


def test_without_shape_groups_every_length_builds_its_own_graph():
    lengths = [8, 6, 4] * 4
    eager = _lm(tf.GradientTape, lengths)
    old = terra.config(shape_groups=False)
    try:
        with CompileCounter() as c:
            got = _lm(tf.TerraGradientTape, lengths)
    finally:
        terra.config(**old)
    _assert_same(got, eager)
    assert c.graph_builds == 3 and c.graph_reuses == 0
    assert _groups() == []


def _batches(Tape, sizes):
    """A dense model trained on batches of the given sizes, made before the loop."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    data = [tf.constant(rng.normal(size=(n, 4)).astype("float32")) for n in sizes]
    losses = []
    for x in data:
        with Tape() as tape:
            loss = tf.reduce_mean(model(x) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        losses.append(float(loss))
    terra.end_iteration()
    return losses, [v.numpy() for v in model.weights]


def test_a_switch_for_a_feed_of_another_shape_goes_to_a_path_of_that_shape():
    """Three compiled batch sizes, drawn out of turn: where a batch's size is not the predicted
    path's, the iteration switches once, to the path of that size, not through every path that
    agrees up to that feed (each would diverge at the same feed again, after a restart)."""
    sizes = [8, 6, 4] * 3 + [4, 8, 8, 6, 6, 4, 8, 4, 6]
    eager = _batches(tf.GradientTape, sizes)
    old = terra.config(shape_groups=False)
    try:
        with CompileCounter() as c:
            got = _batches(tf.TerraGradientTape, sizes)
    finally:
        terra.config(**old)
    _assert_same(got, eager)
    switches = [e for e in terra.explain().splitlines() if e.startswith("[switch]")]
    per_iteration = [line.split(" iteration ")[1].split(":")[0] for line in switches]
    assert len(per_iteration) == len(set(per_iteration)), terra.explain()
    # sizes 6 and 4 are first met on the graph of 8 (a fallback each, before the model's call:
    # the traces keep it one unit, so their paths are those of sizes 6 and 4 traced before);
    # from then on every mispredicted size costs exactly one switch
    c.assert_counts(traces=7, graph_builds=3, fallbacks=2, path_switches=5)
    assert len(next(iter(terra._SESSION.sites.values())).paths) == 4, terra.explain()


def test_a_data_dependent_length_inside_a_group_is_still_read_from_the_graph():
    """`tf.boolean_mask` keeps a number of rows the graph cannot know before it runs, also on
    a group's graph: Python's read of it waits for the value."""
    def run(Tape, sizes):
        v = tf.Variable(tf.ones((3,)))
        opt = keras.optimizers.SGD(0.1)
        rng = np.random.default_rng(0)
        data = {n: tf.constant(rng.normal(size=(n, 3)), tf.float32) for n in sorted(set(sizes))}
        out = []
        for n in sizes:
            x = data[n]
            with Tape() as tape:
                kept = tf.boolean_mask(x, x[:, 0] > 0)
                loss = tf.reduce_sum(kept * v) + tf.reduce_sum(x * v)
            opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
            out.append((float(loss), int(kept.shape[0])))
        terra.end_iteration()
        return out, [v.numpy()]
    sizes = [6, 5, 4] * 5
    eager = run(tf.GradientTape, sizes)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape, sizes)
    _assert_same(got, eager)
    # sizes 6 and 5 form the group; size 4 runs on it untraced; the count's shape, read by
    # Python while traced, is fetched by the group's first graph (`Trace.shape_reads`: learning
    # the read cost a fallback and a rebuild: 3 traces, 2 builds, 1 fallback)
    c.assert_counts(traces=2, graph_builds=1, graph_reuses=0, fallbacks=0)
    (g,) = _groups()
    records = g.relaxed.trace.records
    assert any(records[r.record].op_type == "Where" for r in g.unknown)
    # the size alone is not unknown to a member: the input's own shape is not in `unknown`
    assert not any(r.record == 0 for r in g.unknown)
    assert g.graph.gate_channels  # the gradient is gated on Python's check of that count


# ------------------------------------------------------------------------------------ relax
def _rec(i, op, inputs, out_shape):
    return OpRecord(i, op, (("T", "float32"),), inputs, (TensorSpec("float32", out_shape),), None)


def _trace(n, const):
    recs = [_rec(0, "Reshape", (FeedRef(0), ConstRef((2, n), "int32")), (2, n)),
            _rec(1, "Relu", (OutputRef(0, 0),), (2, n))]
    return Trace("t", recs, [Feed(0, TensorSpec("float32", (2 * n,)), "eager-tensor")], [None])


def test_relax_unknowns_the_dimensions_and_feeds_the_constants_that_differ():
    a, b = _trace(3, None), _trace(5, None)
    r = relax(Relaxed(a, {}), b)
    assert r.trace.feeds[0].spec.shape == (None,)
    assert r.trace.feeds[1].source == SHAPE_CONSTANT and r.const_sites == {1: (0, 1)}
    assert r.trace.records[0].inputs[1] == FeedRef(1)
    assert r.trace.records[1].outputs[0].shape == (2, None)
    assert member_values(r, a)[1].tolist() == [2, 3]
    # a third length is covered: same relaxed records
    r3 = relax(r, _trace(7, None))
    assert r3.trace.records == r.trace.records
    assert member_values(r3, _trace(7, None))[1].tolist() == [2, 7]


def test_relax_refuses_traces_that_differ_in_more_than_shapes():
    a = _trace(3, None)
    assert relax(Relaxed(a, {}), a) is None          # no shape differs: not a shape variant
    other = _trace(5, None)
    other.records[1] = _rec(1, "Sigmoid", (OutputRef(0, 0),), (2, 5))
    assert relax(Relaxed(a, {}), other) is None       # another op
    rank = _trace(5, None)
    rank.records[1] = _rec(1, "Relu", (OutputRef(0, 0),), (2, 5, 1))
    assert relax(Relaxed(a, {}), rank) is None        # another rank


def _counted(n, multiples):
    """A count the data set (a `Where`'s rows), and a `Tile` by a constant `multiples`."""
    recs = [OpRecord(0, "Where", (("T", "bool"),), (FeedRef(0),), (TensorSpec("int64", (n, 1)),),
                     None),
            OpRecord(1, "Tile", (("T", "int64"),), (OutputRef(0, 0), ConstRef(multiples, "int32")),
                     (TensorSpec("int64", (n * multiples[0], 1)),), None)]
    return Trace("t", recs, [Feed(0, TensorSpec("bool", (9,)), "eager-tensor")], [None])


def test_derived_constants_follow_a_dimension_every_member_shows():
    """A constant that equals a data-dependent dimension in every member is computed in the
    graph from that dimension; a member whose constant breaks the rule (a coincidence of the
    members seen so far) is caught by `rules_hold`, and a constant no dimension explains is
    not derived."""
    a, b = _counted(3, (3, 1)), _counted(5, (5, 1))
    r = relax(Relaxed(a, {}), b)
    assert derive(r, [a, b]) == {1: (("dims", OutputRef(0, 0), (0,)), ("const", 1))}
    derived = derive(r, [a, b])
    assert rules_hold(derived, r, _counted(4, (4, 1)))
    assert not rules_hold(derived, r, _counted(4, (2, 1)))
    c = _counted(5, (2, 1))  # multiples no dimension gives: the member puts them
    assert derive(relax(Relaxed(a, {}), c), [a, c]) == {}
    assert derive(relax(Relaxed(_trace(3, None), {}), _trace(5, None)),
                  [_trace(3, None), _trace(5, None)]) == {}  # (2 * n elements, n asked)


def _tail_program(Tape, lengths, reshape_tail):
    """The next batch is prepared after the step's block (the iteration's tail): by a slice,
    or by a reshape whose target Python computes from the next batch's length."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(3)
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    flat = {n: tf.constant(rng.normal(size=(2 * n * 4,)), tf.float32) for n in set(lengths)}
    full = {n: tf.constant(rng.normal(size=(2, n + 1, 4)), tf.float32) for n in set(lengths)}

    def prepare(n):
        return tf.reshape(flat[n], [2, n, 4]) if reshape_tail else full[n][:, :-1]
    x = prepare(lengths[0])
    losses = []
    for k, n in enumerate(lengths):
        with Tape() as tape:
            loss = tf.reduce_mean(dense(x) ** 2)
        grads = tape.gradient(loss, dense.trainable_variables)
        opt.apply_gradients(zip(grads, dense.trainable_variables))
        losses.append(float(loss))
        if k + 1 < len(lengths):
            x = prepare(lengths[k + 1])
    terra.end_iteration()
    return losses, [v.numpy() for v in dense.variables]


@pytest.mark.parametrize("reshape_tail", [False, True], ids=["slice", "reshape"])
def test_a_next_batch_of_a_new_length_in_the_tail(reshape_tail):
    """A slice of the next batch takes its new shape from TF's inference: a length no member
    was traced with runs on the group's graph, whatever length follows it. A reshape whose target is a Python constant made from the
    next batch's length is a shape constant after the feed: that iteration falls back (each
    (length, next length) pair is a path of its own), and the result is still eager's."""
    lengths = [5, 6, 7, 5, 7, 6, 6, 5, 7, 7, 5, 6]
    eager = _tail_program(tf.GradientTape, lengths, reshape_tail)
    with CompileCounter() as c:
        got = _tail_program(tf.TerraGradientTape, lengths, reshape_tail)
    _assert_same(got, eager)
    (g,) = _groups()
    if reshape_tail:
        # the 8 (length, next length) pairs are 8 members; the first step (the optimizer's
        # variables are made) is a path of its own
        assert len(g.members) == 8
        c.assert_counts(traces=9, graph_builds=1, graph_reuses=6, fallbacks=6)
    else:
        # lengths 6 and 7 form the group (the first step is the optimizer's); the dense
        # layer's unit is fed the next batch, sliced in the tail, whatever its length, so
        # length 5 runs on the group's graph untraced, and a length of the other member
        # switches to it at the layer's call
        assert len(g.members) == 2
        c.assert_counts(traces=3, graph_builds=1, graph_reuses=0, fallbacks=0, path_switches=3)


def test_a_tf_data_epoch_whose_last_batch_is_smaller():
    """`for x, y in dataset`: the iterator's next batch is a host op of the iteration's tail,
    and the epoch's last batch has another size; the next epoch's iterator is a new one."""
    def run(Tape):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        opt = keras.optimizers.SGD(0.1)
        rng = np.random.default_rng(0)
        ds = tf.data.Dataset.from_tensor_slices(
            (rng.normal(size=(10, 3)).astype("float32"), rng.normal(size=(10, 2)).astype("float32"))
        ).batch(4)
        losses = []
        for _ in range(4):
            for x, y in ds:
                with Tape() as tape:
                    loss = tf.reduce_mean((model(x) - y) ** 2)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply_gradients(zip(grads, model.trainable_variables))
                losses.append(float(loss))
        terra.end_iteration()
        return losses, [v.numpy() for v in model.variables]
    eager = run(tf.GradientTape)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape)
    _assert_same(got, eager)
    # the two 4-batch iterations (next batch 4, next batch 2) form the group: the first two
    # batches of every epoch run its graph. The last batch's iteration makes the next epoch's
    # iterator after its step (state: not compilable); its trace is cut where that begins
    # (`sites.state_tail`), so the 2-batch step is a path of its own, traced once, and every
    # later epoch's last batch runs its graph and ends there, the iterator made eagerly. (Before
    # the cut, it fell back and traced once per epoch: 6 traces, 4 fallbacks.)
    c.assert_counts(iterations=12, traces=3, graph_builds=2, graph_reuses=0, fallbacks=1)
    assert terra.explain().count("after the step: cut off") == 1


def test_an_op_error_inside_a_groups_graph_is_eagers_and_names_the_users_line():
    """An out-of-range index that reaches the group's graph raises eager's exception type, at
    the step's next sync point, naming the user's line of the failing op; the steps before it
    are eager's."""
    def run(Tape, losses):
        v = tf.Variable(tf.ones((6, 2)))
        opt = keras.optimizers.SGD(0.1)
        rng = np.random.default_rng(0)
        sizes = [4, 3, 2, 4, 3, 2, 4, 3]
        data = {n: tf.constant(rng.normal(size=(n, 2)), tf.float32) for n in set(sizes)}
        idx = {n: tf.constant(np.arange(n) % 6, tf.int32) for n in set(sizes)}
        bad = tf.constant([0, 9, 1, 2], tf.int32)      # 9 is out of range for 6 rows
        for k, n in enumerate(sizes):
            with Tape() as tape:
                rows = tf.gather(v, bad if k == 6 else idx[n])  # GATHER
                loss = tf.reduce_sum(rows * data[n])
            opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
            losses.append(float(loss))

    def outcome(Tape):
        terra.reset()
        losses = []
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            run(Tape, losses)
        return losses, info.value
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# GATHER"))
    eager_losses, eager_error = outcome(tf.GradientTape)
    got_losses, got_error = outcome(tf.TerraGradientTape)
    assert got_losses == eager_losses and len(eager_losses) == 6
    assert eager_error.__traceback__ is not None
    assert f"test_shape_groups.py:{line}" in str(got_error)
    assert "shape group g0" in terra.explain()


def test_a_unit_holding_an_op_of_data_dependent_length_is_not_skipped_whole():
    """Its Python may have read that length and made constants of it (a Keras optimizer's sparse
    update filtering rows): no guard checks them, so its ops are matched one by one."""
    from terra.runtime.path_view import GradUnit
    from terra.runtime.sites import units_for

    def rec(i, op):
        return OpRecord(i, op, (), (), (TensorSpec("int64", (None, 1)),), None)
    trace = Trace("t", [rec(0, "Relu"), rec(1, "Where"), rec(2, "Fill"), rec(3, "Relu")], [], [])
    units = {0: GradUnit(0, 1, (), ()), 1: GradUnit(1, 3, (), ()), 3: GradUnit(3, 4, (), ())}
    assert sorted(units_for(trace, units)) == [0, 3]


def test_a_new_length_that_falls_back_late_replays_with_its_own_constants():
    """A length no member was traced with runs on the group's graph; when the iteration then
    leaves the path (a branch Python takes on some steps only), the eager replay of what ran
    so far computes the shape constants for this length (the member's are its traced
    length's), and the trace it continues is this length's own."""
    def run(Tape, lengths):
        keras.utils.set_random_seed(0)
        block = _Block(8)
        emb = keras.layers.Embedding(17, 8)
        opt = keras.optimizers.SGD(0.1)
        rng = np.random.default_rng(0)
        data = {n: tf.constant(rng.integers(0, 17, (2, n)), tf.int32) for n in set(lengths)}
        losses = []
        for step, n in enumerate(lengths):
            with Tape() as tape:
                h = block(emb(data[n]))
                loss = tf.reduce_mean(h ** 2)
                if step % 5 == 4:  # a branch some steps take
                    loss = loss + tf.reduce_sum(h) * 0.0 + 1.0
            params = emb.trainable_variables + block.trainable_variables
            opt.apply_gradients(zip(tape.gradient(loss, params), params))
            losses.append(float(loss))
        terra.end_iteration()
        return losses, [v.numpy() for v in params]
    lengths = [6, 5, 6, 5, 7, 8, 3, 9, 4, 10, 6, 7]
    eager = run(tf.GradientTape, lengths)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape, lengths)
    _assert_same(got, eager)
    # steps 5 and 10 (lengths 7 and 10) take the branch: each falls back after running on the
    # group's graph with its new length, and is traced and built (as a path of its own)
    c.assert_counts(traces=5, fallbacks=2, graph_builds=3, graph_reuses=0)
    assert not any("new shape TF cannot infer" in line for line in terra.explain().splitlines())


def test_a_length_of_one_runs_only_on_its_own_member():
    """TF's Python may build other ops for a dimension of size 1 (broadcasting): a length of 1
    never runs on a member traced with another length, nor another length on the member traced
    with 1. Here lengths 7 and 1 form the group; length 5, predicted on the member of 1,
    switches to the member of 7 and runs there untraced; length 1 again runs on its own."""
    lengths = [6, 7, 1, 5, 1, 8]
    eager = _lm(tf.GradientTape, lengths)
    with CompileCounter() as c:
        got = _lm(tf.TerraGradientTape, lengths)
    _assert_same(got, eager)
    c.assert_counts(traces=3, graph_builds=1, graph_reuses=0, fallbacks=0, path_switches=1)
    (g,) = _groups()
    assert sorted(m.trace.feeds[0].spec.shape[1] for m in g.members) == [1, 7]


def _ragged_rows(Tape, steps=12):
    """Rows of varying lengths as a ragged batch, padded (`to_tensor`) and embedded: the
    padded width is the longest row's, which the data sets, not a feed's shape."""
    keras.utils.set_random_seed(0)
    emb = keras.layers.Embedding(100, 8)
    dense = keras.layers.Dense(1)
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        lengths = rng.integers(1, 5, size=2)
        ids = rng.integers(0, 100, size=int(lengths.sum())).astype(np.int64)
        y = rng.normal(size=2).astype(np.float32)
        with Tape() as tape:
            rows = tf.RaggedTensor.from_row_lengths(tf.constant(ids), tf.constant(lengths))
            out = dense(tf.reduce_mean(emb(rows.to_tensor(0)), axis=1))
            loss = tf.reduce_mean((out[:, 0] - y) ** 2)
        params = emb.trainable_variables + dense.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, params), params))
        losses.append(float(loss))
    return losses, [v.numpy() for v in params]


def test_a_shape_the_data_sets_is_not_taken_from_the_members():
    """Two members whose padded width happened to be the same (4) do not make it the group's:
    on the group's graph it is open, so an iteration fed another number of ids gets a
    placeholder of unknown width (read: a sync point), not the members' 4 (which the value,
    2 wide, then contradicted: a ValueError eager never raises). Ragged row splits are
    `concat([[0], cumsum(lengths)])`: the literal takes the placeholder's int64, as eager's
    takes the eager tensor's (tracing/hook.py)."""
    eager = _ragged_rows(tf.GradientTape)
    with CompileCounter() as c:
        terra_ = _ragged_rows(tf.TerraGradientTape)
    assert terra_[0] == eager[0]
    for a, b in zip(terra_[1], eager[1]):
        np.testing.assert_array_equal(a, b)
    c.assert_counts(traces=5, fallbacks=2, graph_builds=2, graph_reuses=1)
