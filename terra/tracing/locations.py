"""Program locations: which call path, and which pass through which Python loop, issued an op.

Two signals, each exact for what it covers:

* **Call sites** come from a frame walk at op time: every frame from the op up to the iteration's
  root frame contributes ``"file:qualname@f_lasti"`` (the bytecode offset of the call in flight).
  That separates two calls of one layer, branches, recursion depth, comprehensions and generators
  (each has its own code object and frame).
* **Loop iterations** need more, because an iteration can skip every op of the previous one. Loops
  are found statically per code object (backward jumps give ``[head, back-jump]`` bytecode
  ranges). While an iteration is recorded, a global trace function (`sys.settrace`, this thread
  only) gives a line tracer to frames whose code contains loops; every other frame costs one dict
  lookup per call. CPython reports a line event on every backward jump, so each pass through a loop
  head is counted exactly, whether or not the pass issued ops. Frames without loops have no line
  tracer at all.

Frames of Terra itself are left out. Frames of TF and Keras are kept (their loops, e.g.
Sequential's loop over layers or an eager `tf.while_loop`, are what tells two layers' ops apart),
and the whole stack is interned: one dict lookup maps a (code, offset, iterations) key to a shared
`Location`.
"""
from __future__ import annotations

import dis
import os
import sys
import warnings

from terra.ir.records import Location, LoopIter

_TERRA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_BACKWARD_JUMPS = {"JUMP_BACKWARD", "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE",
                   "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE"}


class CodeInfo:
    """Static facts about one code object: its frame label, whether it is Terra's own, its loops.

    `loops` are ``(start, end, heads)`` bytecode ranges sorted outermost first; `heads` maps each
    backward-jump target to whether it starts a source line (then a line event there can also be
    plain fall-through, told apart by the previous event's offset).
    """
    __slots__ = ("label", "internal", "loops", "loop_ids")

    def __init__(self, code):
        self.label = f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"
        self.internal = code.co_filename.startswith(_TERRA_DIR)
        self.loops = () if self.internal else find_loops(code)
        self.loop_ids = tuple(f"{self.label}@{start}" for start, _, _ in self.loops)


def find_loops(code) -> tuple:
    """Loop ranges of `code` from its backward jumps; overlapping ranges (``continue`` in a
    ``while`` loop jumps to the condition, the loop end to the body) merge into one loop."""
    line_starts = set()
    jumps = []
    for ins in dis.get_instructions(code):
        if ins.starts_line is not None:
            line_starts.add(ins.offset)
        if ins.opname in _BACKWARD_JUMPS:
            jumps.append((ins.argval, ins.offset))
    loops: list = []
    for start, end in sorted(jumps):
        for loop in loops:
            s, e, heads = loop
            if s <= start <= e and end > e or start == s:  # overlapping, not nested
                loop[1] = max(e, end)
                heads[start] = start in line_starts
                break
        else:
            loops.append([start, end, {start: start in line_starts}])
    loops.sort(key=lambda l: (l[0], -l[1]))
    return tuple((s, e, dict(h)) for s, e, h in loops)


_infos: dict = {}


def code_info(code) -> CodeInfo:
    info = _infos.get(code)
    if info is None:
        info = _infos[code] = CodeInfo(code)
    return info


class FrameLoops:
    """Per-frame loop state: the current pass number of each loop (None while outside it)."""
    __slots__ = ("loops", "iters", "last", "ignored", "tracer")

    def __init__(self, info: CodeInfo, ignore_at: int | None = None):
        self.loops = info.loops
        self.iters = [None] * len(info.loops)
        self.last = -1
        # Loops already running when recording started (the training loop around the root
        # frame) are not part of any location.
        self.ignored = tuple(ignore_at is not None and s <= ignore_at <= e for s, e, _ in info.loops)
        self.tracer = self.trace

    def trace(self, frame, event, arg):
        if event == "line":
            self.line(frame.f_lasti)
        return self.tracer

    def line(self, o: int) -> None:
        last, iters = self.last, self.iters
        for i, (s, e, heads) in enumerate(self.loops):
            if s <= o <= e:
                starts_line = heads.get(o)
                if starts_line is not None and (not starts_line or last >= o):  # backward jump
                    it = iters[i]
                    iters[i] = 1 if it is None else it + 1
                elif iters[i] is None:
                    iters[i] = 0
            else:
                iters[i] = None
        self.last = o

    def at(self, o: int) -> tuple:
        """(loop index, pass) of the loops enclosing offset `o`, outermost first; an op inside a
        loop the tracer has not seen entered yet (a one-line loop) starts its pass 0."""
        iters, out = self.iters, []
        for i, (s, e, _) in enumerate(self.loops):
            if s <= o <= e:
                if iters[i] is None:
                    iters[i] = 0
                if not self.ignored[i]:
                    out.append((i, iters[i]))
            else:
                iters[i] = None
        self.last = o
        return tuple(out)


def _global_trace(frame, event, arg):
    """Called by CPython for every new (or resumed) frame on the recording thread."""
    info = _infos.get(frame.f_code)
    if info is None:
        info = code_info(frame.f_code)
    if not info.loops:
        return None
    return frame.f_trace or FrameLoops(info).tracer


class Locator:
    """Computes `Location`s for ops issued below `root` (a frame) on the current thread.

    `Locator(root, track_loops=True)` starts loop tracking (if another trace function, e.g. a
    debugger or coverage, is installed, loops are not tracked and a warning says so); `close()`
    stops it. `location()` is called from inside Terra at op time.
    """

    def __init__(self, root, track_loops: bool = True):
        if root is None:
            raise ValueError("Locator: root frame is None")
        self._stop = set()
        f = root
        while f is not None:
            self._stop.add(f)
            f = f.f_back
        self._cache: dict = {}
        self.tracking = False
        if track_loops:
            if sys.gettrace() is not None:
                warnings.warn("terra: a trace function (debugger/coverage) is active; loop "
                              "iterations are not part of recorded locations", RuntimeWarning)
            else:
                for f in self._stop:
                    info = code_info(f.f_code)
                    if info.loops and not isinstance(getattr(f.f_trace, "__self__", None), FrameLoops):
                        f.f_trace = FrameLoops(info, ignore_at=f.f_lasti).tracer
                sys.settrace(_global_trace)
                self.tracking = True

    def close(self) -> None:
        if self.tracking:
            sys.settrace(None)
            self.tracking = False
            f = sys._getframe(0)
            while f is not None:
                if isinstance(getattr(f.f_trace, "__self__", None), FrameLoops):
                    f.f_trace = None
                f = f.f_back
        self._stop = set()

    def location(self, frame=None) -> Location:
        """Location of the op issued from `frame` (default: the caller's frame)."""
        f = sys._getframe(1) if frame is None else frame
        stop = self._stop
        key = []
        while f is not None:
            info = _infos.get(f.f_code) or code_info(f.f_code)
            if not info.internal:
                lasti = f.f_lasti
                if info.loops:
                    state = getattr(f.f_trace, "__self__", None)
                    iters = state.at(lasti) if isinstance(state, FrameLoops) else ()
                    key.append((info, lasti, iters))
                else:
                    key.append((info, lasti, ()))
            if f in stop:
                break
            f = f.f_back
        key = tuple(key)
        loc = self._cache.get(key)
        if loc is None:
            loc = self._cache[key] = _build(key)
        return loc


def _build(key) -> Location:
    frames, loops = [], []
    for info, lasti, iters in reversed(key):  # root first
        frames.append(f"{info.label}@{lasti}")
        loops.extend(LoopIter(info.loop_ids[i], it) for i, it in iters)
    return Location(tuple(frames), tuple(loops))
