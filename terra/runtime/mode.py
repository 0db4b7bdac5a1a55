"""The modes of one iteration (`Iteration.mode`), the states of its state machine:
TRACING (eager under a Recorder) -> DONE; SKIP (co-execution along a compiled path) -> TRACING
on a fallback, or DONE; EAGER (the site gave up) -> DONE. A `str` enum, so a mode prints as
its name in events and `stats()`."""
from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    TRACING = "tracing"
    SKIP = "skip"
    EAGER = "eager"
    DONE = "done"

    def __str__(self) -> str:
        return self.value


# modes in which the program's ops belong to a path: recorded (TRACING) or matched (SKIP)
ON_PATH = frozenset({Mode.TRACING, Mode.SKIP})

__all__ = ["Mode", "ON_PATH"]
