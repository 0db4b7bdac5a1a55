"""BERT sentence classification whose metric is computed by scikit-learn on materialized
predictions inside the step, and fed back: per-class recall re-weights the loss of this step.
Trait: tensor materialization (``.numpy()``) plus a third-party call; AutoGraph cannot trace it."""
import keras
import numpy as np
import tensorflow as tf
from sklearn.metrics import f1_score, recall_score

from ._common import Program
from ._transformer import TRANSFORMER_SIZES, Encoder

CLASSES = 3


class BertCls(Program):
    name = "bert_cls"
    trait = "sklearn f1/recall on logits.numpy() inside the step; recall re-weights the loss"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = TRANSFORMER_SIZES[size]
        self.encoder = Encoder(c["vocab"], c["seq"], c["d"], c["heads"], c["layers"], c["ff"])
        ids = keras.Input((c["seq"],), dtype="int32")
        pooled = self.encoder(ids)[:, 0]
        self.model = keras.Model(ids, keras.layers.Dense(CLASSES)(keras.layers.Dense(c["d"], activation="tanh")(pooled)))
        self.optimizer = keras.optimizers.Adam(1e-4)
        r, b = self.np_rng, c["batch"]
        self.batches = [(tf.constant(r.integers(0, c["vocab"], (b, c["seq"])), tf.int32),
                         tf.constant(r.integers(0, CLASSES, b)))
                        for _ in range(self.pool_size)]
        self.f1_history = []

    def train_step(self, ids, labels):
        with self.tape_cls() as tape:
            logits = self.model(ids, training=True)
            preds = np.argmax(logits.numpy(), axis=-1)
            y = labels.numpy()
            f1 = f1_score(y, preds, labels=list(range(CLASSES)), average="macro", zero_division=0)
            recall = recall_score(y, preds, labels=list(range(CLASSES)), average=None, zero_division=0)
            weights = tf.gather(tf.constant(2.0 - recall, tf.float32), labels)
            ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            loss = tf.reduce_sum(weights * ce) / tf.reduce_sum(weights)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss, f1

    def step(self, i):
        loss, f1 = self.train_step(*self.batch(i))
        self.f1_history.append(float(f1))
        return float(loss)


def build(tape_cls, seed=0, size="bench"):
    return BertCls(tape_cls, seed, size)
