"""Text generation with an RNN (TF tutorial), its custom training loop.

Source: https://www.tensorflow.org/text/tutorials/text_generation (tensorflow/text,
docs/tutorials/text_generation.ipynb, section "Advanced: Customized Training"), Apache-2.0.
Adapted: a synthetic stream of token ids drawn from a random Markov chain (NumPy, from the seed)
instead of the Shakespeare characters and their StringLookup (no strings anywhere), a vocabulary
of 40 instead of 66, sequences of 20 instead of 100, smaller embedding/GRU/batch. Kept: the
tutorial's pipeline (`batch(seq_length + 1)`, `map(split_input_target)`, shuffle, batch with
drop_remainder, prefetch), `MyModel` (Embedding, GRU with return_sequences/return_state, Dense),
`CustomTraining.train_step` with a tape and `self.loss`/`self.optimizer` from `compile`, and the
loop `for (batch_n, (inp, target)) in enumerate(dataset)` with a `Mean` reset every epoch.
Keras 3 changes: `super().__init__()` (Keras 3 rejects the tutorial's `super().__init__(self)`),
`get_initial_state` takes the batch size, the train step uses `self.trainable_variables`
(the tutorial's reads the global `model`, the same object), and the Mean resets with `reset_state`.
"""
import keras
import numpy as np
import tensorflow as tf

from ._util import identity, seed_all, values

SOURCE = "https://www.tensorflow.org/text/tutorials/text_generation"
LICENSE = "Apache-2.0"
TRAIT = "Embedding+GRU (return_state) model subclass, train step as a model method, per-epoch Mean"
SIZES = {
    "bench": dict(vocab=40, seq_length=20, n_chars=32 * 21 * 8, batch=32, embedding_dim=64,
                  rnn_units=192),
    "tiny": dict(vocab=12, seq_length=6, n_chars=4 * 7 * 6, batch=4, embedding_dim=4, rnn_units=8),
}


class MyModel(keras.Model):
    def __init__(self, vocab_size, embedding_dim, rnn_units):
        super().__init__()
        self.embedding = keras.layers.Embedding(vocab_size, embedding_dim)
        self.gru = keras.layers.GRU(rnn_units, return_sequences=True, return_state=True)
        self.dense = keras.layers.Dense(vocab_size)

    def call(self, inputs, states=None, return_state=False, training=False):
        x = inputs
        x = self.embedding(x, training=training)
        if states is None:
            states = self.gru.get_initial_state(tf.shape(x)[0])
        x, states = self.gru(x, initial_state=states, training=training)
        x = self.dense(x, training=training)

        if return_state:
            return x, states
        else:
            return x


def _make_custom_training(Tape):
    class CustomTraining(MyModel):
        def train_step(self, inputs):  # the tutorial's @tf.function is `decorate` in run()
            inputs, labels = inputs
            with Tape() as tape:
                predictions = self(inputs, training=True)
                loss = self.loss(labels, predictions)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))

            return {'loss': loss}

    return CustomTraining


def _token_stream(rng, vocab, n):
    """A Markov chain over ids 1..vocab-1 (0 is the tutorial's [UNK]) with peaked transitions."""
    trans = rng.dirichlet(np.full(vocab - 1, 0.2), size=vocab - 1)
    ids = [int(rng.integers(0, vocab - 1))]
    u = rng.uniform(size=n - 1)
    cum = trans.cumsum(axis=1)
    for k in range(n - 1):
        ids.append(min(int((cum[ids[-1]] < u[k]).sum()), vocab - 2))
    return np.array(ids, dtype=np.int64) + 1


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    all_ids = _token_stream(rng, c["vocab"], c["n_chars"])

    ids_dataset = tf.data.Dataset.from_tensor_slices(all_ids)
    seq_length = c["seq_length"]
    sequences = ids_dataset.batch(seq_length + 1, drop_remainder=True)

    def split_input_target(sequence):
        input_text = sequence[:-1]
        target_text = sequence[1:]
        return input_text, target_text

    dataset = sequences.map(split_input_target)
    BATCH_SIZE = c["batch"]
    BUFFER_SIZE = 10000
    dataset = (
        dataset
        .shuffle(BUFFER_SIZE, seed=seed)
        .batch(BATCH_SIZE, drop_remainder=True)
        .prefetch(tf.data.experimental.AUTOTUNE))

    model = _make_custom_training(Tape)(
        vocab_size=c["vocab"],
        embedding_dim=c["embedding_dim"],
        rnn_units=c["rnn_units"])
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    train_step = (decorate or identity)(model.train_step)

    mean = keras.metrics.Mean()
    losses, epoch_means, i = [], [], 0
    while i < steps:  # epochs
        mean.reset_state()
        for (batch_n, (inp, target)) in enumerate(dataset):
            logs = train_step([inp, target])
            mean.update_state(logs['loss'])
            losses.append(float(logs['loss']))
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break
        epoch_means.append(float(mean.result()))
    return {"losses": losses + epoch_means, "variables": values(model, model.optimizer, mean)}
