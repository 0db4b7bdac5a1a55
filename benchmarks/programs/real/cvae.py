"""Convolutional Variational Autoencoder (TensorFlow tutorial), the CVAE train step.

Source: https://www.tensorflow.org/tutorials/generative/cvae (tensorflow/docs,
site/en/tutorials/generative/cvae.ipynb), Apache-2.0.
Adapted: synthetic binarised 16x16x1 images instead of MNIST 28x28 (so the decoder starts at 4x4
instead of 7x7), fewer filters, smaller train/test sets, seeded shuffles, `keras.Input` layers
instead of `InputLayer(input_shape=)`; `train_step` returns its loss (the tutorial's returns
nothing). Kept: the CVAE model class (encoder Conv2D-Conv2D-Flatten-Dense(2*latent), decoder
Dense-Reshape-Conv2DTranspose x3), encode / reparameterize (`tf.random.normal(shape=mean.shape)`)
/ decode, `log_normal_pdf`, `compute_loss` (single-sample Monte Carlo ELBO), Adam(1e-4),
latent_dim 2, batch 32, `for train_x in train_dataset: train_step(model, train_x, optimizer)` and
the ELBO on the test set after every epoch (appended to the losses).
"""
import keras
import numpy as np
import tensorflow as tf

from ._util import identity, seed_all, values

SOURCE = "https://www.tensorflow.org/tutorials/generative/cvae"
LICENSE = "Apache-2.0"
TRAIT = "VAE model class, tf.random.normal reparameterisation with shape=mean.shape, per-epoch test ELBO"
SIZES = {
    "bench": dict(train_size=1024, test_size=128, batch_size=32, enc=(16, 32), dec=(32, 16)),
    "tiny": dict(train_size=48, test_size=16, batch_size=8, enc=(4, 8), dec=(8, 4)),
}


class CVAE(keras.Model):
    """Convolutional variational autoencoder."""

    def __init__(self, latent_dim, enc, dec):
        super(CVAE, self).__init__()
        self.latent_dim = latent_dim
        self.encoder = keras.Sequential(
            [
                keras.Input(shape=(16, 16, 1)),
                keras.layers.Conv2D(
                    filters=enc[0], kernel_size=3, strides=(2, 2), activation="relu"),
                keras.layers.Conv2D(
                    filters=enc[1], kernel_size=3, strides=(2, 2), activation="relu"),
                keras.layers.Flatten(),
                # No activation
                keras.layers.Dense(latent_dim + latent_dim),
            ]
        )

        self.decoder = keras.Sequential(
            [
                keras.Input(shape=(latent_dim,)),
                keras.layers.Dense(units=4 * 4 * dec[1], activation=tf.nn.relu),
                keras.layers.Reshape(target_shape=(4, 4, dec[1])),
                keras.layers.Conv2DTranspose(
                    filters=dec[0], kernel_size=3, strides=2, padding="same",
                    activation="relu"),
                keras.layers.Conv2DTranspose(
                    filters=dec[1], kernel_size=3, strides=2, padding="same",
                    activation="relu"),
                # No activation
                keras.layers.Conv2DTranspose(
                    filters=1, kernel_size=3, strides=1, padding="same"),
            ]
        )

    def sample(self, eps=None):  # the tutorial's @tf.function sampler (not used in training)
        if eps is None:
            eps = tf.random.normal(shape=(100, self.latent_dim))
        return self.decode(eps, apply_sigmoid=True)

    def encode(self, x):
        mean, logvar = tf.split(self.encoder(x), num_or_size_splits=2, axis=1)
        return mean, logvar

    def reparameterize(self, mean, logvar):
        eps = tf.random.normal(shape=mean.shape)
        return eps * tf.exp(logvar * .5) + mean

    def decode(self, z, apply_sigmoid=False):
        logits = self.decoder(z)
        if apply_sigmoid:
            probs = tf.sigmoid(logits)
            return probs
        return logits


def log_normal_pdf(sample, mean, logvar, raxis=1):
    log2pi = tf.math.log(2. * np.pi)
    return tf.reduce_sum(
        -.5 * ((sample - mean) ** 2. * tf.exp(-logvar) + logvar + log2pi),
        axis=raxis)


def compute_loss(model, x):
    mean, logvar = model.encode(x)
    z = model.reparameterize(mean, logvar)
    x_logit = model.decode(z)
    cross_ent = tf.nn.sigmoid_cross_entropy_with_logits(logits=x_logit, labels=x)
    logpx_z = -tf.reduce_sum(cross_ent, axis=[1, 2, 3])
    logpz = log_normal_pdf(z, 0., 0.)
    logqz_x = log_normal_pdf(z, mean, logvar)
    return -tf.reduce_mean(logpx_z + logpz - logqz_x)


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    train_size, test_size, batch_size = c["train_size"], c["test_size"], c["batch_size"]

    def preprocess_images(images):
        images = images.reshape((images.shape[0], 16, 16, 1)) / 255.
        return np.where(images > .5, 1.0, 0.0).astype("float32")

    # Stand-in for MNIST: blocky random 0..255 "strokes" (4x4 pattern upsampled, plus noise).
    def synthetic_images(n):
        coarse = rng.uniform(0, 255, (n, 4, 4)).repeat(4, axis=1).repeat(4, axis=2)
        return (coarse + rng.normal(0, 40, coarse.shape)).clip(0, 255)

    train_images = preprocess_images(synthetic_images(train_size))
    test_images = preprocess_images(synthetic_images(test_size))
    train_dataset = (tf.data.Dataset.from_tensor_slices(train_images)
                     .shuffle(train_size, seed=seed).batch(batch_size))
    test_dataset = (tf.data.Dataset.from_tensor_slices(test_images)
                    .shuffle(test_size, seed=seed + 1).batch(batch_size))

    optimizer = keras.optimizers.Adam(1e-4)

    # The tutorial decorates this with @tf.function.
    def train_step(model, x, optimizer):
        """Executes one training step and returns the loss.

        This function computes the loss and gradients, and uses the latter to
        update the model's parameters.
        """
        with Tape() as tape:
            loss = compute_loss(model, x)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    train_step = (decorate or identity)(train_step)

    latent_dim = 2
    model = CVAE(latent_dim, c["enc"], c["dec"])

    losses, elbos, i = [], [], 0
    while i < steps:  # for epoch in range(1, epochs + 1)
        for train_x in train_dataset:
            loss = train_step(model, train_x, optimizer)
            losses.append(float(loss))
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break

        loss = keras.metrics.Mean()
        for test_x in test_dataset:
            loss(compute_loss(model, test_x))
        elbo = -loss.result()
        elbos.append(float(elbo))
    return {"losses": losses + elbos, "variables": values(model, optimizer)}
