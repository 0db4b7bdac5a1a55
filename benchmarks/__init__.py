"""Bundled imperative TF2 programs and the harness comparing eager, tf.function, XLA and Terra."""
