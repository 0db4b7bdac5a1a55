"""DropBlock (Ghiasi et al.) on a residual CNN, as in its open-source implementation: the layer
keeps ``keep_prob`` on the object and the training loop lowers it on a linear schedule.
Trait: Python object mutation (Figure 3.9(a)); a traced step freezes the ``keep_prob`` it saw."""
import keras
import tensorflow as tf
from keras import layers

from ._common import Program, image_batches
from ._convnet import CONVNET_SIZES, BasicBlock


class DropBlock(layers.Layer):
    def __init__(self, keep_prob=1.0, block_size=3, seed=0, **kw):
        super().__init__(**kw)
        self.keep_prob = keep_prob
        self.block_size = block_size
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, x, training=False):
        if not training or self.keep_prob >= 1.0:
            return x
        h, w = x.shape[1], x.shape[2]
        bs = self.block_size
        gamma = (1.0 - self.keep_prob) / bs**2 * (h * w) / ((h - bs + 1) * (w - bs + 1))
        u = keras.random.uniform(tf.shape(x), seed=self.seed_generator)
        seeds = tf.cast(u < gamma, x.dtype)
        block = tf.nn.max_pool2d(seeds, bs, 1, "SAME")
        mask = 1.0 - block
        scale = tf.cast(tf.size(mask), x.dtype) / (tf.reduce_sum(mask) + 1e-6)
        return x * mask * scale


class DropBlockNet(keras.Model):
    def __init__(self, widths, blocks, classes, **_):
        super().__init__()
        self.stem = layers.Conv2D(widths[0], 3, padding="same")
        self.stages = [[BasicBlock(w, 2 if (b == 0 and s > 0) else 1) for b in range(blocks)]
                       for s, w in enumerate(widths)]
        self.dropblock = DropBlock(keep_prob=1.0, block_size=3)
        self.head = layers.Dense(classes)

    def call(self, x, training=False):
        x = keras.ops.relu(self.stem(x))
        for s, stage in enumerate(self.stages):
            for blk in stage:
                x = blk(x, training=training)
            if s >= len(self.stages) - 2:
                x = self.dropblock(x, training=training)
        return self.head(keras.ops.mean(x, axis=(1, 2)))


class DropBlockProgram(Program):
    name = "dropblock"
    trait = "keep_prob mutated on the layer object by a schedule over steps"
    final_keep_prob, schedule_steps = 0.85, 6

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = CONVNET_SIZES[size]
        self.model = DropBlockNet(**c)
        self.model(tf.zeros((1, c["hw"], c["hw"], 3)))
        self.optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.batches = image_batches(self.np_rng, c["batch"], c["hw"], c["classes"], self.pool_size)

    def keep_prob_at(self, i):
        frac = min(1.0, i / self.schedule_steps)
        return 1.0 - frac * (1.0 - self.final_keep_prob)

    def train_step(self, x, y):
        with self.tape_cls() as tape:
            loss = self.loss_fn(y, self.model(x, training=True))
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss

    def step(self, i):
        self.model.dropblock.keep_prob = self.keep_prob_at(i)
        return float(self.train_step(*self.batch(i)))


def build(tape_cls, seed=0, size="bench"):
    return DropBlockProgram(tape_cls, seed, size)
