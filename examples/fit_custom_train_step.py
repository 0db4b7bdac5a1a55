"""Keras `fit(..., run_eagerly=True)` with a custom `train_step`, eager vs Terra, unchanged.

The `train_step`s below do what `tf.function` gets wrong, which is why their author runs Keras
eagerly: they keep Python state on `self` (a step counter and a list of losses read with
`.numpy()` every tenth step), and the second one also takes a Python-random branch (label
smoothing on a quarter of the batches). `terra.enable()` turns the `tf.GradientTape` Keras'
trainer opens into a Terra tape; nothing else changes. Both runs give eager's weights bit for
bit. The random branch is where Terra gains least today: a branch the graph did not predict
restarts the step on the other branch's graph (see docs/usage.md, "Keras fit").

    python examples/fit_custom_train_step.py          # or: python -m terra <your script>
"""
import os
import random
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402


class Classifier(keras.Model):
    branch_probability = 0.0

    def __init__(self):
        super().__init__()
        self.body = [keras.layers.Dense(256, activation="relu") for _ in range(4)]
        self.head = keras.layers.Dense(10)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.rng = random.Random(0)
        self.steps_seen = 0
        self.losses_seen = []

    def call(self, x, training=False):
        for layer in self.body:
            x = layer(x)
        return self.head(x)

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        self.steps_seen += 1
        smoothing = 0.1 if self.rng.random() < self.branch_probability else 0.0
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            labels = tf.one_hot(y, 10)
            if smoothing:
                labels = labels * (1 - smoothing) + smoothing / 10
            loss = keras.losses.categorical_crossentropy(labels, logits, from_logits=True)
            loss = tf.reduce_mean(loss)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        if self.steps_seen % 10 == 0:                      # Python reads a value mid-training
            self.losses_seen.append(float(self.loss_tracker.result().numpy()))
        return {"loss": self.loss_tracker.result()}


class RandomBranchClassifier(Classifier):
    branch_probability = 0.25                          # a Python-random branch


class EpochTimes(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.times = []

    def on_epoch_begin(self, epoch, logs=None):
        self.t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.times.append(time.perf_counter() - self.t)


def fit(cls, epochs=int(os.environ.get("EPOCHS", "6"))):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(2048,)).astype(np.int32)
    model = cls()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), run_eagerly=True)
    t = time.perf_counter()
    timer = EpochTimes()
    history = model.fit(x, y, batch_size=64, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[timer])
    return model, history.history["loss"], time.perf_counter() - t, timer.times


def compare(cls):
    terra.reset()
    eager_model, eager_losses, eager_s, eager_epochs = fit(cls)
    with terra.enable():                 # every tf.GradientTape is a Terra tape in this block
        terra_model, terra_losses, terra_s, terra_epochs = fit(cls)
    same = all(np.array_equal(a.numpy(), b.numpy())
               for a, b in zip(eager_model.weights, terra_model.weights))
    print(f"== {cls.__name__}")
    print(f"epoch losses  eager {np.round(eager_losses, 5).tolist()}")
    print(f"              terra {np.round(terra_losses, 5).tolist()}")
    print(f"Python state  {terra_model.steps_seen} steps, {len(terra_model.losses_seen)} reads, "
          f"equal to eager's: {eager_model.losses_seen == terra_model.losses_seen}")
    print(f"weights bit-identical to eager: {same}")
    print(f"fit time      eager {eager_s:.2f} s, terra {terra_s:.2f} s "
          f"(x{eager_s / terra_s:.2f} of eager, the first epoch's tracing included)")
    e, t = np.median(eager_epochs[1:]), np.median(terra_epochs[1:])
    print(f"per epoch     after the first: eager {e:.3f} s, terra {t:.3f} s (x{e / t:.2f})")
    print(terra.summary())
    if not same or eager_losses != terra_losses or \
            eager_model.losses_seen != terra_model.losses_seen:
        raise SystemExit("terra: results differ from eager")


def main():
    compare(Classifier)
    compare(RandomBranchClassifier)


if __name__ == "__main__":
    main()
