"""Run one user program eagerly and under Terra; compare per-step losses and final variables.

A program is `program(Tape) -> (losses, variables)`: it builds its model from fixed seeds, trains
with `Tape` (tf.GradientTape or tf.TerraGradientTape) exactly as a user would write it, and returns
its per-step losses (floats) and final variables (NumPy arrays).

With TERRA_RECORD_COUNTS=<file>, `run_both` appends each test's traces, graph builds and
fallbacks to the file: how the exact counts the tests assert are refreshed after a deliberate
change (run it idle and under load; they must agree).
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402

RTOL = 1e-5


# ------------------------------------------------------------------ shared programs' parts
def mlp(seed=0, out=1, hidden=8, inp=4):
    """A seeded two-layer ReLU MLP: two builds with one seed start from identical weights."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.layers.Input((inp,)),
                             keras.layers.Dense(hidden, activation="relu"),
                             keras.layers.Dense(out)])


def data(steps, batch=8, inp=4, out=1, seed=1):
    """`steps` batches of (inputs, targets), drawn from `seed`."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(steps, batch, inp)).astype(np.float32),
            rng.normal(size=(steps, batch, out)).astype(np.float32))


def weights(*objs):
    """Copies of every variable of the models, optimizers or variable lists given."""
    out = []
    for o in objs:
        vs = o.variables if hasattr(o, "variables") else o
        out += [np.array(v.numpy()) for v in vs]
    return out


# ------------------------------------------------------------------ running and checking
def run_both(program, **config):
    terra.reset()
    old = terra.config(**config) if config else {}
    try:
        eager_losses, eager_vars = program(tf.GradientTape)
        terra_losses, terra_vars = program(tf.TerraGradientTape)
        terra.end_iteration()
        stats = terra.stats()
        explain = terra.explain()
        if os.environ.get("TERRA_RECORD_COUNTS"):
            with open(os.environ["TERRA_RECORD_COUNTS"], "a") as f:
                f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]} "
                        f"{stats['traces']} {stats['graph_builds']} {stats['fallbacks']}\n")
    finally:
        terra.reset()
        if old:
            terra.config(**old)
    assert len(eager_losses) == len(terra_losses), (eager_losses, terra_losses)
    np.testing.assert_allclose(np.asarray(terra_losses, np.float64),
                               np.asarray(eager_losses, np.float64), rtol=RTOL, atol=1e-7,
                               err_msg=explain)
    assert len(eager_vars) == len(terra_vars)
    for a, b in zip(eager_vars, terra_vars):
        np.testing.assert_allclose(b, a, rtol=RTOL, atol=1e-7, err_msg=explain)
    return stats, explain


def assert_coexecuted(stats, explain, min_iterations=1):
    """Terra really ran graphs (not just eagerly): a graph was built and executed."""
    assert stats["graph_builds"] >= 1, explain
    assert stats["graph_exec_s"] > 0, explain
