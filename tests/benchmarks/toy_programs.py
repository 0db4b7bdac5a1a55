"""Tiny programs with known behaviour under tf.function, for the harness tests."""
import keras
import numpy as np
import tensorflow as tf

from benchmarks.programs._common import Program


class Linear(Program):
    """Correct under tf.function: everything that changes per step is a tensor or a variable."""
    name = "toy_linear"

    def __init__(self, tape_cls, seed=0, size="tiny"):
        super().__init__(tape_cls, seed, size)
        self.model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        self.optimizer = keras.optimizers.SGD(0.1)
        r = self.np_rng
        self.batches = [(tf.constant(r.standard_normal((4, 3)), tf.float32),
                         tf.constant(r.standard_normal((4, 1)), tf.float32)) for _ in range(3)]

    def train_step(self, x, y):
        with self.tape_cls() as tape:
            loss = self.loss(x, y)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss

    def loss(self, x, y):
        return tf.reduce_mean(tf.square(self.model(x) - y))


class PythonCounter(Linear):
    """Wrong under tf.function: a Python counter scales the loss; tracing freezes its value."""
    name = "toy_counter"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = 0

    def loss(self, x, y):
        self.calls += 1
        return super().loss(x, y) * float(self.calls)


class Materializes(Linear):
    """Fails under tf.function: reads a tensor's value with .numpy() inside the step."""
    name = "toy_numpy"

    def loss(self, x, y):
        scale = float(np.abs(x.numpy()).mean())
        return super().loss(x, y) * scale
