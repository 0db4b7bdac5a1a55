"""Writing a training loop from scratch (keras-io), the MNIST MLP with a metric.

Source: https://keras.io/guides/writing_a_training_loop_from_scratch/ (TensorFlow version,
keras-team/keras-io, guides/writing_a_training_loop_from_scratch.py), Apache-2.0.
Adapted: synthetic 28x28 "digits" instead of MNIST, 784-64-64-10 as in the guide, batch 64;
the loop is the guide's: `for step, (x, y) in enumerate(train_dataset)`, a train step with
`tf.GradientTape`, `train_acc_metric.update_state`, the metric's result read and reset each epoch.
"""
import keras
import tensorflow as tf

from ._util import identity, seed_all, values

SOURCE = "https://keras.io/guides/writing_a_training_loop_from_scratch/"
LICENSE = "Apache-2.0"
TRAIT = "tf.data loop, Keras metric updated every step and reset every epoch"
SIZES = {"bench": dict(n=1024, batch=64, hidden=64), "tiny": dict(n=96, batch=16, hidden=8)}


def run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench"):
    c = SIZES[size]
    rng = seed_all(seed)
    x_train = rng.uniform(0, 1, (c["n"], 784)).astype("float32")
    y_train = rng.integers(0, 10, c["n"]).astype("int64")

    inputs = keras.Input(shape=(784,), name="digits")
    x1 = keras.layers.Dense(c["hidden"], activation="relu")(inputs)
    x2 = keras.layers.Dense(c["hidden"], activation="relu")(x1)
    outputs = keras.layers.Dense(10, name="predictions")(x2)
    model = keras.Model(inputs=inputs, outputs=outputs)
    optimizer = keras.optimizers.SGD(learning_rate=1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
    train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train))
    train_dataset = train_dataset.shuffle(buffer_size=1024, seed=seed).batch(c["batch"])

    def train_step(x, y):
        with Tape() as tape:
            logits = model(x, training=True)
            loss_value = loss_fn(y, logits)
        grads = tape.gradient(loss_value, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights))
        train_acc_metric.update_state(y, logits)
        return loss_value

    train_step = (decorate or identity)(train_step)
    losses, accs, i = [], [], 0
    while i < steps:  # epochs
        for step, (x_batch_train, y_batch_train) in enumerate(train_dataset):
            loss_value = train_step(x_batch_train, y_batch_train)
            losses.append(float(loss_value))
            if on_step is not None:
                on_step(i)
            i += 1
            if i == steps:
                break
        accs.append(float(train_acc_metric.result()))
        train_acc_metric.reset_state()
    return {"losses": losses + accs, "variables": values(model, optimizer, train_acc_metric)}
