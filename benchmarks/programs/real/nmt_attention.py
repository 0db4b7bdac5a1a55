"""Neural machine translation with attention (TF 2.0-2.3 tutorial), Bahdanau attention seq2seq.

Source: https://github.com/tensorflow/docs/blob/r2.3/site/en/tutorials/text/nmt_with_attention.ipynb
(the classic TF2 tutorial "Neural machine translation with attention", tensorflow/docs), Apache-2.0.
Adapted: synthetic "sentence pairs" instead of the Spanish-English corpus and its tokenizer: source
sentences of 3..max_len random word ids (vocabulary 30), the target is the reversed source
(a learnable mapping), both wrapped in <start>=1/<end>=2 and padded with 0 like the tutorial's
`pad_sequences(padding='post')`; smaller embedding/units/batch. Kept: `Encoder` (Embedding, GRU),
`BahdanauAttention`, `Decoder` (its GRU called without an initial state, as in the tutorial),
`loss_function` with the padding mask, Adam, and `train_step(inp, targ, enc_hidden)` with the
Python teacher-forcing loop `for t in range(1, targ.shape[1])` inside the tape; the epoch loop
resets `enc_hidden` and `total_loss` and iterates `enumerate(dataset.take(steps_per_epoch))`.
Keras 3 changes: `keras.Model`/`keras.layers` instead of `tf.keras`, `super().__init__()`.
"""
import keras
import numpy as np
import tensorflow as tf

from ._util import identity, seed_all, values

SOURCE = "https://github.com/tensorflow/docs/blob/r2.3/site/en/tutorials/text/nmt_with_attention.ipynb"
LICENSE = "Apache-2.0"
TRAIT = "Python teacher-forcing loop in the tape: ~10 decoder calls (attention + GRU) per step"
SIZES = {
    "bench": dict(n=512, vocab=30, max_len=8, batch=64, embedding_dim=32, units=96),
    "tiny": dict(n=32, vocab=10, max_len=4, batch=8, embedding_dim=4, units=8),
}

START, END = 1, 2


class Encoder(keras.Model):
    def __init__(self, vocab_size, embedding_dim, enc_units, batch_sz):
        super().__init__()
        self.batch_sz = batch_sz
        self.enc_units = enc_units
        self.embedding = keras.layers.Embedding(vocab_size, embedding_dim)
        self.gru = keras.layers.GRU(self.enc_units,
                                    return_sequences=True,
                                    return_state=True,
                                    recurrent_initializer='glorot_uniform')

    def call(self, x, hidden):
        x = self.embedding(x)
        output, state = self.gru(x, initial_state=hidden)
        return output, state

    def initialize_hidden_state(self):
        return tf.zeros((self.batch_sz, self.enc_units))


class BahdanauAttention(keras.layers.Layer):
    def __init__(self, units):
        super().__init__()
        self.W1 = keras.layers.Dense(units)
        self.W2 = keras.layers.Dense(units)
        self.V = keras.layers.Dense(1)

    def call(self, query, values):
        # query hidden state shape == (batch_size, hidden size)
        # query_with_time_axis shape == (batch_size, 1, hidden size)
        # values shape == (batch_size, max_len, hidden size)
        query_with_time_axis = tf.expand_dims(query, 1)

        # score shape == (batch_size, max_length, 1)
        score = self.V(tf.nn.tanh(
            self.W1(query_with_time_axis) + self.W2(values)))

        # attention_weights shape == (batch_size, max_length, 1)
        attention_weights = tf.nn.softmax(score, axis=1)

        # context_vector shape after sum == (batch_size, hidden_size)
        context_vector = attention_weights * values
        context_vector = tf.reduce_sum(context_vector, axis=1)

        return context_vector, attention_weights


class Decoder(keras.Model):
    def __init__(self, vocab_size, embedding_dim, dec_units, batch_sz):
        super().__init__()
        self.batch_sz = batch_sz
        self.dec_units = dec_units
        self.embedding = keras.layers.Embedding(vocab_size, embedding_dim)
        self.gru = keras.layers.GRU(self.dec_units,
                                    return_sequences=True,
                                    return_state=True,
                                    recurrent_initializer='glorot_uniform')
        self.fc = keras.layers.Dense(vocab_size)

        # used for attention
        self.attention = BahdanauAttention(self.dec_units)

    def call(self, x, hidden, enc_output):
        # enc_output shape == (batch_size, max_length, hidden_size)
        context_vector, attention_weights = self.attention(hidden, enc_output)

        # x shape after passing through embedding == (batch_size, 1, embedding_dim)
        x = self.embedding(x)

        # x shape after concatenation == (batch_size, 1, embedding_dim + hidden_size)
        x = tf.concat([tf.expand_dims(context_vector, 1), x], axis=-1)

        # passing the concatenated vector to the GRU
        output, state = self.gru(x)

        # output shape == (batch_size * 1, hidden_size)
        output = tf.reshape(output, (-1, output.shape[2]))

        # output shape == (batch_size, vocab)
        x = self.fc(output)

        return x, state, attention_weights


def _pairs(rng, n, vocab, max_len):
    """Padded (input, target) id matrices: target = reversed input, both <start> ... <end>."""
    inp = np.zeros((n, max_len + 2), np.int32)
    targ = np.zeros((n, max_len + 2), np.int32)
    for k in range(n):
        words = rng.integers(3, vocab, int(rng.integers(3, max_len + 1)))
        inp[k, :len(words) + 2] = [START, *words, END]
        targ[k, :len(words) + 2] = [START, *words[::-1], END]
    return inp, targ


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    input_tensor_train, target_tensor_train = _pairs(rng, c["n"], c["vocab"], c["max_len"])

    BUFFER_SIZE = len(input_tensor_train)
    BATCH_SIZE = c["batch"]
    steps_per_epoch = len(input_tensor_train) // BATCH_SIZE
    embedding_dim = c["embedding_dim"]
    units = c["units"]
    vocab_inp_size = vocab_tar_size = c["vocab"]

    dataset = tf.data.Dataset.from_tensor_slices(
        (input_tensor_train, target_tensor_train)).shuffle(BUFFER_SIZE, seed=seed)
    dataset = dataset.batch(BATCH_SIZE, drop_remainder=True)

    encoder = Encoder(vocab_inp_size, embedding_dim, units, BATCH_SIZE)
    decoder = Decoder(vocab_tar_size, embedding_dim, units, BATCH_SIZE)

    optimizer = keras.optimizers.Adam()
    loss_object = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction='none')

    def loss_function(real, pred):
        mask = tf.math.logical_not(tf.math.equal(real, 0))
        loss_ = loss_object(real, pred)

        mask = tf.cast(mask, dtype=loss_.dtype)
        loss_ *= mask

        return tf.reduce_mean(loss_)

    def train_step(inp, targ, enc_hidden):  # the tutorial's @tf.function is `decorate` below
        loss = 0

        with Tape() as tape:
            enc_output, enc_hidden = encoder(inp, enc_hidden)

            dec_hidden = enc_hidden

            dec_input = tf.expand_dims([START] * BATCH_SIZE, 1)

            # Teacher forcing - feeding the target as the next input
            for t in range(1, targ.shape[1]):
                # passing enc_output to the decoder
                predictions, dec_hidden, _ = decoder(dec_input, dec_hidden, enc_output)

                loss += loss_function(targ[:, t], predictions)

                # using teacher forcing
                dec_input = tf.expand_dims(targ[:, t], 1)

        batch_loss = (loss / int(targ.shape[1]))

        variables = encoder.trainable_variables + decoder.trainable_variables

        gradients = tape.gradient(loss, variables)

        optimizer.apply_gradients(zip(gradients, variables))

        return batch_loss

    train_step = (decorate or identity)(train_step)
    losses, epoch_losses, i = [], [], 0
    while i < steps:  # epochs
        enc_hidden = encoder.initialize_hidden_state()
        total_loss = 0

        for (batch, (inp, targ)) in enumerate(dataset.take(steps_per_epoch)):
            batch_loss = train_step(inp, targ, enc_hidden)
            total_loss += batch_loss
            losses.append(float(batch_loss))
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break
        epoch_losses.append(float(total_loss / steps_per_epoch))
    return {"losses": losses + epoch_losses, "variables": values(encoder, decoder, optimizer)}
