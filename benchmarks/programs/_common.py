"""What every bundled program shares: the Program interface, seeding, a synthetic data pool.

A program is built as ``build(tape_cls, seed=0, size="bench"|"tiny")``. Everything except the tape
class is fixed by the seed, so two builds with different tapes start from identical variables and
see identical data: the only difference between execution modes is the tape (and, for the
``tf.function`` modes, the harness wrapping ``program.train_step`` the way a user would decorate it).
"""
import keras
import numpy as np
import tensorflow as tf

SIZES = ("bench", "tiny")


def check_args(tape_cls, size):
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if not callable(tape_cls):
        raise TypeError(f"tape_cls must be a tape class such as tf.GradientTape, got {tape_cls!r}")


def seed_everything(seed):
    """Python random, numpy, TF and the Keras global seed: identical initial variables per seed."""
    keras.utils.set_random_seed(seed)


class Program:
    """One imperative training program. Subclasses set ``name`` and ``trait`` and implement
    ``train_step`` (the per-iteration function a user would decorate with ``tf.function``) and
    ``step(i)`` (the Python loop body: fetch batch ``i``, call ``self.train_step``, read the loss)."""

    name = "program"
    trait = ""
    pool_size = 3  # distinct synthetic batches; step i uses batch i % pool_size

    def __init__(self, tape_cls, seed=0, size="bench"):
        check_args(tape_cls, size)
        self.tape_cls = tape_cls
        self.seed = seed
        self.size = size
        self.np_rng = np.random.default_rng(seed)
        seed_everything(seed)

    def batch(self, i):
        return self.batches[i % len(self.batches)]

    def step(self, i):
        loss = self.train_step(*self.batch(i))
        return float(loss)

    def models(self):
        return [self.model]

    def optimizers(self):
        return [self.optimizer]

    def variables(self):
        """Every variable a step can change: model weights, RNG states, optimizer slots."""
        out = []
        for m in self.models():
            out.extend(m.variables)
        for o in self.optimizers():
            out.extend(o.variables)
        return out

    def __repr__(self):
        return f"<{type(self).__name__} size={self.size} seed={self.seed} tape={self.tape_cls.__name__}>"


def const(a, dtype=None):
    return tf.constant(a, dtype=dtype)


def image_batches(rng, batch, hw, classes, n):
    """`n` synthetic (images, labels) batches for the image classifiers, drawn from `rng`."""
    return [(tf.constant(rng.standard_normal((batch, hw, hw, 3)), tf.float32),
             tf.constant(rng.integers(0, classes, batch)))
            for _ in range(n)]
