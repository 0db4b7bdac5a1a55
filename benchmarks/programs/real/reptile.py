"""Few-Shot learning with Reptile (keras-io), inner SGD loops and NumPy weight interpolation.

Source: https://keras.io/examples/vision/reptile/ (keras-team/keras-io,
examples/vision/reptile.py), Apache-2.0.
Adapted: Omniglot (tensorflow_datasets, 28x28) is replaced by a fixed NumPy pool of synthetic
"characters" (a random stroke prototype per class, each example a noisy, shifted copy), 14x14x1;
the conv_bn stack keeps its four stride-2 blocks with 32 filters instead of 64 ("tiny": 8); the
task sizes are smaller (classes, shots, inner batch, inner iterations) and evaluation runs every
`eval_interval` meta-iterations instead of every one. The loop is the example's: `Dataset`
with `random.choices` and a shuffled, batched, repeated `tf.data` mini dataset per task,
`old_vars = model.get_weights()`, the inner loop `with tf.GradientTape() as tape: preds =
model(images); loss = keras.losses.sparse_categorical_crossentropy(labels, preds)` and
`optimizer.apply_gradients`, the interpolation of `new_vars` towards `old_vars` with
`cur_meta_step_size`, `model.set_weights`, and the evaluation (fine-tune on a split task,
`model.predict`, restore the weights). The example's repeated inner-step block is factored into
`train_step`, which `decorate` wraps. One training step = one inner gradient step of the
meta-training loop (evaluation fine-tuning steps are not counted); the loss recorded is the
mean of the per-example loss vector; the meta-iteration that reaches `steps` stops its inner
loop there and still does its meta update.
"""
import random

import keras
import numpy as np
import tensorflow as tf
from keras import layers

from ._util import identity, seed_all, values

SOURCE = "https://keras.io/examples/vision/reptile/"
LICENSE = "Apache-2.0"
TRAIT = ("meta-learning: a new tf.data mini dataset per task, inner SGD steps, get_weights/"
         "set_weights interpolation in NumPy, evaluation fine-tuning and model.predict between")
SIZES = {
    "bench": dict(n_classes=40, per_class=20, size=14, filters=32, classes=5, train_shots=10,
                  shots=3, inner_batch_size=10, eval_batch_size=10, inner_iters=2,
                  eval_iters=2, eval_interval=4, meta_iters=2000),
    "tiny": dict(n_classes=10, per_class=6, size=14, filters=8, classes=3, train_shots=4,
                 shots=2, inner_batch_size=4, eval_batch_size=4, inner_iters=2,
                 eval_iters=1, eval_interval=2, meta_iters=2000),
}


class Dataset:
    # This class will facilitate the creation of a few-shot dataset
    # from the (synthetic) character pool that can be sampled from quickly while also
    # allowing to create new labels at the same time.
    def __init__(self, rng, n_classes, per_class, size):
        # Instead of downloading Omniglot: a prototype per class (a few random strokes),
        # its examples shifted by up to one pixel with a little noise.
        self.size = size
        self.data = {}
        for label in range(n_classes):
            proto = np.zeros((size + 2, size + 2), np.float32)
            for _ in range(3):
                r, c0 = rng.integers(1, size + 1, 2)
                length = rng.integers(3, size // 2)
                if rng.random() < 0.5:
                    proto[r, c0:c0 + length] = 1.0
                else:
                    proto[c0:c0 + length, r] = 1.0
            images = []
            for _ in range(per_class):
                dy, dx = rng.integers(0, 3, 2)
                image = proto[dy:dy + size, dx:dx + size] + rng.normal(0, 0.1, (size, size))
                images.append(np.clip(image, 0, 1)[:, :, None].astype(np.float32))
            self.data[str(label)] = images
        self.labels = list(self.data.keys())

    def get_mini_dataset(
        self, batch_size, repetitions, shots, num_classes, split=False
    ):
        size = self.size
        temp_labels = np.zeros(shape=(num_classes * shots))
        temp_images = np.zeros(shape=(num_classes * shots, size, size, 1))
        if split:
            test_labels = np.zeros(shape=(num_classes))
            test_images = np.zeros(shape=(num_classes, size, size, 1))

        # Get a random subset of labels from the entire label set.
        label_subset = random.choices(self.labels, k=num_classes)
        for class_idx, class_obj in enumerate(label_subset):
            # Use enumerated index value as a temporary label for mini-batch in
            # few shot learning.
            temp_labels[class_idx * shots : (class_idx + 1) * shots] = class_idx
            # If creating a split dataset for testing, select an extra sample from each
            # label to create the test dataset.
            if split:
                test_labels[class_idx] = class_idx
                images_to_split = random.choices(
                    self.data[label_subset[class_idx]], k=shots + 1
                )
                test_images[class_idx] = images_to_split[-1]
                temp_images[
                    class_idx * shots : (class_idx + 1) * shots
                ] = images_to_split[:-1]
            else:
                # For each index in the randomly selected label_subset, sample the
                # necessary number of images.
                temp_images[
                    class_idx * shots : (class_idx + 1) * shots
                ] = random.choices(self.data[label_subset[class_idx]], k=shots)

        dataset = tf.data.Dataset.from_tensor_slices(
            (temp_images.astype(np.float32), temp_labels.astype(np.int32))
        )
        dataset = dataset.shuffle(100).batch(batch_size).repeat(repetitions)
        if split:
            return dataset, test_images, test_labels
        return dataset


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)

    learning_rate = 0.003
    meta_step_size = 0.25

    inner_batch_size = c["inner_batch_size"]
    eval_batch_size = c["eval_batch_size"]

    meta_iters = c["meta_iters"]
    eval_iters = c["eval_iters"]
    inner_iters = c["inner_iters"]

    eval_interval = c["eval_interval"]
    train_shots = c["train_shots"]
    shots = c["shots"]
    classes = c["classes"]

    train_dataset = Dataset(rng, c["n_classes"], c["per_class"], c["size"])
    test_dataset = Dataset(rng, c["n_classes"] // 2, c["per_class"], c["size"])

    def conv_bn(x):
        x = layers.Conv2D(filters=c["filters"], kernel_size=3, strides=2, padding="same")(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x)

    inputs = layers.Input(shape=(c["size"], c["size"], 1))
    x = conv_bn(inputs)
    x = conv_bn(x)
    x = conv_bn(x)
    x = conv_bn(x)
    x = layers.Flatten()(x)
    outputs = layers.Dense(classes, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile()
    optimizer = keras.optimizers.SGD(learning_rate=learning_rate)

    def train_step(images, labels):
        with Tape() as tape:
            preds = model(images)
            loss = keras.losses.sparse_categorical_crossentropy(labels, preds)
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        return loss

    train_step = (decorate or identity)(train_step)
    losses, i = [], 0
    training = []
    testing = []
    for meta_iter in range(meta_iters):
        if i == steps:
            break
        frac_done = meta_iter / meta_iters
        cur_meta_step_size = (1 - frac_done) * meta_step_size
        # Temporarily save the weights from the model.
        old_vars = model.get_weights()
        # Get a sample from the full dataset.
        mini_dataset = train_dataset.get_mini_dataset(
            inner_batch_size, inner_iters, train_shots, classes
        )
        for images, labels in mini_dataset:
            loss = train_step(images, labels)
            losses.append(float(tf.reduce_mean(loss)))
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break
        new_vars = model.get_weights()
        # Perform SGD for the meta step.
        for var in range(len(new_vars)):
            new_vars[var] = old_vars[var] + (
                (new_vars[var] - old_vars[var]) * cur_meta_step_size
            )
        # After the meta-learning step, reload the newly-trained weights into the model.
        model.set_weights(new_vars)
        # Evaluation loop
        if meta_iter % eval_interval == 0:
            accuracies = []
            for dataset in (train_dataset, test_dataset):
                # Sample a mini dataset from the full dataset.
                train_set, test_images, test_labels = dataset.get_mini_dataset(
                    eval_batch_size, eval_iters, shots, classes, split=True
                )
                old_vars = model.get_weights()
                # Train on the samples and get the resulting accuracies.
                for images, labels in train_set:
                    train_step(images, labels)
                test_preds = model.predict(test_images, verbose=0)
                test_preds = tf.argmax(test_preds).numpy()
                num_correct = (test_preds == test_labels).sum()
                # Reset the weights after getting the evaluation accuracies.
                model.set_weights(old_vars)
                accuracies.append(num_correct / classes)
            training.append(accuracies[0])
            testing.append(accuracies[1])
    return {"losses": losses + [float(a) for a in training + testing],
            "variables": values(model, optimizer)}
