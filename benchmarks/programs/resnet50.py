"""ResNet-50 (bottleneck blocks 3-4-6-3, CIFAR stem) trained with a custom loop, as in the TF2
tutorials. Trait: none in particular; a large, static graph (many small Keras layers)."""
import keras
import tensorflow as tf
from keras import layers

from ._common import Program, image_batches

SIZES = {
    "bench": dict(stages=(3, 4, 6, 3), width=64, hw=32, batch=4, classes=10),
    "tiny": dict(stages=(1, 1), width=4, hw=8, batch=2, classes=4),
}


def bottleneck(x, filters, stride):
    y = layers.Conv2D(filters, 1, stride, use_bias=False)(x)
    y = layers.ReLU()(layers.BatchNormalization()(y))
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = layers.ReLU()(layers.BatchNormalization()(y))
    y = layers.Conv2D(4 * filters, 1, use_bias=False)(y)
    y = layers.BatchNormalization()(y)
    if stride != 1 or x.shape[-1] != 4 * filters:
        x = layers.BatchNormalization()(layers.Conv2D(4 * filters, 1, stride, use_bias=False)(x))
    return layers.ReLU()(layers.Add()([x, y]))


def resnet(stages, width, hw, classes, **_):
    inp = keras.Input((hw, hw, 3))
    x = layers.Conv2D(width, 3, padding="same", use_bias=False)(inp)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for s, blocks in enumerate(stages):
        for b in range(blocks):
            x = bottleneck(x, width * 2**s, 2 if (b == 0 and s > 0) else 1)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(classes)(x))


class ResNet50(Program):
    name = "resnet50"
    trait = "static graph of ~170 Keras layers; AutoGraph converts it"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = SIZES[size]
        self.model = resnet(**c)
        self.optimizer = keras.optimizers.SGD(0.001, momentum=0.9)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.batches = image_batches(self.np_rng, c["batch"], c["hw"], c["classes"], self.pool_size)

    def train_step(self, x, y):
        with self.tape_cls() as tape:
            logits = self.model(x, training=True)
            loss = self.loss_fn(y, logits)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss


def build(tape_cls, seed=0, size="bench"):
    return ResNet50(tape_cls, seed, size)
