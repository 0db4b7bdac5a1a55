"""`terra.GradientTape` (installed as `tf.TerraGradientTape`): a drop-in `tf.GradientTape`.

Entering the tape marks an iteration boundary for the session (terra/runtime/session.py);
`gradient` is matched as one coarse unit in co-execution; everything Terra does not compile
(`jacobian`, `batch_jacobian`) makes the iteration fall back and runs eagerly.
"""
from __future__ import annotations

import sys

import tensorflow as tf

from terra.runtime.mode import Mode
from terra.runtime.placeholders import Placeholder
from terra.runtime import units
from terra.runtime.session import SESSION
from terra.runtime.units import real_values
from terra.tracing import hook


# Inside a tf.function this tape is a plain tape, and AutoGraph must call Terra's code as it is
# (`__enter__`/`__exit__` are called by the interpreter, never converted, and must see the
# caller's frame):
# converting it gains nothing, and AutoGraph's cache of converted functions once handed one
# converted method another's code (`tf__guard_ref() takes 3 positional arguments but 6 were
# given`, depending on which functions earlier tests had converted).
_not_converted = tf.autograph.experimental.do_not_convert


class GradientTape(tf.GradientTape):
    """Same constructor and methods as `tf.GradientTape`."""

    def __init__(self, persistent=False, watch_accessed_variables=True):
        super().__init__(persistent=persistent,
                         watch_accessed_variables=watch_accessed_variables)
        self._terra_watched = []   # what `watch` was given this iteration (part of the unit guard)
        self._terra_pending = []   # placeholders watched while skipping (watched after a fallback)

    def __enter__(self):
        if hook.keras_patch_pending():
            hook.patch_keras_trainer()
        self._terra_watched = []
        self._terra_pending = []
        SESSION.tape_enter(self, sys._getframe(1))
        return super().__enter__()

    def __exit__(self, typ, value, traceback):
        result = super().__exit__(typ, value, traceback)
        SESSION.tape_exit(self, typ)
        return result

    @_not_converted
    def watch(self, tensor):
        it = SESSION.iteration
        skipping = it is not None and it.mode == Mode.SKIP and self in it.tapes
        for t in tf.nest.flatten(tensor):
            self._terra_watched.append(t)
            if skipping and isinstance(t, Placeholder):
                self._terra_pending.append(t)
            else:
                super().watch(t)

    def _terra_rewatch(self, current):
        """After a fallback, before the replay: the placeholders watched while skipping, as
        (values to watch now, keys `current(ph)` of this iteration's placeholders, which the
        replay watches as soon as it produces them). The replay watches while the tape records
        (a tape that is not on the stack ignores `watch`)."""
        pending, self._terra_pending = self._terra_pending, []
        now, later = [], []
        for t in pending:
            key = current(t)
            if key is not None:
                later.append(key)
            else:
                now.append(t._terra_materialize())
        return now, later

    @_not_converted
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        return units.gradient(SESSION, self, target, sources, output_gradients, unconnected_gradients)

    @_not_converted
    def jacobian(self, target, sources, *args, **kwargs):
        units.force_eager(SESSION, "tape.jacobian")
        return super().jacobian(real_values(target), real_values(sources), *args, **kwargs)

    @_not_converted
    def batch_jacobian(self, target, source, *args, **kwargs):
        units.force_eager(SESSION, "tape.batch_jacobian")
        return super().batch_jacobian(real_values(target), real_values(source), *args, **kwargs)


TerraGradientTape = GradientTape
