"""Eager's stateful random ops drawn as stateless ones: the same numbers, no kernel per call.

With a global seed set, eager runs each `tf.random.normal` (`uniform`, integer or not,
`truncated_normal`, `tf.nn.dropout`'s mask) as a stateful kernel keyed by its attrs, and each
call draws a new op seed: a kernel built, cached and run per call (0.4 ms, 1-2 ms beside a
running graph). Under Terra it was a host op the program's thread ran at every step. The kernel
is TF's Philox generator with key `seed` and counter `seed2 << 64`, advanced by 256 per output
drawn, and `StatelessRandom*V2` with that key and counter draws exactly its numbers
(`_tf_private.STATEFUL_RANDOM`). So each such call is issued as the stateless op with the
counter eager's kernel would be at: a new kernel's, or the one eager caches for the same attrs
(an explicit op seed, drawn again) after the outputs it has drawn, reserved under a lock as the
kernel reserves them under its mutex. The counter reaches the op as an eager tensor made outside
any recorder's view, and the shape as the constant it is this call: a trace takes the counter
as a feed, and the graph draws the numbers itself, knowing their shape.

The counts are exact only for calls made since eager's kernel cache was last cleared
(`tf.random.set_seed` clears it) with this module installed: until it sees a clear, and for
`seed == seed2 == 0` (a kernel seeded at random), the stateful op runs as it always did.
`tf.raw_ops` holds the unpatched wrappers: a call through it with attrs that recur through
`tf.random` would not be counted.
"""
from __future__ import annotations

import math
import threading

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp

__all__ = ["install", "installed", "uninstall", "draws", "reset"]

_MASK64 = (1 << 64) - 1
_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})

_drawn: dict = {}      # kernel cache key -> outputs its kernel has drawn
_lock = threading.Lock()
_complete = False      # whether every call since eager's last cache clear was counted here
_originals: dict = {}  # (owner, attr) -> original
_calls = {"stateless": 0, "stateful": 0}


def draws() -> dict:
    """How many calls were issued as stateless ops, and how many ran the stateful kernel."""
    return dict(_calls)


def reset() -> None:
    """Eager's kernel cache was cleared: every kernel starts anew, and from now on every call
    is counted here."""
    global _complete
    _drawn.clear()
    _complete = True


def _stop_counting() -> None:
    global _complete
    _complete = False
    _drawn.clear()


def _dims_of(shape) -> list:
    """The dimensions shape argument `shape` asks for (a Python sequence, an array, an eager
    tensor, or a placeholder, whose value it reads)."""
    # (`numpy()`, a read a recorder sees: NumPy would take an eager tensor's buffer unseen,
    # and the path would not learn to fetch it)
    value = shape.numpy() if hasattr(shape, "numpy") else np.asarray(shape)
    return [int(d) for d in np.asarray(value).reshape(-1)]


def _shape_dtype(shape) -> str:
    """The `T` attr eager gives the op: the shape tensor's dtype; a Python sequence converts
    to int32 where its values fit."""
    dtype = getattr(shape, "dtype", None)
    if dtype is not None:
        return getattr(dtype, "name", None) or np.dtype(dtype).name
    try:
        values = np.asarray(shape).reshape(-1)
    except (TypeError, ValueError):
        return "int32"
    return "int32" if all(-2**31 <= int(v) < 2**31 for v in values) else "int64"


def _wrap(name, orig):
    op_type, stateless = tfp.STATEFUL_RANDOM[name]
    if op_type == "RandomUniformInt":
        return _wrap_int(name, orig, stateless)

    def stateful_random(shape, dtype, seed=0, seed2=0, name=None):
        seed, seed2 = seed or 0, seed2 or 0
        dtype_name = getattr(dtype, "name", None) or tf.as_dtype(dtype).name
        if not _counts(seed, seed2) or dtype_name not in _DTYPES:
            # (a kernel of other attrs than any counted here, or none: a graph's op)
            _calls["stateful"] += 1
            return orig(shape, dtype, seed=seed, seed2=seed2, name=name)
        # the shape argument's value (a batch size the graph computes is a read the path learns
        # from its trace, usually an eager twin, as the stateful op's input was): how many it
        # draws, and the stateless op's shape, a constant, so that the graph knows the draw's
        # shape as it knew the stateful op's fed output's (a shape it left open would make each
        # gradient downstream check its inputs' shapes, a sync per step)
        dims = _dims_of(shape)
        n = math.prod(dims)
        key = _key(op_type, seed, seed2, dtype_name, shape)
        return _draw(key, seed, seed2, n, lambda counter: stateless(
            dims, key=[seed & _MASK64], counter=counter, alg=tfp.PHILOX_ALG, dtype=dtype,
            name=name))
    stateful_random.__wrapped__ = orig
    stateful_random.__name__ = name
    stateful_random.__doc__ = orig.__doc__
    return stateful_random


def _wrap_int(name, orig, stateless):
    def stateful_random_int(shape, minval, maxval, seed=0, seed2=0, name=None):
        seed, seed2 = seed or 0, seed2 or 0
        if not _counts(seed, seed2):
            _calls["stateful"] += 1
            return orig(shape, minval, maxval, seed=seed, seed2=seed2, name=name)
        # the bounds as eager takes them: one dtype for both (`Tout`), int32 for Python ints
        lo, hi = tfp.execute_module.args_to_matching_eager(
            [minval, maxval], tfp.context(), [tf.int32, tf.int64])[1]
        dims = _dims_of(shape)
        key = _key("RandomUniformInt", seed, seed2, lo.dtype.name, shape)
        return _draw(key, seed, seed2, math.prod(dims), lambda counter: stateless(
            dims, key=[seed & _MASK64], counter=counter, alg=tfp.PHILOX_ALG, minval=lo,
            maxval=hi, name=name))
    stateful_random_int.__wrapped__ = orig
    stateful_random_int.__name__ = name
    stateful_random_int.__doc__ = orig.__doc__
    return stateful_random_int


def _counts(seed, seed2) -> bool:
    """Whether a call with these seeds is drawn stateless: eagerly, with its kernel's counts
    known here, and seeded (`seed == seed2 == 0` seeds a kernel at random)."""
    return _complete and not (seed == 0 and seed2 == 0) and tfp.executing_eagerly()


def _draw(key, seed, seed2, n, issue):
    """`issue(counter)`: the stateless op, with the counter of the kernel cached for `key` after
    the outputs it has drawn; the `n` it draws now are reserved first, under a lock, as TF's
    kernel reserves them under its mutex (two threads drawing with one op seed never get the
    same numbers)."""
    with _lock:
        before = _drawn.get(key, 0)
        _drawn[key] = before + n
    total = ((seed2 & _MASK64) << 64) + tfp.PHILOX_SKIP_PER_OUTPUT * before
    counter = tfp.eager_tensor_of_array(
        np.array([total & _MASK64, (total >> 64) & _MASK64], np.uint64), tf.uint64)
    try:
        out = issue(counter)
    except Exception:
        _stop_counting()  # (an argument TF refuses: whether eager's kernel got built and
        raise             # drew is TF's business; from here on, its own kernels again)
    _calls["stateless"] += 1
    return out


def _key(op_type, seed, seed2, dtype_name, shape) -> tuple:
    return (op_type, seed, seed2, dtype_name, _shape_dtype(shape), tfp.eager_device_name())


def _wrap_reset(orig):
    def kernel_cache_reset(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        reset()
        return out
    kernel_cache_reset.__wrapped__ = orig
    return kernel_cache_reset


def install() -> None:
    """Patch the stateful random op wrappers and eager's kernel cache resets (for the life of
    the process; idempotent)."""
    if _originals:
        return
    mod = tfp.gen_random_ops_module
    for name in tfp.STATEFUL_RANDOM:
        orig = getattr(mod, name)
        _originals[(mod, name)] = orig
        setattr(mod, name, _wrap(name, orig))
    for attr in tfp.KERNEL_CACHE_RESETS:
        orig = tfp.ContextClass.__dict__[attr]
        _originals[(tfp.ContextClass, attr)] = orig
        setattr(tfp.ContextClass, attr, _wrap_reset(orig))


def installed() -> bool:
    return bool(_originals)


def uninstall() -> None:
    """Put the originals back (tests); the counts are forgotten, and stay incomplete until the
    next clear."""
    global _complete
    while _originals:
        (owner, attr), orig = _originals.popitem()
        setattr(owner, attr, orig)
    _drawn.clear()
    _complete = False
