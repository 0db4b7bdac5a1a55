"""DCGAN as in the TF2 tutorial: generator and discriminator trained in one step with two tapes
and two Adam optimizers. Trait: two tapes and two optimizer updates per iteration. The noise is
drawn in Python (numpy, seeded) and passed in, so every mode sees the same noise."""
import keras
import tensorflow as tf
from keras import layers

from ._common import Program

SIZES = {
    "bench": dict(hw=32, noise=100, g=64, d=64, batch=16),
    "tiny": dict(hw=8, noise=8, g=4, d=4, batch=2),
}


def generator(hw, noise, g, **_):
    s = hw // 4
    return keras.Sequential([
        keras.Input((noise,)),
        layers.Dense(s * s * g * 4, use_bias=False), layers.BatchNormalization(), layers.LeakyReLU(0.2),
        layers.Reshape((s, s, g * 4)),
        layers.Conv2DTranspose(g * 2, 5, 1, padding="same", use_bias=False), layers.BatchNormalization(), layers.LeakyReLU(0.2),
        layers.Conv2DTranspose(g, 5, 2, padding="same", use_bias=False), layers.BatchNormalization(), layers.LeakyReLU(0.2),
        layers.Conv2DTranspose(3, 5, 2, padding="same", use_bias=False, activation="tanh"),
    ])


def discriminator(hw, d, **_):
    return keras.Sequential([
        keras.Input((hw, hw, 3)),
        layers.Conv2D(d, 5, 2, padding="same"), layers.LeakyReLU(0.2),
        layers.Conv2D(d * 2, 5, 2, padding="same"), layers.LeakyReLU(0.2),
        layers.Flatten(), layers.Dense(1),
    ])


class DCGAN(Program):
    name = "dcgan"
    trait = "two tapes and two optimizers per step"

    def __init__(self, tape_cls, seed=0, size="bench"):
        super().__init__(tape_cls, seed, size)
        c = SIZES[size]
        self.generator = generator(**c)
        self.discriminator = discriminator(**c)
        self.g_opt = keras.optimizers.Adam(2e-4, beta_1=0.5)
        self.d_opt = keras.optimizers.Adam(2e-4, beta_1=0.5)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        r, b = self.np_rng, c["batch"]
        self.batches = [(tf.constant(r.uniform(-1, 1, (b, c["hw"], c["hw"], 3)), tf.float32),
                         tf.constant(r.standard_normal((b, c["noise"])), tf.float32))
                        for _ in range(self.pool_size)]

    def models(self):
        return [self.generator, self.discriminator]

    def optimizers(self):
        return [self.g_opt, self.d_opt]

    def train_step(self, images, noise):
        with self.tape_cls() as gen_tape, self.tape_cls() as disc_tape:
            fake = self.generator(noise, training=True)
            real_out = self.discriminator(images, training=True)
            fake_out = self.discriminator(fake, training=True)
            gen_loss = self.bce(tf.ones_like(fake_out), fake_out)
            disc_loss = self.bce(tf.ones_like(real_out), real_out) + self.bce(tf.zeros_like(fake_out), fake_out)
        g_vars = self.generator.trainable_variables
        d_vars = self.discriminator.trainable_variables
        self.g_opt.apply_gradients(zip(gen_tape.gradient(gen_loss, g_vars), g_vars))
        self.d_opt.apply_gradients(zip(disc_tape.gradient(disc_loss, d_vars), d_vars))
        return gen_loss + disc_loss


def build(tape_cls, seed=0, size="bench"):
    return DCGAN(tape_cls, seed, size)
