"""Neural style transfer (TF tutorial): optimize an image variable against gram-matrix targets.

Source: https://www.tensorflow.org/tutorials/generative/style_transfer (tensorflow/docs,
site/en/tutorials/generative/style_transfer.ipynb), Apache-2.0.
Adapted: VGG19 with ImageNet weights (a download) is replaced by a small randomly initialized
VGG-like Keras conv extractor (3 blocks of 2 convs + max-pooling, layers named like VGG's) whose
`block{1,2,3}_conv1` outputs are the style layers and `block3_conv2` the content layer; the
content and style images are synthetic (smooth colour blobs and coloured stripes, NumPy, from the
seed) and small (64x64 instead of max_dim 512). Kept: `vgg19.preprocess_input`,
`gram_matrix`, `StyleContentModel`, `style_content_loss` with the tutorial's weights,
`clip_0_1`, Adam(0.02, beta_1=0.99, epsilon=0.1), and the final `train_step(image)` with
`total_variation_weight * tf.image.total_variation(image)`, run for epochs x steps_per_epoch.
The train step also returns its loss (the tutorial's returns nothing) so the run can record it.
"""
import keras
import numpy as np
import tensorflow as tf

from ._util import identity, seed_all, values

SOURCE = "https://www.tensorflow.org/tutorials/generative/style_transfer"
LICENSE = "Apache-2.0"
TRAIT = "optimizes a tf.Variable image (no model weights trained), gram matrices, assign after step"
SIZES = {
    "bench": dict(size=64, filters=(32, 64, 64), steps_per_epoch=100),
    "tiny": dict(size=16, filters=(4, 8, 8), steps_per_epoch=5),
}

content_layers = ['block3_conv2']
style_layers = ['block1_conv1', 'block2_conv1', 'block3_conv1']
num_content_layers = len(content_layers)
num_style_layers = len(style_layers)


def vgg_layers(layer_names, filters):
    """A small VGG-like extractor with random weights, in place of VGG19(weights='imagenet')."""
    inputs = keras.Input(shape=(None, None, 3))
    x = inputs
    for b, f in enumerate(filters, start=1):
        x = keras.layers.Conv2D(f, 3, padding='same', activation='relu', name=f'block{b}_conv1')(x)
        x = keras.layers.Conv2D(f, 3, padding='same', activation='relu', name=f'block{b}_conv2')(x)
        if b < len(filters):
            x = keras.layers.MaxPooling2D(2, name=f'block{b}_pool')(x)
    vgg = keras.Model(inputs, x)
    vgg.trainable = False
    outputs = [vgg.get_layer(name).output for name in layer_names]
    model = keras.Model([vgg.input], outputs)
    return model


def gram_matrix(input_tensor):
    result = tf.linalg.einsum('bijc,bijd->bcd', input_tensor, input_tensor)
    input_shape = tf.shape(input_tensor)
    num_locations = tf.cast(input_shape[1] * input_shape[2], tf.float32)
    return result / (num_locations)


class StyleContentModel(keras.models.Model):
    def __init__(self, style_layers, content_layers, filters):
        super().__init__()
        self.vgg = vgg_layers(style_layers + content_layers, filters)
        self.style_layers = style_layers
        self.content_layers = content_layers
        self.num_style_layers = len(style_layers)
        self.vgg.trainable = False

    def call(self, inputs):
        "Expects float input in [0,1]"
        inputs = inputs * 255.0
        preprocessed_input = keras.applications.vgg19.preprocess_input(inputs)
        outputs = self.vgg(preprocessed_input)
        style_outputs, content_outputs = (outputs[:self.num_style_layers],
                                          outputs[self.num_style_layers:])

        style_outputs = [gram_matrix(style_output)
                         for style_output in style_outputs]

        content_dict = {content_name: value
                        for content_name, value
                        in zip(self.content_layers, content_outputs)}

        style_dict = {style_name: value
                      for style_name, value
                      in zip(self.style_layers, style_outputs)}

        return {'content': content_dict, 'style': style_dict}


def _images(rng, n):
    """A content image of smooth colour blobs and a style image of coloured stripes, in [0, 1]."""
    yy, xx = np.mgrid[0:n, 0:n] / n
    content = np.zeros((n, n, 3))
    for _ in range(4):
        cy, cx = rng.uniform(0, 1, 2)
        r = rng.uniform(0.1, 0.3)
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
        content += blob[..., None] * rng.uniform(0, 1, 3)
    content = content / content.max()
    fy, fx = rng.uniform(2, 6, 2)
    phase = np.sin(2 * np.pi * (fy * yy + fx * xx))
    style = 0.5 + 0.5 * phase[..., None] * rng.uniform(-1, 1, 3)
    style = np.clip(style + rng.normal(0, 0.05, style.shape), 0, 1)
    return (content[None].astype("float32"), style[None].astype("float32"))


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    content_image, style_image = _images(rng, c["size"])
    content_image, style_image = tf.constant(content_image), tf.constant(style_image)

    extractor = StyleContentModel(style_layers, content_layers, c["filters"])

    style_targets = extractor(style_image)['style']
    content_targets = extractor(content_image)['content']

    def clip_0_1(image):
        return tf.clip_by_value(image, clip_value_min=0.0, clip_value_max=1.0)

    style_weight = 1e-2
    content_weight = 1e4

    def style_content_loss(outputs):
        style_outputs = outputs['style']
        content_outputs = outputs['content']
        style_loss = tf.add_n([tf.reduce_mean((style_outputs[name] - style_targets[name]) ** 2)
                               for name in style_outputs.keys()])
        style_loss *= style_weight / num_style_layers

        content_loss = tf.add_n([tf.reduce_mean((content_outputs[name] - content_targets[name]) ** 2)
                                 for name in content_outputs.keys()])
        content_loss *= content_weight / num_content_layers
        loss = style_loss + content_loss
        return loss

    total_variation_weight = 30

    def train_step(image):  # the tutorial's @tf.function() is `decorate` below
        with Tape() as tape:
            outputs = extractor(image)
            loss = style_content_loss(outputs)
            loss += total_variation_weight * tf.image.total_variation(image)

        grad = tape.gradient(loss, image)
        opt.apply_gradients([(grad, image)])
        image.assign(clip_0_1(image))
        return loss

    train_step = (decorate or identity)(train_step)

    opt = keras.optimizers.Adam(learning_rate=0.02, beta_1=0.99, epsilon=1e-1)
    image = tf.Variable(content_image)

    steps_per_epoch = c["steps_per_epoch"]
    losses = []
    step = 0
    while step < steps:  # the tutorial's `for n in range(epochs)`, until `steps` steps ran
        for m in range(steps_per_epoch):
            step += 1
            loss = train_step(image)
            losses.append(float(loss[0]))
            if on_step is not None:
                on_step(step - 1)
            if step == steps:
                break
    return {"losses": losses, "variables": values([image], opt)}
