"""Moving tensors between pipeline ranks: a mailbox for stage-to-stage values and pack moves.

Stage outputs and input gradients go through a `Mailbox` keyed by ``(what, stage, microbatch)``:
the producer puts the tensor (still on its own device), the consumer's compiled stage call reads it
and TensorFlow copies it to the consumer's device as part of that call (a real copy between GPUs
or cluster workers; a shared buffer between logical CPUs of one process).

A pack eviction or load is one compiled call on the target device that returns an identity of
every base tensor, so the whole pack crosses in one call instead of one per tensor (tensor by
tensor, a remote step took 3.5x longer).
"""
from __future__ import annotations

import threading
import time
from typing import Sequence

import tensorflow as tf


class PipelineAborted(RuntimeError):
    """Raised in ranks still waiting when another rank failed."""


class Mailbox:
    """Thread-safe one-shot slots: ``put(key, value)`` once, ``get(key)`` blocks until it is there.

    ``put(..., delay=s)`` makes the value arrive ``s`` seconds after the put (the producer goes on
    at once): a slow link between ranks, for trying schedules against a network that is not
    there (`PipelineTrainer(link_delay=...)`)."""

    def __init__(self, timeout: float = 120.0):
        self.timeout = timeout
        self._values = {}
        self._ready = {}
        self._cond = threading.Condition()
        self._aborted = None

    def put(self, key, value, delay: float = 0.0):
        with self._cond:
            if key in self._values:
                raise RuntimeError(f"mailbox slot {key} filled twice")
            self._values[key] = value
            if delay > 0:
                self._ready[key] = time.monotonic() + delay
            self._cond.notify_all()

    def get(self, key):
        """Take the value out of slot ``key`` (each slot is read exactly once)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: key in self._values or self._aborted is not None,
                                     self.timeout)
            if self._aborted is not None:
                raise PipelineAborted(f"waiting for {key}: {self._aborted}")
            if not ok:
                raise TimeoutError(f"mailbox slot {key} not filled within {self.timeout} s "
                                   f"(schedule dependency never satisfied?)")
            ready = self._ready.pop(key, None)
            while ready is not None and self._aborted is None and time.monotonic() < ready:
                self._cond.wait(ready - time.monotonic())   # still on the wire
            if self._aborted is not None:
                raise PipelineAborted(f"waiting for {key}: {self._aborted}")
            return self._values.pop(key)

    def abort(self, reason):
        with self._cond:
            self._aborted = reason
            self._cond.notify_all()

    def pending(self):
        with self._cond:
            return sorted(self._values, key=str)


_COPIES = {}
_COPIES_LOCK = threading.Lock()


def _copier(device: str):
    """A compiled identity pinned to ``device`` *inside* the function: with the device only on
    the call site, the placer may keep an Identity next to its input (no move at all; seen on
    cluster workers, where the 'evicted' pack never left the evictor)."""
    with _COPIES_LOCK:
        fn = _COPIES.get(device)
        if fn is None:
            def copy(tensors):
                with tf.device(device):
                    # The token is an output like the copies: fetching it waits for the whole call.
                    return [tf.identity(t) for t in tensors], tf.zeros([], tf.int8)
            fn = _COPIES[device] = tf.function(copy, autograph=False, reduce_retracing=True)
        return fn


def move(tensors: Sequence, device: str, wait: bool = True) -> list:
    """Copy ``tensors`` to ``device`` in one compiled call; returns the copies (same order).

    Remote eager execution is asynchronous: the call returns before the copy has run. With
    ``wait`` the move blocks until it is done (one tiny fetch), so a caller that then drops the
    sources frees them on the source device before anything it enqueues next."""
    tensors = list(tensors)
    if not tensors:
        return []
    with tf.device(device):
        copies, token = _copier(device)(tensors)
    if wait:
        token.numpy()
    return list(copies)
