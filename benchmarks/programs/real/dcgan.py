"""Deep Convolutional Generative Adversarial Network (TensorFlow tutorial), the DCGAN train step.

Source: https://www.tensorflow.org/tutorials/generative/dcgan (tensorflow/docs,
site/en/tutorials/generative/dcgan.ipynb), Apache-2.0.
Adapted: synthetic 16x16x1 images in [-1, 1] instead of MNIST 28x28 (so the generator starts at
4x4 instead of 7x7), fewer filters, a smaller noise vector and batch, a seeded shuffle, explicit
`layers.Input` instead of `input_shape=`; the train step returns its two losses (the tutorial's
returns nothing). Kept: both Sequential stacks (Dense-BN-LeakyReLU-Reshape, three
Conv2DTranspose with BatchNormalization; Conv2D-LeakyReLU-Dropout twice, Flatten, Dense), the
BinaryCrossentropy(from_logits=True) losses, two Adam(1e-4) optimizers, the noise drawn with
`tf.random.normal([BATCH_SIZE, noise_dim])` inside the step (BATCH_SIZE even for the short last
batch, as in the tutorial), the two tapes opened in one `with`, and `for image_batch in dataset`.
"""
import keras
import tensorflow as tf
from keras import layers

from ._util import identity, seed_all, values

SOURCE = "https://www.tensorflow.org/tutorials/generative/dcgan"
LICENSE = "Apache-2.0"
TRAIT = "GAN: two models, two tapes in one with, two optimizers, BatchNorm, Dropout, tf.random noise"
SIZES = {
    "bench": dict(n=1000, batch=64, noise_dim=64, g=(32, 16, 8), d=(16, 32)),
    "tiny": dict(n=36, batch=8, noise_dim=8, g=(8, 4, 4), d=(4, 8)),
}


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    BUFFER_SIZE = c["n"]
    BATCH_SIZE = c["batch"]
    noise_dim = c["noise_dim"]
    g1, g2, g3 = c["g"]
    d1, d2 = c["d"]
    # Stand-in for the normalised MNIST images: smooth random blobs in [-1, 1].
    train_images = rng.normal(0, 1, (c["n"], 4, 4, 1)).repeat(4, axis=1).repeat(4, axis=2)
    train_images = (train_images + 0.3 * rng.normal(0, 1, train_images.shape)).clip(-1, 1)
    train_images = train_images.astype("float32")
    train_dataset = tf.data.Dataset.from_tensor_slices(train_images).shuffle(
        BUFFER_SIZE, seed=seed).batch(BATCH_SIZE)

    def make_generator_model():
        model = keras.Sequential()
        model.add(layers.Input((noise_dim,)))
        model.add(layers.Dense(4 * 4 * g1, use_bias=False))
        model.add(layers.BatchNormalization())
        model.add(layers.LeakyReLU())

        model.add(layers.Reshape((4, 4, g1)))
        assert model.output_shape == (None, 4, 4, g1)  # Note: None is the batch size

        model.add(layers.Conv2DTranspose(g2, (5, 5), strides=(1, 1), padding="same", use_bias=False))
        assert model.output_shape == (None, 4, 4, g2)
        model.add(layers.BatchNormalization())
        model.add(layers.LeakyReLU())

        model.add(layers.Conv2DTranspose(g3, (5, 5), strides=(2, 2), padding="same", use_bias=False))
        assert model.output_shape == (None, 8, 8, g3)
        model.add(layers.BatchNormalization())
        model.add(layers.LeakyReLU())

        model.add(layers.Conv2DTranspose(1, (5, 5), strides=(2, 2), padding="same", use_bias=False,
                                         activation="tanh"))
        assert model.output_shape == (None, 16, 16, 1)
        return model

    def make_discriminator_model():
        model = keras.Sequential()
        model.add(layers.Input((16, 16, 1)))
        model.add(layers.Conv2D(d1, (5, 5), strides=(2, 2), padding="same"))
        model.add(layers.LeakyReLU())
        model.add(layers.Dropout(0.3))

        model.add(layers.Conv2D(d2, (5, 5), strides=(2, 2), padding="same"))
        model.add(layers.LeakyReLU())
        model.add(layers.Dropout(0.3))

        model.add(layers.Flatten())
        model.add(layers.Dense(1))
        return model

    generator = make_generator_model()
    discriminator = make_discriminator_model()

    # This method returns a helper function to compute cross entropy loss
    cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True)

    def discriminator_loss(real_output, fake_output):
        real_loss = cross_entropy(tf.ones_like(real_output), real_output)
        fake_loss = cross_entropy(tf.zeros_like(fake_output), fake_output)
        total_loss = real_loss + fake_loss
        return total_loss

    def generator_loss(fake_output):
        return cross_entropy(tf.ones_like(fake_output), fake_output)

    generator_optimizer = keras.optimizers.Adam(1e-4)
    discriminator_optimizer = keras.optimizers.Adam(1e-4)

    # The tutorial decorates this with @tf.function ("causes the function to be compiled").
    def train_step(images):
        noise = tf.random.normal([BATCH_SIZE, noise_dim])

        with Tape() as gen_tape, Tape() as disc_tape:
            generated_images = generator(noise, training=True)

            real_output = discriminator(images, training=True)
            fake_output = discriminator(generated_images, training=True)

            gen_loss = generator_loss(fake_output)
            disc_loss = discriminator_loss(real_output, fake_output)

        gradients_of_generator = gen_tape.gradient(gen_loss, generator.trainable_variables)
        gradients_of_discriminator = disc_tape.gradient(disc_loss, discriminator.trainable_variables)

        generator_optimizer.apply_gradients(zip(gradients_of_generator, generator.trainable_variables))
        discriminator_optimizer.apply_gradients(
            zip(gradients_of_discriminator, discriminator.trainable_variables))
        return gen_loss, disc_loss

    train_step = (decorate or identity)(train_step)

    def train(dataset):
        losses, i = [], 0
        while i < steps:  # epochs
            for image_batch in dataset:
                gen_loss, disc_loss = train_step(image_batch)
                losses += [float(gen_loss), float(disc_loss)]
                if on_step is not None:
                    on_step(i)
                i += 1
                if i == steps:
                    break
        return losses

    losses = train(train_dataset)
    return {"losses": losses,
            "variables": values(generator, discriminator, generator_optimizer, discriminator_optimizer)}
