"""An error a graph raised, shown at the program line that issued the failing op.

A graph runs behind Python: by the time an op fails in it, the program has passed the op's line
and waits at a sync point (`float(loss)`), and Python cannot raise in a frame that has moved
on. Eager's traceback ends at the op's line, so Terra's error ends there too: under the frames
the exception really passed through (the sync point, Terra's own), it carries one entry per
program frame of the op's recorded location, root first, each a frame of a code object
compiled to raise at that file and line under that function's name (the way template engines
report template lines). `traceback.extract_tb(e.__traceback__)[-1]` is then the op's line, and
the printed traceback shows its source text.
"""
from __future__ import annotations

import linecache
import sys
import types

from terra.ir.records import FRAME_SOURCES

__all__ = ["at_recorded_line"]


class _Marker(BaseException):
    pass


_codes: dict = {}  # (file, line, name) -> code object that raises `_Marker` at that line


def _entry(file: str, line: int, name: str, tb_next):
    """A traceback entry for `file:line` in a function called `name`, followed by `tb_next`."""
    key = (file, line, name)
    code = _codes.get(key)
    if code is None:
        # the raise spans the source line's text, so no caret marks a part of it
        text = linecache.getline(file, line).rstrip()
        indent = len(text) - len(text.lstrip())
        fill = " " * max(0, len(text) - indent - len("raise (__terra_marker__)"))
        head = "\n" * (line - 1) if not indent or line < 2 else "\n" * (line - 2) + "if 1:\n"
        code = compile(head + " " * indent + f"raise (__terra_marker__{fill})", file, "exec")
        code = _codes[key] = code.replace(co_name=name, co_qualname=name) \
            if sys.version_info >= (3, 11) else code.replace(co_name=name)
    try:
        exec(code, {"__name__": "terra_user_line", "__terra_marker__": _Marker})
    except _Marker:
        tb = sys.exc_info()[2].tb_next  # the entry of the exec'd code's frame
    return types.TracebackType(tb_next, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)


def at_recorded_line(error, location):
    """`error` with its traceback ending in entries for the program frames of `location` (a
    record's Location); as it is where no frame of the location is known."""
    frames = [FRAME_SOURCES.get(label) for label in location.frames]
    own = [f for f in frames if f is not None and not f[3] and f[1]]
    if not own:
        return error
    tb = None
    try:
        for file, line, name, _ in reversed(own):
            tb = _entry(file, line, name, tb)
    except (SyntaxError, ValueError, TypeError):  # a source Python cannot stand in for
        return error
    return error.with_traceback(tb)
