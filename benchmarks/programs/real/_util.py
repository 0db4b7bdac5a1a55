"""Small helpers the real programs share (seeding, the identity decorator, variable export)."""
import keras
import numpy as np
import tensorflow as tf


def seed_all(seed):
    """Same data, initial weights and TF random draws for every mode."""
    keras.utils.set_random_seed(seed)  # Python, NumPy and TF's global seed
    tf.random.set_seed(seed)
    return np.random.default_rng(seed)


def identity(f):
    return f


def values(*objs):
    """Every variable of `objs` (models, optimizers, metrics or lists of variables) as arrays."""
    out = []
    for o in objs:
        vs = o.variables if hasattr(o, "variables") else o
        out += [np.array(v.numpy()) for v in vs]
    return out
