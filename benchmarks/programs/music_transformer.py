"""Music Transformer written as a trainer class, the common way training code is organized: the
step method stores the loss on ``self.loss_value`` and ``train_on_batch`` reads it back.
Trait: Python object mutation (Figure 3.9(b)); a traced step writes a symbolic tensor to the
attribute once, so reading it back does not give this step's loss."""
import keras
import tensorflow as tf

from ._common import Program
from ._transformer import TRANSFORMER_SIZES, Encoder


class MusicTransformerTrainer(Program):
    name = "music_transformer"
    trait = "trainer class stores the loss on self.loss_value and reads it back"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = TRANSFORMER_SIZES[size]
        self.model = Encoder(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"], causal=True)
        self.head = keras.layers.Dense(c["vocab"])
        self.head(self.model(tf.zeros((1, c["seq"]), tf.int32)))
        self.optimizer = keras.optimizers.Adam(1e-4)
        self.loss_value = None
        r, b = self.np_rng, c["batch"]
        self.batches = [(tf.constant(r.integers(0, c["vocab"], (b, c["seq"] + 1)), tf.int32),)
                        for _ in range(self.pool_size)]

    def models(self):
        return [self.model, self.head]

    def train_step(self, events):
        x, y = events[:, :-1], events[:, 1:]
        params = self.model.trainable_variables + self.head.trainable_variables
        with self.tape_cls() as tape:
            logits = self.head(self.model(x, training=True))
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        self.loss_value = loss
        grads = tape.gradient(self.loss_value, params)
        self.optimizer.apply_gradients(zip(grads, params))

    def train_on_batch(self, events):
        self.train_step(events)
        return self.loss_value

    def step(self, i):
        return float(self.train_on_batch(*self.batch(i)))


def build(tape_cls, seed=0, size="bench"):
    return MusicTransformerTrainer(tape_cls, seed, size)
