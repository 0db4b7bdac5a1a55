"""Ctrl-C at an iteration boundary: the step Python has left finishes first.

Python reaches a tape's `__enter__` (or `terra.end_iteration()`) only after the previous step's
code has run, so in eager that step is complete when the next one begins. Terra completes it at
this boundary: it waits for the step's graph run (and the one before it). A KeyboardInterrupt
raised inside that wait used to drop a step the program had already taken (weights of no eager
step, `optimizer.iterations` one short). While a boundary is crossed, a first Ctrl-C is held and
raised once the step is complete; a second one raises at once (a stuck run stays interruptible,
and every wait is bounded by `timeout_s` anyway). A program's own SIGINT handler is left alone.
"""
from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["held_interrupts"]


class _Held:
    __slots__ = ("pressed",)

    def __init__(self):
        self.pressed = False


@contextlib.contextmanager
def held_interrupts():
    """Hold a Ctrl-C (SIGINT with Python's default handler, main thread) until the block ends;
    then raise KeyboardInterrupt, unless the block raised."""
    held = _Held()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield held
        return

    def handler(signum, frame):
        if held.pressed:
            raise KeyboardInterrupt
        held.pressed = True

    signal.signal(signal.SIGINT, handler)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held.pressed:
        raise KeyboardInterrupt
