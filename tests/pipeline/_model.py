"""Shared helpers for executor tests: logical CPUs, a tiny GPT, and the single-device reference."""
import numpy as np
import tensorflow as tf

from terra.pipeline import stage as st

MAX_CPUS = 8


def _split_cpu():
    """Split the CPU into MAX_CPUS logical devices (only possible before TF initializes devices,
    so this runs when the test modules are imported, at collection)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * MAX_CPUS)
    except RuntimeError:
        pass


_split_cpu()


def logical_cpus(n):
    names = [d.name for d in tf.config.list_logical_devices("CPU")]
    assert len(names) >= n, (
        f"need {n} logical CPUs, have {names}: TF initialized its devices before "
        f"tests/pipeline/_model.py could split the CPU (a module collected earlier created a tensor "
        f"at import); call _split_cpu() from the suite's root conftest.py")
    return names[:n]


def batch(b, seq=16, vocab=64, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, vocab, (b, seq)).astype("int32"), rng.integers(0, vocab, (b, seq)).astype("int32"))


def reference(parts, x, y, optimizer):
    """Single-device full-batch loss, gradients and updated weights; restores the weights."""
    variables = [v for part in parts for v in st.trainable_variables(part)]
    init = [v.numpy() for v in variables]
    with tf.GradientTape() as tape:
        h = x
        for part in parts[:-1]:
            h = st.sequential(part)(h)
        loss = st.lm_loss(y, st.sequential(parts[-1])(h))
    grads = tape.gradient(loss, variables)
    optimizer.apply_gradients(zip(grads, variables))
    updated = [v.numpy() for v in variables]
    for v, value in zip(variables, init):
        v.assign(value)
    return float(loss), [g.numpy() for g in grads], updated, variables


def max_err(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))
