"""StaticValues: shape reads a path fixes are answered from the trace, everything else is not."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.ir.records import OutputRef  # noqa: E402
from terra.runtime.static_values import StaticValues  # noqa: E402
from terra.tracing import Recorder  # noqa: E402


def _record(fn, *args):
    rec = Recorder("static")
    rec.start(sys._getframe(0))
    try:
        out = fn(*args)
    finally:
        rec.stop()
    return rec, out


def _program(x):
    s = tf.shape(x)
    n = s[1]
    half = n // 2 + tf.constant(1)
    rng = tf.range(half)
    total = tf.reduce_prod(s)
    is_big = tf.greater(total, 100)
    y = tf.reduce_sum(x * 2.0)             # a float value: never static
    k = tf.cast(tf.reduce_max(x), tf.int32)  # an int that depends on data: not static
    return {"s": s, "n": n, "half": half, "rng": rng, "total": total, "is_big": is_big,
            "y": y, "k": k}


def test_shapes_and_integer_arithmetic_are_static_data_is_not():
    x = tf.constant(np.arange(24, dtype=np.float32).reshape(2, 12))
    rec, out = _record(_program, x)
    sv = StaticValues(rec.trace)
    for name in ("s", "n", "half", "rng", "total", "is_big"):
        ref = rec.ref_of(out[name])
        assert isinstance(ref, OutputRef), name
        v = sv.get(ref)
        assert v is not None, name
        assert v.dtype == out[name].dtype, name
        np.testing.assert_array_equal(v.numpy(), out[name].numpy(), err_msg=name)
    for name in ("y", "k"):
        assert sv.get(rec.ref_of(out[name])) is None, name
    # cached: the same tensor object on the second read
    ref = rec.ref_of(out["half"])
    assert sv.get(ref) is sv.get(ref)


def test_the_shape_of_a_data_dependent_value_is_static_only_once_checked():
    """A `tf.where`'s length is the traced iteration's only: its shape (and arithmetic on it)
    is not static, unless the caller has checked that shape against the traced one."""
    def program(y):
        idx = tf.where(y > 0.0)[:, 0]
        s = tf.shape(idx)
        return {"idx": idx, "n": s[0] + 1, "y_len": tf.shape(y)[0]}
    rec, out = _record(program, tf.constant([1.0, -1.0, 2.0]))
    sv = StaticValues(rec.trace)
    idx, n = rec.ref_of(out["idx"]), rec.ref_of(out["n"])
    assert sv.get(n) is None
    assert int(sv.get(n, frozenset({idx}))) == 3
    assert sv.get(n) is None  # (the cache keeps what the value assumed)
    assert int(sv.get(rec.ref_of(out["y_len"]))) == 3  # a shape no data sets

