"""Variational AutoEncoder (keras-io), the VAE model's custom train step.

Source: https://keras.io/examples/generative/vae/ (keras-team/keras-io,
examples/generative/vae.py, by fchollet, Keras 3 version), Apache-2.0.
Adapted: synthetic 16x16x1 images in [0, 1] instead of MNIST 28x28 (so the decoder starts at
4x4 instead of 7x7), fewer filters, a smaller Dense, batch 64 instead of 128; the VAE's own
`train_step` is driven by a plain `for data in dataset` loop over a seeded, shuffled tf.data
dataset instead of `vae.fit` (the trackers are reset at each epoch's start, as fit does);
`tf.GradientTape` is the benchmark's `Tape`. Kept: the Sampling layer drawing
`keras.random.normal(..., seed=self.seed_generator)` from a `SeedGenerator(1337)`, the functional
encoder (Conv2D x2, Flatten, Dense, z_mean / z_log_var, Sampling) and decoder (Dense, Reshape,
Conv2DTranspose x3), the VAE model class with three `keras.metrics.Mean` trackers updated every
step, the reconstruction (binary cross-entropy summed over pixels) + KL loss written with
`keras.ops`, Adam() defaults, latent_dim 2.
"""
import keras
import tensorflow as tf
from keras import layers, ops

from ._util import identity, seed_all, values

SOURCE = "https://keras.io/examples/generative/vae/"
LICENSE = "Apache-2.0"
TRAIT = "Keras model train_step, SeedGenerator random layer, three Mean trackers updated per step"
SIZES = {
    "bench": dict(n=1024, batch=64, enc=(16, 32), dense=16, dec=(32, 16)),
    "tiny": dict(n=48, batch=8, enc=(4, 8), dense=4, dec=(8, 4)),
}


class Sampling(layers.Layer):
    """Uses (z_mean, z_log_var) to sample z, the vector encoding a digit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        batch = ops.shape(z_mean)[0]
        dim = ops.shape(z_mean)[1]
        epsilon = keras.random.normal(shape=(batch, dim), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder, Tape=tf.GradientTape, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.Tape = Tape  # the benchmark's tape class (tf.GradientTape in the example)
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(
            name="reconstruction_loss"
        )
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [
            self.total_loss_tracker,
            self.reconstruction_loss_tracker,
            self.kl_loss_tracker,
        ]

    def train_step(self, data):
        with self.Tape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(
                    keras.losses.binary_crossentropy(data, reconstruction),
                    axis=(1, 2),
                )
            )
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {
            "loss": self.total_loss_tracker.result(),
            "reconstruction_loss": self.reconstruction_loss_tracker.result(),
            "kl_loss": self.kl_loss_tracker.result(),
        }


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    e1, e2 = c["enc"]
    d1, d2 = c["dec"]
    latent_dim = 2

    encoder_inputs = keras.Input(shape=(16, 16, 1))
    x = layers.Conv2D(e1, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Conv2D(e2, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Flatten()(x)
    x = layers.Dense(c["dense"], activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var])
    encoder = keras.Model(encoder_inputs, [z_mean, z_log_var, z], name="encoder")

    latent_inputs = keras.Input(shape=(latent_dim,))
    x = layers.Dense(4 * 4 * d1, activation="relu")(latent_inputs)
    x = layers.Reshape((4, 4, d1))(x)
    x = layers.Conv2DTranspose(d1, 3, activation="relu", strides=2, padding="same")(x)
    x = layers.Conv2DTranspose(d2, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")

    # Stand-in for MNIST digits scaled to [0, 1]: blocky random 0..255 patterns plus noise.
    digits = rng.uniform(0, 255, (c["n"], 4, 4, 1)).repeat(4, axis=1).repeat(4, axis=2)
    digits = (digits + rng.normal(0, 40, digits.shape)).clip(0, 255)
    mnist_digits = digits.astype("float32") / 255
    train_dataset = tf.data.Dataset.from_tensor_slices(mnist_digits).shuffle(
        c["n"], seed=seed).batch(c["batch"])

    vae = VAE(encoder, decoder, Tape=Tape)
    vae.compile(optimizer=keras.optimizers.Adam())

    # `vae.fit(mnist_digits, epochs=30, batch_size=128)` runs this (as a tf.function).
    train_step = (decorate or identity)(vae.train_step)
    losses, i = [], 0
    while i < steps:  # epochs
        for metric in vae.metrics:  # fit resets the metrics at the start of every epoch
            metric.reset_state()
        for data in train_dataset:
            logs = train_step(data)
            losses.append(float(logs["loss"]))
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break
    return {"losses": losses, "variables": values(vae, vae.optimizer, *vae.metrics)}
