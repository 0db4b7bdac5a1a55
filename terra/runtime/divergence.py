"""Divergence: why a skipped iteration left its compiled path (the op, the user's line, what
the path expected and what the program did), and the exception that carries it out of the
PythonRunner to the iteration, which switches paths or falls back."""
from __future__ import annotations

import enum
import sys
from dataclasses import dataclass


class DivergenceKind(enum.Enum):
    """What the runtime does about a divergence (its `reason` is text for `explain()` only)."""
    MISMATCH = "mismatch"        # another op or input than the path's: switch paths, or fall back
    PAST_END = "past end"        # an op after the path's last one: the loop may be over
    GRAPH_ERROR = "graph error"  # the path's graph failed: no other path helps; fall back


PAST_END = "op after the end of the path"
GRAPH_ERROR = "graph error"

# ------------------------------------------------------------------------------------ records
@dataclass(frozen=True, slots=True)
class Divergence:
    """Why a skipped iteration left its path: at op `position` the path expected `expected`, the
    program did `observed`, issued from the user's source line `location`."""
    location: str
    expected: str
    observed: str
    position: int
    reason: str
    kind: DivergenceKind = DivergenceKind.MISMATCH

    def __str__(self) -> str:
        return (f"{self.reason} at op #{self.position} ({self.location}): expected {self.expected}, "
                f"observed {self.observed}")


class Diverged(Exception):
    """Raised inside the runner when the program leaves the path; carries the `Divergence`."""

    def __init__(self, divergence: Divergence):
        super().__init__(str(divergence))
        self.divergence = divergence


def user_line(skip_internal: bool = True, frame=None) -> str:
    """`file:line (function)` of the innermost frame outside Terra, TF and Keras."""
    f = frame or sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not any(s in fn for s in ("/terra/", "/tensorflow/", "/keras/", "/site-packages/",
                                     "<frozen", "/lib/python3")):
            return f"{fn}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "<unknown>"


__all__ = ["GRAPH_ERROR", "PAST_END", "Divergence", "DivergenceKind", "Diverged", "user_line"]
