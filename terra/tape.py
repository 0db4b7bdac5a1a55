"""`terra.GradientTape` (installed as `tf.TerraGradientTape`): a drop-in `tf.GradientTape`.

Entering the tape marks an iteration boundary for the session (terra/runtime/session.py);
`gradient` is matched as one coarse unit in co-execution; everything Terra does not compile
(`jacobian`, `batch_jacobian`) makes the iteration fall back and runs eagerly.
"""
from __future__ import annotations

import sys

import tensorflow as tf

from terra.runtime.placeholders import Placeholder
from terra.runtime.session import SESSION


class GradientTape(tf.GradientTape):
    """Same constructor and methods as `tf.GradientTape`."""

    def __init__(self, persistent=False, watch_accessed_variables=True):
        super().__init__(persistent=persistent,
                         watch_accessed_variables=watch_accessed_variables)
        self._terra_watched = []   # what `watch` was given this iteration (part of the unit guard)
        self._terra_pending = []   # placeholders watched while skipping (watched after a fallback)

    def __enter__(self):
        self._terra_watched = []
        self._terra_pending = []
        SESSION.tape_enter(self, sys._getframe(1))
        return super().__enter__()

    def __exit__(self, typ, value, traceback):
        result = super().__exit__(typ, value, traceback)
        SESSION.tape_exit(self, typ)
        return result

    def watch(self, tensor):
        it = SESSION.iteration
        skipping = it is not None and it.mode == "skip" and self in it.tapes
        for t in tf.nest.flatten(tensor):
            self._terra_watched.append(t)
            if skipping and isinstance(t, Placeholder):
                self._terra_pending.append(t)
            else:
                super().watch(t)

    def _terra_rewatch(self):
        """After a fallback: watch the (now real) values of placeholders watched while skipping."""
        pending, self._terra_pending = self._terra_pending, []
        if self._recording:
            for t in pending:
                super().watch(t._terra_materialize())

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        return SESSION.gradient(self, target, sources, output_gradients, unconnected_gradients)

    def jacobian(self, *args, **kwargs):
        SESSION.force_eager("tape.jacobian")
        return super().jacobian(*args, **kwargs)

    def batch_jacobian(self, *args, **kwargs):
        SESSION.force_eager("tape.batch_jacobian")
        return super().batch_jacobian(*args, **kwargs)


TerraGradientTape = GradientTape
