"""A wider young generation for the garbage collector while an iteration is recorded.

Recording allocates a few dozen container objects per op (records, specs, location keys),
and the eager tensors of the step live until its gradient. With CPython's default threshold
(a young collection every 700 net allocations), a traced step ran hundreds of young
collections, and everything alive at two of them (the step's activations, the records) was
promoted to the oldest generation, which the 25%-growth rule then collected in full, over the
whole process (600,000 objects with TF and Keras loaded): on resnet50's traced step 320-560 ms
of garbage collection against 1 ms eager. A young generation of 50,000 allocations lets the
step's temporaries die before any collection sees them (35-80 ms).

The collector stays on (cyclic garbage is still collected, after at most `young` allocations);
the previous thresholds come back when the last recorder stops, unless the program changed
them meanwhile (its setting wins). Graph builds (runtime/builds.py) and co-executed iterations
(runtime/session.py, `coexec_gc_threshold`: their placeholders live until they end) widen it too.
"""
from __future__ import annotations

import contextlib
import gc
import threading

__all__ = ["widen", "restore", "widened", "collect_young"]

_lock = threading.Lock()
_depth = 0
_saved: tuple | None = None  # the thresholds before the outermost widen
_set: tuple | None = None    # the thresholds widen set (None: it left them alone)


def widen(young: int) -> None:
    """Raise the young generation's threshold to at least `young` (0: leave it) until the
    matching `restore`. Nests."""
    global _depth, _saved, _set
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        current = gc.get_threshold()
        _saved, _set = current, None
        if young and current[0] and current[0] < young:  # a threshold of 0 disables collection
            _set = (young,) + current[1:]
            gc.set_threshold(*_set)


def restore() -> None:
    """Undo the matching `widen`; the outermost one puts the previous thresholds back."""
    global _depth, _saved, _set
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            if _set is not None and gc.get_threshold() == _set:
                gc.set_threshold(*_saved)
            _saved = _set = None


def collect_young() -> bool:
    """Collect the young generation now, unless the program turned collection off (disabled,
    or a threshold of 0): what a window defers, bounded (co-executed iterations hold one open
    from one to the next, so a program's cyclic garbage would otherwise wait for `young` net
    allocations, many steps when each leaves a few). Returns whether it collected."""
    if not gc.isenabled() or (_saved or gc.get_threshold())[0] == 0:
        return False
    gc.collect(0)
    return True


@contextlib.contextmanager
def widened(young: int):
    """`widen(young)` for the body (a graph build: lowering and tracing allocate like a
    recorded step)."""
    widen(young)
    try:
        yield
    finally:
        restore()
