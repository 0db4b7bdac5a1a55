"""A shape group's coarse units on lengths the path was not traced with
(terra/runtime/units.py `_feed_data_inputs`, terra/runtime/new_shapes.py).

A user-defined model handed the next batch, sliced after the previous step's tape (an eager
twin of that iteration: a placeholder), is still skipped whole: its data is fed, and where the
batch's length is another member's, the iteration switches to that member at the model's call,
not one op later inside it. A unit skipped on a length no member was traced with takes its
results' shapes from TF's inference once per feed signature. Every program equals eager
bit for bit."""
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime.new_shapes import NewShapes  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


class _LM(keras.Model):
    """Token and position embeddings, one attention block: the model reads its input's length
    (`tf.shape`), so each length has its own shape constants."""

    def __init__(self, vocab, d):
        super().__init__()
        self.tok = keras.layers.Embedding(vocab, d)
        self.pos = keras.layers.Embedding(16, d)
        self.attn = keras.layers.MultiHeadAttention(2, d // 2)
        self.ln = keras.layers.LayerNormalization()

    def call(self, ids):
        n = tf.shape(ids)[1]
        x = self.tok(ids) + self.pos(tf.range(n))[None]
        return self.ln(x + self.attn(x, x, use_causal_mask=True))


def _train(Tape, lengths, watch_from=None, vocab=17, d=8, batch=2):
    """Train on batches of the given lengths; from step `watch_from` on, count the Python runs
    of the model's `call` body (a wrapper set on the class then: the traced steps before it
    see the model as written)."""
    keras.utils.set_random_seed(0)
    model = _LM(vocab, d)
    model(tf.zeros((1, 4), tf.int32))
    opt = keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(0)
    data = {n: tf.constant(rng.integers(0, vocab, (batch, n + 1)), tf.int32) for n in set(lengths)}
    body = []
    original = _LM.call
    losses = []
    try:
        for i, n in enumerate(lengths):
            if i == watch_from:
                _LM.call = lambda self, ids: (body.append(i), original(self, ids))[1]
            tokens = data[n]
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            with Tape() as tape:
                h = model(inputs)
                logits = tf.matmul(h, model.tok.embeddings, transpose_b=True)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        terra.end_iteration()
    finally:
        _LM.call = original
    return losses, [v.numpy() for v in model.weights + opt.variables], body


def _assert_same(got, eager):
    assert got[0] == eager[0]
    assert len(got[1]) == len(eager[1])
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_array_equal(a, b)


def test_a_user_model_handed_the_next_batch_is_skipped_whole_on_every_length():
    lengths = [8, 6, 4] * 5
    eager = _train(tf.GradientTape, lengths)
    with CompileCounter() as c:
        got = _train(tf.TerraGradientTape, lengths, watch_from=4)
    _assert_same(got, eager)
    # the first step builds the optimizer, lengths 6 and 4 form the group; from then on the
    # model's call is skipped whole: its Python body never runs again (it ran in every skipped
    # step while the batch, a placeholder of the step before, was not fed to the unit)
    assert got[2] == []
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # a length of another member than the predicted one: one switch, at the model's call
    switches = [e for e in terra.explain().splitlines() if e.startswith("[switch]")]
    assert switches and all("test_group_units.py" in e and "(_train)" in e for e in switches), \
        terra.explain()


def test_a_units_shapes_on_a_new_length_are_inferred_once_per_feed_signature(monkeypatch):
    calls = []
    infer = NewShapes._infer_shapes

    def counted(self, rec):
        calls.append(self.iteration.number)
        return infer(self, rec)
    monkeypatch.setattr(NewShapes, "_infer_shapes", counted)
    lengths = [8, 6, 4, 5, 5, 5, 7, 5, 7]
    eager = _train(tf.GradientTape, lengths)
    with CompileCounter() as c:
        got = _train(tf.TerraGradientTape, lengths)
    _assert_same(got, eager)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # lengths 5 and 7 belong to no member: the first iteration of each (iterations 4 and 7,
    # counted from 1) visits every record of the units it skips; iterations 5, 6 and 8 are
    # fed a signature seen before and visit only the ops matched one by one (the loss), whose
    # shapes come from the same table
    per = collections.Counter(calls)
    assert per[4] == per[7] and per[5] == per[6] == per[8], per
    assert per[4] > 10 * per[5], per
