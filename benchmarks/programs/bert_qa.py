"""BERT question answering (SQuAD-style span prediction): an encoder with a 2-unit head giving
start/end logits, trained with Adam. Trait: none in particular; AutoGraph converts it."""
import keras
import tensorflow as tf

from ._common import Program
from ._transformer import TRANSFORMER_SIZES, Encoder


class BertQA(Program):
    name = "bert_qa"
    trait = "static Transformer encoder with a span head; AutoGraph converts it"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = TRANSFORMER_SIZES[size]
        self.encoder = Encoder(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"])
        self.qa_head = keras.layers.Dense(2)
        ids = keras.Input((c["seq"],), dtype="int32")
        self.model = keras.Model(ids, self.qa_head(self.encoder(ids)))
        self.optimizer = keras.optimizers.Adam(1e-4)
        self.ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        r, b, n = self.np_rng, c["batch"], c["seq"]
        self.batches = []
        for _ in range(self.pool_size):
            start = r.integers(1, n - 4, b)
            end = start + r.integers(0, 4, b)
            self.batches.append((tf.constant(r.integers(0, c["vocab"], (b, n)), tf.int32),
                                 tf.constant(start), tf.constant(end)))

    def train_step(self, ids, start, end):
        with self.tape_cls() as tape:
            logits = self.model(ids, training=True)
            start_logits, end_logits = tf.unstack(logits, axis=-1)
            loss = (self.ce(start, start_logits) + self.ce(end, end_logits)) / 2.0
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss


def build(tape_cls, seed=0, size="bench"):
    return BertQA(tape_cls, seed, size)
