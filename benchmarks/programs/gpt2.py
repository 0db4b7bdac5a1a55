"""GPT-2 style causal language model (decoder-only, tied output embedding) trained with AdamW.
Trait: the sequence length changes from batch to batch (dynamic shapes: retracing, XLA recompiles)."""
import keras
import tensorflow as tf

from ._common import Program
from ._transformer import TRANSFORMER_SIZES, Encoder


class GPT2(Program):
    name = "gpt2"
    trait = "sequence length varies per batch (dynamic shapes)"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = TRANSFORMER_SIZES[size]
        self.model = Encoder(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"], causal=True)
        self.model(tf.zeros((1, c["seq"]), tf.int32))
        self.optimizer = keras.optimizers.AdamW(1e-4, weight_decay=0.01)
        r, b = self.np_rng, c["batch"]
        lengths = [c["seq"], c["seq"] * 3 // 4, c["seq"] // 2][: self.pool_size]
        self.batches = [(tf.constant(r.integers(0, c["vocab"], (b, n + 1)), tf.int32),) for n in lengths]

    def train_step(self, tokens):
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        with self.tape_cls() as tape:
            h = self.model(inputs, training=True)
            logits = tf.matmul(h, self.model.tok.embeddings, transpose_b=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(targets, logits))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss


def build(tape_cls, seed=0, size="bench"):
    return GPT2(tape_cls, seed, size)
