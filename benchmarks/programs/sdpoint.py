"""SDPoint (stochastic downsampling point): each step the model picks, with Python's ``random``,
the block after which the feature map is downsampled and by how much (as in the original, the
choice is made inside the forward pass). Trait: a Python-side random choice per step that a traced
step freezes at trace time."""
import random

import keras
import tensorflow as tf
from keras import layers

from ._common import Program, image_batches
from ._convnet import CONVNET_SIZES, BasicBlock


class SDPointNet(keras.Model):
    def __init__(self, widths, blocks, classes, seed=0, **_):
        super().__init__()
        self.stem = layers.Conv2D(widths[0], 3, padding="same")
        self.blocks = [BasicBlock(w, 2 if (b == 0 and s > 0) else 1)
                       for s, w in enumerate(widths) for b in range(blocks)]
        self.head = layers.Dense(classes)
        # one Python RNG per model (seeded), so that every build draws the same sequence
        self.random = random.Random(seed)
        self.points = [None] + list(range(1, len(self.blocks)))
        self.ratios = [0.5, 0.75]

    def call(self, x, training=False):
        point = self.random.choice(self.points) if training else None
        ratio = self.random.choice(self.ratios) if point is not None else 1.0
        x = keras.ops.relu(self.stem(x))
        for k, blk in enumerate(self.blocks):
            if k == point:
                h = max(1, int(x.shape[1] * ratio))
                x = tf.image.resize(x, (h, h), method="bilinear")
            x = blk(x, training=training)
        return self.head(keras.ops.mean(x, axis=(1, 2)))


class SDPoint(Program):
    name = "sdpoint"
    trait = "downsampling point drawn with Python random inside the forward pass"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = CONVNET_SIZES[size]
        self.model = SDPointNet(seed=seed, **c)
        self.model(tf.zeros((1, c["hw"], c["hw"], 3)))
        self.optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.batches = image_batches(self.np_rng, c["batch"], c["hw"], c["classes"], self.pool_size)

    def train_step(self, x, y):
        with self.tape_cls() as tape:
            loss = self.loss_fn(y, self.model(x, training=True))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss


def build(tape_cls, seed=0, size="bench"):
    return SDPoint(tape_cls, seed, size)
