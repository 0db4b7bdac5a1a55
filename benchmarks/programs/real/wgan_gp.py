"""WGAN-GP overriding `Model.train_step` (keras-io), the critic/generator train step.

Source: https://keras.io/examples/generative/wgan_gp/ (keras-team/keras-io,
examples/generative/wgan_gp.py, by A_K_Nain), Apache-2.0.
Adapted: synthetic 12x12x1 images in [-1, 1] instead of Fashion-MNIST 28x28 (the critic pads to
16x16 instead of 32x32 and the generator crops 16x16 to 12x12, as the example does with 32 and 28),
fewer filters, latent 16 instead of 128, batch 64 instead of 512; the WGAN's own `train_step`
is driven by a plain `for real_images in dataset` loop over a seeded, shuffled tf.data dataset
instead of `wgan.fit` (no GANMonitor callback). Kept: conv_block / upsample_block stacks
(ZeroPadding2D, four strided 5x5 Conv2D with LeakyReLU(0.2) and Dropout; Dense-BN-LeakyReLU-Reshape,
three UpSampling2D-Conv2D-BN blocks, Cropping2D), the WGAN class with compile / gradient_penalty /
train_step: `discriminator_extra_steps=3` critic updates each drawing `tf.random.normal` latents,
the gradient penalty on `alpha = tf.random.uniform(...)` interpolates computed with an inner tape
nested in the critic tape, then one generator update; Adam(2e-4, 0.5, 0.9) for both models, the
Wasserstein losses, gp_weight 10.
"""
import keras
import tensorflow as tf
from keras import layers

from ._util import identity, seed_all, values

SOURCE = "https://keras.io/examples/generative/wgan_gp/"
LICENSE = "Apache-2.0"
TRAIT = "GAN with d_steps Python loop, nested gradient-penalty tape (gradient of a gradient)"
SIZES = {
    "bench": dict(n=1000, batch=64, noise_dim=16, d=(8, 16, 32, 64), g=(64, 32, 16)),
    "tiny": dict(n=20, batch=8, noise_dim=4, d=(2, 4, 4, 8), g=(8, 4, 4)),
}


def conv_block(
    x,
    filters,
    activation,
    kernel_size=(3, 3),
    strides=(1, 1),
    padding="same",
    use_bias=True,
    use_bn=False,
    use_dropout=False,
    drop_value=0.5,
):
    x = layers.Conv2D(
        filters, kernel_size, strides=strides, padding=padding, use_bias=use_bias
    )(x)
    if use_bn:
        x = layers.BatchNormalization()(x)
    x = activation(x)
    if use_dropout:
        x = layers.Dropout(drop_value)(x)
    return x


def get_discriminator_model(IMG_SHAPE, d):
    img_input = layers.Input(shape=IMG_SHAPE)
    # Zero pad the input to make the input images size to (16, 16, 1).
    x = layers.ZeroPadding2D((2, 2))(img_input)
    x = conv_block(x, d[0], kernel_size=(5, 5), strides=(2, 2), use_bn=False, use_bias=True,
                   activation=layers.LeakyReLU(0.2), use_dropout=False, drop_value=0.3)
    x = conv_block(x, d[1], kernel_size=(5, 5), strides=(2, 2), use_bn=False,
                   activation=layers.LeakyReLU(0.2), use_bias=True, use_dropout=True, drop_value=0.3)
    x = conv_block(x, d[2], kernel_size=(5, 5), strides=(2, 2), use_bn=False,
                   activation=layers.LeakyReLU(0.2), use_bias=True, use_dropout=True, drop_value=0.3)
    x = conv_block(x, d[3], kernel_size=(5, 5), strides=(2, 2), use_bn=False,
                   activation=layers.LeakyReLU(0.2), use_bias=True, use_dropout=False, drop_value=0.3)

    x = layers.Flatten()(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Dense(1)(x)

    d_model = keras.models.Model(img_input, x, name="discriminator")
    return d_model


def upsample_block(
    x,
    filters,
    activation,
    kernel_size=(3, 3),
    strides=(1, 1),
    up_size=(2, 2),
    padding="same",
    use_bn=False,
    use_bias=True,
    use_dropout=False,
    drop_value=0.3,
):
    x = layers.UpSampling2D(up_size)(x)
    x = layers.Conv2D(
        filters, kernel_size, strides=strides, padding=padding, use_bias=use_bias
    )(x)

    if use_bn:
        x = layers.BatchNormalization()(x)

    if activation:
        x = activation(x)
    if use_dropout:
        x = layers.Dropout(drop_value)(x)
    return x


def get_generator_model(noise_dim, g):
    noise = layers.Input(shape=(noise_dim,))
    x = layers.Dense(2 * 2 * g[0], use_bias=False)(noise)
    x = layers.BatchNormalization()(x)
    x = layers.LeakyReLU(0.2)(x)

    x = layers.Reshape((2, 2, g[0]))(x)
    x = upsample_block(x, g[1], layers.LeakyReLU(0.2), strides=(1, 1), use_bias=False,
                       use_bn=True, padding="same", use_dropout=False)
    x = upsample_block(x, g[2], layers.LeakyReLU(0.2), strides=(1, 1), use_bias=False,
                       use_bn=True, padding="same", use_dropout=False)
    x = upsample_block(x, 1, layers.Activation("tanh"), strides=(1, 1), use_bias=False, use_bn=True)
    # At this point, we have an output which has the same shape as the input, (16, 16, 1).
    # We will use a Cropping2D layer to make it (12, 12, 1).
    x = layers.Cropping2D((2, 2))(x)

    g_model = keras.models.Model(noise, x, name="generator")
    return g_model


class WGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3,
                 gp_weight=10.0, Tape=tf.GradientTape):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight
        self.Tape = Tape  # the benchmark's tape class (tf.GradientTape in the example)

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        """Calculates the gradient penalty.

        This loss is calculated on an interpolated image
        and added to the discriminator loss.
        """
        # Get the interpolated image
        alpha = tf.random.uniform([batch_size, 1, 1, 1], 0.0, 1.0)
        diff = fake_images - real_images
        interpolated = real_images + alpha * diff

        with self.Tape() as gp_tape:
            gp_tape.watch(interpolated)
            # 1. Get the discriminator output for this interpolated image.
            pred = self.discriminator(interpolated, training=True)

        # 2. Calculate the gradients w.r.t to this interpolated image.
        grads = gp_tape.gradient(pred, [interpolated])[0]
        # 3. Calculate the norm of the gradients.
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        gp = tf.reduce_mean((norm - 1.0) ** 2)
        return gp

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]

        # Get the batch size
        batch_size = tf.shape(real_images)[0]

        # For each batch, we are going to perform the
        # following steps as laid out in the original paper:
        # 1. Train the generator and get the generator loss
        # 2. Train the discriminator and get the discriminator loss
        # 3. Calculate the gradient penalty
        # 4. Multiply this gradient penalty with a constant weight factor
        # 5. Add the gradient penalty to the discriminator loss
        # 6. Return the generator and discriminator losses as a loss dictionary

        # Train the discriminator first. The original paper recommends training
        # the discriminator for `x` more steps (typically 5) as compared to
        # one step of the generator. Here we will train it for 3 extra steps
        # as compared to 5 to reduce the training time.
        for i in range(self.d_steps):
            # Get the latent vector
            random_latent_vectors = tf.random.normal(
                shape=(batch_size, self.latent_dim)
            )
            with self.Tape() as tape:
                # Generate fake images from the latent vector
                fake_images = self.generator(random_latent_vectors, training=True)
                # Get the logits for the fake images
                fake_logits = self.discriminator(fake_images, training=True)
                # Get the logits of the real images
                real_logits = self.discriminator(real_images, training=True)

                # Calculate the discriminator loss using the fake and real image logits
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                # Calculate the gradient penalty
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                # Add the gradient penalty to the original discriminator loss
                d_loss = d_cost + gp * self.gp_weight

            # Get the gradients w.r.t the discriminator loss
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            # Update the weights of the discriminator using the discriminator optimizer
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)
            )

        # Train the generator
        # Get the latent vector
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with self.Tape() as tape:
            # Generate fake images using the generator
            generated_images = self.generator(random_latent_vectors, training=True)
            # Get the discriminator logits for fake images
            gen_img_logits = self.discriminator(generated_images, training=True)
            # Calculate the generator loss
            g_loss = self.g_loss_fn(gen_img_logits)

        # Get the gradients w.r.t the generator loss
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        # Update the weights of the generator using the generator optimizer
        self.g_optimizer.apply_gradients(
            zip(gen_gradient, self.generator.trainable_variables)
        )
        return {"d_loss": d_loss, "g_loss": g_loss}


# Define the loss function for the discriminator, which should be (fake_loss - real_loss).
# We will add the gradient penalty later to this loss function.
def discriminator_loss(real_img, fake_img):
    real_loss = tf.reduce_mean(real_img)
    fake_loss = tf.reduce_mean(fake_img)
    return fake_loss - real_loss


# Define the loss functions for the generator.
def generator_loss(fake_img):
    return -tf.reduce_mean(fake_img)


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    IMG_SHAPE = (12, 12, 1)
    BATCH_SIZE = c["batch"]
    noise_dim = c["noise_dim"]
    # Stand-in for Fashion-MNIST (0..255, then normalised to [-1, 1] as in the example).
    train_images = rng.uniform(0, 255, (c["n"], 3, 3, 1)).repeat(4, axis=1).repeat(4, axis=2)
    train_images = (train_images + rng.normal(0, 30, train_images.shape)).clip(0, 255)
    train_images = train_images.reshape(train_images.shape[0], *IMG_SHAPE).astype("float32")
    train_images = (train_images - 127.5) / 127.5
    train_dataset = tf.data.Dataset.from_tensor_slices(train_images).shuffle(
        c["n"], seed=seed).batch(BATCH_SIZE)

    d_model = get_discriminator_model(IMG_SHAPE, c["d"])
    g_model = get_generator_model(noise_dim, c["g"])

    # Instantiate the optimizer for both networks
    # (learning_rate=0.0002, beta_1=0.5 are recommended)
    generator_optimizer = keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9)
    discriminator_optimizer = keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9)

    # Instantiate the WGAN model.
    wgan = WGAN(discriminator=d_model, generator=g_model, latent_dim=noise_dim,
                discriminator_extra_steps=3, Tape=Tape)

    # Compile the WGAN model.
    wgan.compile(
        d_optimizer=discriminator_optimizer,
        g_optimizer=generator_optimizer,
        g_loss_fn=generator_loss,
        d_loss_fn=discriminator_loss,
    )

    # `wgan.fit(train_images, batch_size=BATCH_SIZE, epochs=epochs)` runs this (as a tf.function).
    train_step = (decorate or identity)(wgan.train_step)
    losses, i = [], 0
    while i < steps:  # epochs
        for real_images in train_dataset:
            logs = train_step(real_images)
            losses += [float(logs["g_loss"]), float(logs["d_loss"])]
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break
    return {"losses": losses,
            "variables": values(g_model, d_model, generator_optimizer, discriminator_optimizer)}
