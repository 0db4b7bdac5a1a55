"""Eager twins (terra/runtime/path_view.py, `eager_twins`): ops no tape records that prepare the
next step's data from feeds and constants (a language model's `tokens[:, :-1]` before its tape)
run eagerly too in skip mode, so the next step's first layer gets their values at once instead
of waiting for the end of the previous run. Equal to eager, bit for bit, with exact counts."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def _program(Tape, steps=8, chain=False, drop=False):
    rng = np.random.default_rng(3)
    w = tf.Variable(rng.normal(size=(4, 4)).astype(np.float32) * 0.5)
    data = [tf.constant(rng.normal(size=(3, 5)).astype(np.float32)) for _ in range(3)]
    losses = []
    for i in range(steps):
        tokens = data[i % 3]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if chain:  # twins on twins' results: the slow route resolves them in place
            inputs = tf.cast(tf.cast(inputs, tf.float64), tf.float32)
        if drop:   # prepared and dropped: nothing the program holds comes from it
            tokens * 2.0  # noqa: B018 - computed and dropped at once
        with Tape() as tape:
            loss = tf.reduce_mean((tf.matmul(inputs, w) - targets) ** 2)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        losses.append(float(loss))
    return losses, w  # read after the block: the counter's exit ends the last iteration


@pytest.mark.parametrize("chain", [False, True], ids=["slices", "slices_and_casts"])
def test_data_prepared_before_the_tape_is_computed_eagerly_too(chain):
    eager = _program(tf.GradientTape, chain=chain)
    with CompileCounter() as c:
        got = _program(tf.TerraGradientTape, chain=chain)
    assert got[0] == eager[0]
    assert np.array_equal(got[1].numpy(), eager[1].numpy())
    # traced at iterations 1 and 2 (built at the second sighting), compiled from 3 on; the
    # next step's preparation ends iterations 3-7 (2 slices, and 2 casts with `chain`), the
    # last one's is never made (its tail is pure: the graph runs it on the traced values)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, pure_tails=1,
                    eager_twins=5 * (4 if chain else 2))


def test_a_value_nothing_holds_is_left_to_the_graph():
    eager = _program(tf.GradientTape, drop=True)
    with CompileCounter() as c:
        got = _program(tf.TerraGradientTape, drop=True)
    assert got[0] == eager[0] and np.array_equal(got[1].numpy(), eager[1].numpy())
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, pure_tails=1, eager_twins=5 * 2)


def test_twins_off_the_tape_only():
    """Ops under a tape are the step's own computation: the graph's, never twinned."""
    w = tf.Variable(np.ones((4, 4), np.float32))
    x = tf.constant(np.ones((3, 4), np.float32))
    with CompileCounter() as c:
        for _ in range(6):
            with tf.TerraGradientTape() as tape:
                y = x[:, :2] * 3.0  # from a feed and constants, but recorded by the tape
                loss = tf.reduce_sum(tf.matmul(x, w)) + tf.reduce_sum(y)
            w.assign_sub(0.01 * tape.gradient(loss, w))
            float(loss)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, eager_twins=0)


def _scalar_sizes(Tape, steps=8):
    """keras-io's WGAN-GP shape: inside the tape, a batch size computed before it is stacked
    into a shape Python reads (a random draw's), and a vector of the data is cast."""
    tf.random.set_seed(6)
    w = tf.Variable(np.full((4, 2), 0.5, np.float32))
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(3, 4) / 12)
    n = tf.shape(x)[0]  # a tensor from outside the iterations: a feed of each
    labels = tf.constant([0, 1, 1])
    losses = []
    for _ in range(steps):
        with Tape() as tape:
            shape = tf.stack([n, 4])             # integer scalars: a twin
            total = tf.reduce_sum(labels)        # an integer vector: the graph's
            z = tf.random.normal(shape)          # (the draw reads `shape`)
            loss = tf.reduce_sum(tf.sin((x + z) @ w)) * tf.cast(total, tf.float32)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss) + int(total))  # (a read of the vector's sum: a fetch)
    return losses, w


def test_integer_scalars_inside_the_tape_are_twins():
    """No tape records an op on integers: stacking scalar sizes inside the tape runs eagerly
    too, so the draw's read of the shape needs no fetch; an integer op on a vector is left to
    the graph (its shape is the data's: a shape group member's twin might not fit another's)."""
    eager = _scalar_sizes(tf.GradientTape)
    with CompileCounter() as c:
        got = _scalar_sizes(tf.TerraGradientTape)
    assert got[0] == eager[0] and np.array_equal(got[1].numpy(), eager[1].numpy())
    # traced at 1 and 2, compiled from 3 on: the stacked shape is a twin in iterations 3-8
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, eager_twins=6)


def _host_op_program(Tape, steps=12, read=False):
    """wgan_gp's shape: the next step's noise is drawn (a host op: it runs as the program says)
    with a batch size computed once, before the tape, so packing the shape is an eager twin;
    on some steps the program then reads a variable where it multiplied by a constant before."""
    tf.random.set_seed(5)
    rng = np.random.default_rng(4)
    w = tf.Variable(rng.normal(size=(4, 1)).astype(np.float32))
    data = [tf.constant(rng.normal(size=(3, 4)).astype(np.float32)) for _ in range(steps)]
    extra = [False] * 4 + [True] * 8
    n = tf.shape(data[0])[0]  # a tensor from outside the iterations: a feed of each
    losses = []
    for i in range(steps):
        x = data[i]
        if read:  # the program reads the twin's value itself
            noise = tf.ones((3, 4)) * float(tf.cast(n, tf.float32) * 0.25)
        else:
            noise = tf.random.normal((n, 4))
        noise = noise * (w[0, 0] if extra[i] else 0.5)  # a variable read where a Mul was
        with Tape() as tape:
            loss = tf.reduce_sum(tf.matmul(x + noise, w) ** 2)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss))
    return losses, w


@pytest.mark.parametrize("read", [False, True], ids=["host_op", "program"])
def test_a_read_of_an_eager_twin_is_a_read_in_the_trace_of_a_fallback(read):
    """A host op whose input an eager twin computed reads it without the graph; a fallback
    after it must still hand that read to its trace, or the path it files would not fetch the
    value and fall back at the host op each time it is taken (wgan_gp: one fallback more)."""
    eager = _host_op_program(tf.GradientTape, read=read)
    with CompileCounter() as c:
        got = _host_op_program(tf.TerraGradientTape, read=read)
    assert got[0] == eager[0] and (got[1].numpy() == eager[1].numpy()).all(), \
        __import__("terra").explain()
    # p1 (the variable read) is filed at its fallback at iteration 4 and runs from iteration 5
    # on with no fallback at the host op (without the read in its trace: one more trace,
    # fallback and build there); the last fallback is the block ending inside an iteration,
    # whose path is not built (no next iteration came: runtime/filing.py, `last`)
    c.assert_counts(traces=4, fallbacks=2, graph_builds=2, path_switches=0)


def test_the_graph_fetches_no_twin_and_one_found_without_its_value_is_fetched_after_all(
        monkeypatch):
    """What eager twins compute is not fetched (a fetched copy would be left unread every step).
    Should a twin be found without its value where Python reads it (here one twin is made to
    skip its eager run once, at iteration 7), that iteration falls back at the read, the path
    learns the fetch (`Path.twin_misses`) and its next build fetches it: later iterations run
    compiled again, and every value equals eager's."""
    import terra
    from terra.runtime import python_runner

    eager = _host_op_program(tf.GradientTape, read=True)
    real = python_runner.PythonRunner._run_twin
    state = {"skipped": False}

    def skip_once(self, outs, inputs, route, run):
        if self.iteration.number == 7 and not state["skipped"]:
            state["skipped"] = True
            return None
        return real(self, outs, inputs, route, run)

    monkeypatch.setattr(python_runner.PythonRunner, "_run_twin", skip_once)
    with CompileCounter() as c:
        got = _host_op_program(tf.TerraGradientTape, read=True)
        paths = [p for s in terra._SESSION.sites.values() for p in s.paths.values()]
        fetched = {r for p in paths if p.graph is not None for r in p.graph.fetch_channels}
        twins = {r for p in paths if p.view is not None for r in p.view.twins}
        misses = {r for p in paths for r in p.twin_misses}
    assert state["skipped"]
    assert got[0] == eager[0] and (got[1].numpy() == eager[1].numpy()).all(), terra.explain()
    assert misses and {r.record for r in misses} <= twins
    assert {r.record for r in fetched} & twins == {r.record for r in misses}
    # (the block's end inside the last iteration is a fallback whose path is not built: no
    # next iteration came, runtime/filing.py, `last`)
    c.assert_counts(traces=5, fallbacks=3, graph_builds=3, path_switches=0)


def _lm_program(Tape, lengths, steps=10):
    """A language model's step: the batch sliced into inputs and targets before the tape, the
    sequence length drawn from `lengths` (a shape group's graph takes every length)."""
    rng = np.random.default_rng(7)
    emb = tf.Variable(rng.normal(size=(11, 4)).astype(np.float32) * 0.3)
    w = tf.Variable(rng.normal(size=(4, 11)).astype(np.float32) * 0.3)
    batches = [tf.constant(rng.integers(0, 11, size=(2, lengths[i % len(lengths)] + 1)),
                           tf.int32) for i in range(steps)]
    losses, seen = [], []
    for tokens in batches:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        seen.append((tuple(inputs.shape), tuple(targets.shape)))
        with Tape() as tape:
            logits = tf.matmul(tf.gather(emb, inputs), w)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
        g_emb, g_w = tape.gradient(loss, [emb, w])
        emb.assign_sub(0.1 * tf.convert_to_tensor(g_emb))
        w.assign_sub(0.1 * g_w)
        losses.append(float(loss))
    return losses, seen, emb, w


def test_the_slices_of_the_next_batch_run_from_the_trace():
    """Each compiled iteration's tail slices the next batch twice: two API calls skipped whole,
    their ops run from the trace (`twin_units`), equal to eager's."""
    eager = _lm_program(tf.GradientTape, [6])
    with CompileCounter() as c:
        got = _lm_program(tf.TerraGradientTape, [6])
    assert got[:2] == eager[:2]
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got[2:], eager[2:]))
    # traced at iterations 1 and 2, compiled from 3 on: iterations 3-9 slice the next batch
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, pure_tails=1,
                    eager_twins=7 * 2, twin_units=7 * 2)


def test_slices_of_a_batch_of_a_new_length_take_its_shapes():
    """Past a feed of a new length (a shape group's graph takes it), the slices' placeholders
    claim the shapes of the values computed, which Python reads (`inputs.shape`)."""
    lengths = [6, 9, 4, 6, 9, 7, 5, 8, 4, 7]
    eager = _lm_program(tf.GradientTape, lengths, steps=20)
    with CompileCounter() as c:
        got = _lm_program(tf.TerraGradientTape, lengths, steps=20)
    assert got[:2] == eager[:2]
    assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(got[2:], eager[2:]))
    # (the counts of every kind are those of matching the slices op by op: only how the
    # slices' values are made changed)
    c.assert_counts(traces=6, graph_builds=1, fallbacks=4, path_switches=14, pure_tails=1,
                    eager_twins=26, twin_units=26)


def test_a_slice_with_another_bound_than_traced_is_matched_op_by_op():
    """The twin call's guard holds its index by value: where the program slices with another
    bound, its ops are matched one by one (and diverge on the bound, as before)."""
    def program(Tape):
        rng = np.random.default_rng(2)
        w = tf.Variable(rng.normal(size=(4, 4)).astype(np.float32) * 0.5)
        data = tf.constant(rng.normal(size=(3, 6)).astype(np.float32))
        losses = []
        for i in range(12):
            cut = 1 if i < 8 else 2  # from the tail of iteration 8 on, another bound
            inputs = data[:, :4] if cut == 1 else data[:, 1:5]
            with Tape() as tape:
                loss = tf.reduce_mean(tf.matmul(inputs, w) ** 2)
            w.assign_sub(0.1 * tape.gradient(loss, w))
            losses.append(float(loss))
        return losses, w
    eager = program(tf.GradientTape)
    with CompileCounter() as c:
        got = program(tf.TerraGradientTape)
    assert got[0] == eager[0] and np.array_equal(got[1].numpy(), eager[1].numpy())
    # iterations 3-7 slice the next batch as traced (twin calls); iteration 8's tail slices
    # with the other bound: matched op by op, it falls back, and a second graph serves the rest
    c.assert_counts(traces=3, graph_builds=2, fallbacks=1, path_switches=0, pure_tails=1,
                    eager_twins=8, twin_units=5)
