"""The XLA section of terra/_tf_private.py still reports what TF's executor ran.

If this fails after a TF upgrade, Terra's tests can no longer tell compiled clusters from ops the
executor ran itself; fix the section (profiler event names, XSpace module path), not the test.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

from terra import _tf_private as tfp  # noqa: E402


def _fn(jit):
    @tf.function(autograph=False)
    def f(x):
        with tf.xla.experimental.jit_scope(compile_ops=jit):
            return tf.tanh(tf.matmul(x, x)) * 2.0
    return f


def test_executed_op_types_tells_compiled_clusters_from_executor_ops():
    x = tf.ones((16, 16))
    plain, jit = _fn(False), _fn(True)
    plain(x), jit(x)  # trace and compile outside the profile
    ran = tfp.executed_op_types(lambda: [plain(x) for _ in range(2)])
    assert ran["_XlaRun"] == 0 and ran["Tanh"] == 2, ran
    assert sum(k for t, k in ran.items() if "MatMul" in t) == 2, ran
    ran = tfp.executed_op_types(lambda: [jit(x) for _ in range(2)])
    assert ran["_XlaRun"] == 2 and ran["_XlaCompile"] == 2, ran
    assert ran["Tanh"] == 0 and not any("MatMul" in t for t in ran), ran
    expected = tf.tanh(tf.matmul(x, x)) * 2.0
    assert float(tf.reduce_max(tf.abs(jit(x) - expected))) < 1e-5
