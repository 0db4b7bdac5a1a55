"""Custom training: walkthrough (TF tutorial), penguin classification with loss/grad helpers.

Source: https://www.tensorflow.org/tutorials/customization/custom_training_walkthrough
(tensorflow/docs, site/en/tutorials/customization/custom_training_walkthrough.ipynb), Apache-2.0.
Adapted: synthetic penguins (4 standardized features drawn around 3 class means with NumPy, from
the seed) instead of the palmer_penguins TFDS split; the tutorial's model (4-10-10-3 ReLU MLP),
loss, SGD(0.01) and batch 32 are kept as they are (the program is small: it is the tutorial's
size). Kept: `loss(model, x, y, training)`, `grad(model, inputs, targets)` with the tape,
`optimizer.apply_gradients` in the loop, a new `epoch_loss_avg = Mean()` and
`epoch_accuracy = SparseCategoricalAccuracy()` every epoch, `for x, y in ds_train_batch:` with the
accuracy updated from a second `model(x, training=True)` call. The tutorial has no
`tf.function`; `decorate` is applied to `grad`, the function that holds the tape.
"""
import keras
import numpy as np
import tensorflow as tf

from ._util import identity, seed_all, values

SOURCE = "https://www.tensorflow.org/tutorials/customization/custom_training_walkthrough"
LICENSE = "Apache-2.0"
TRAIT = "tiny MLP, loss/grad helper functions, metrics created anew every epoch"
SIZES = {"bench": dict(n=256, batch=32, hidden=10), "tiny": dict(n=48, batch=8, hidden=10)}


def _penguins(rng, n):
    """Four standardized features around three class centres, labels 0..2."""
    centres = rng.normal(0.0, 1.0, (3, 4))
    labels = rng.integers(0, 3, n)
    features = centres[labels] + rng.normal(0.0, 0.6, (n, 4))
    features = (features - features.mean(axis=0)) / features.std(axis=0)
    return features.astype("float32"), labels.astype("int64")


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    train_x, train_y = _penguins(rng, c["n"])
    ds_train_batch = tf.data.Dataset.from_tensor_slices((train_x, train_y))
    ds_train_batch = ds_train_batch.shuffle(c["n"], seed=seed).batch(c["batch"])

    model = keras.Sequential([
        keras.Input(shape=(4,)),  # the tutorial's input_shape=(4,) on the first layer
        keras.layers.Dense(c["hidden"], activation=tf.nn.relu),
        keras.layers.Dense(c["hidden"], activation=tf.nn.relu),
        keras.layers.Dense(3)
    ])

    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss(model, x, y, training):
        # training=training is needed only if there are layers with different
        # behavior during training versus inference (e.g. Dropout).
        y_ = model(x, training=training)

        return loss_object(y_true=y, y_pred=y_)

    def grad(model, inputs, targets):
        with Tape() as tape:
            loss_value = loss(model, inputs, targets, training=True)
        return loss_value, tape.gradient(loss_value, model.trainable_variables)

    grad = (decorate or identity)(grad)
    optimizer = keras.optimizers.SGD(learning_rate=0.01)

    # Keep results for plotting
    train_loss_results = []
    train_accuracy_results = []
    losses, i = [], 0
    while i < steps:  # epochs
        epoch_loss_avg = keras.metrics.Mean()
        epoch_accuracy = keras.metrics.SparseCategoricalAccuracy()

        # Training loop - using batches of 32
        for x, y in ds_train_batch:
            # Optimize the model
            loss_value, grads = grad(model, x, y)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

            # Track progress
            epoch_loss_avg.update_state(loss_value)  # Add current batch loss
            # Compare predicted label to actual label
            # training=True is needed only if there are layers with different
            # behavior during training versus inference (e.g. Dropout).
            epoch_accuracy.update_state(y, model(x, training=True))

            losses.append(float(loss_value))
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break

        # End epoch
        train_loss_results.append(float(epoch_loss_avg.result()))
        train_accuracy_results.append(float(epoch_accuracy.result()))
    return {"losses": losses + train_loss_results + train_accuracy_results,
            "variables": values(model, optimizer, epoch_loss_avg, epoch_accuracy)}
