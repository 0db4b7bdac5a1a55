"""Program locations: which call path, and which pass through which Python loop, issued an op.

Two signals, each exact for what it covers:

* **Call sites** come from a frame walk at op time: every frame from the op up to the iteration's
  root frame contributes ``"file:qualname@f_lasti"`` (the bytecode offset of the call in flight).
  That separates two calls of one layer, branches, recursion depth, comprehensions and generators
  (each has its own code object and frame).
* **Loop iterations** need more, because an iteration can skip every op of the previous one. Loops
  are found statically per code object (backward jumps give ``[head, back-jump]`` bytecode
  ranges). In *user* code (not Terra, not under site-packages or the standard library), passes
  are counted exactly: while an iteration is recorded, a global trace function (`sys.settrace`,
  this thread only) gives a line tracer to user frames whose code contains loops, and CPython
  reports a line event on every backward jump, so each pass through a loop head is counted
  whether or not it issued ops. Every other frame costs one dict lookup per call.
  In *library* frames (TF, Keras, stdlib) line tracing would cost several events per op, so
  passes are counted at op time instead (`LibraryFrameLoops`): a new pass starts when the frame
  issues an op at a smaller bytecode offset than its previous op, or at the same offset through a
  different callee frame. That is exact for library loops whose passes run the same code
  (Sequential's loop over layers, an optimizer's loop over variables); it merges a pass into the
  previous one when the pass issues no op, or only ops later in the body than the previous pass.

Frames of Terra itself are left out; tracing is paused while Terra's own code runs. Frames of TF
and Keras are kept (their loops are what tells two Sequential layers' ops apart), and the whole
stack is interned frame by frame (`_Key`: one frame's (code, offset, iterations) over the key of
its callers), so one program point gives one shared `Location`. A walk stops at the first caller
that has not run since an earlier op (`Locator.location`): consecutive ops of a layer share
everything above the layer's `call`, and deep Keras / TF stacks are walked once per call, not
once per op.
"""
from __future__ import annotations

import atexit
import dis
import os
import sys
import sysconfig
import warnings

from terra.ir.records import FRAME_LINES, FRAME_LOOPS, FRAME_SOURCES, FRAME_TRIES, Location, \
    LoopIter

_TERRA_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_DIRS = tuple(sorted({os.path.realpath(p) + os.sep for key in ("stdlib", "platstdlib",
                                                                       "purelib", "platlib")
                              if (p := sysconfig.get_paths().get(key))} |
                             {os.path.realpath(p) + os.sep for p in sys.path
                              if p.endswith(("site-packages", "dist-packages"))}))
_BACKWARD_JUMPS = {"JUMP_BACKWARD", "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE",
                   "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE"}
_BACKWARD_JUMP_OPCODES = frozenset(dis.opmap[name] for name in _BACKWARD_JUMPS if name in dis.opmap)
_EXTENDED_ARG = dis.opmap["EXTENDED_ARG"]
_CACHE = dis.opmap.get("CACHE", 0)
_BACKWARD_OPCODES = frozenset(dis.opmap[name] for name in
                              _BACKWARD_JUMPS | {"JUMP_BACKWARD_NO_INTERRUPT"} if name in dis.opmap)


class CodeInfo:
    """Static facts about one code object: its frame label, whether it is Terra's own, its loops.

    `loops` are ``(start, end, heads)`` bytecode ranges sorted outermost first; `heads` maps each
    backward-jump target to whether it starts a source line (then a line event there can also be
    plain fall-through, told apart by the previous event's offset).
    """
    __slots__ = ("label", "internal", "library", "loops", "loop_ids", "traced", "code", "file",
                 "name", "none_ignored", "calls")

    def __init__(self, code):
        self.code, self.file = code, os.path.basename(code.co_filename)
        self.name = getattr(code, "co_qualname", code.co_name)
        self.label = f"{self.file}:{self.name}"
        self.internal = code.co_filename.startswith(_TERRA_DIR)
        self.library = _is_library(code.co_filename)
        self.loops = () if self.internal else find_loops(code)
        self.loop_ids = tuple(f"{self.label}@{start}" for start, _, _ in self.loops)
        self.traced = bool(self.loops) and not self.library  # user code with loops: line events
        self.none_ignored = (False,) * len(self.loops)
        self.calls = None  # PRECALL offset -> its CALL's (`call_at`), made on first use

    def call_at(self, lasti: int) -> int:
        """The offset that names the call in flight at `lasti`: CPython 3.11 runs a call of a
        C function (`sum`, `map`, `sorted`) in its PRECALL once specialized (after a few runs
        of the code), else in the CALL after it, and `f_lasti` says which. One call, one
        offset: else the ops a `sum(...)` of tensors issues moved to another location once the
        step had run 7 times, and traces of one site recorded before and after stopped
        sharing them."""
        calls = self.calls
        if calls is None:
            calls = self.calls = _precalls(self.code)
        return calls.get(lasti, lasti) if calls else lasti


_PRECALL = dis.opmap.get("PRECALL")  # (CPython 3.11; 3.12 has none)


_CALL = dis.opmap.get("CALL")


def _precalls(code) -> dict:
    """PRECALL offset -> offset of the CALL that follows it, in `code`. Read from the raw
    bytecode (2 bytes an instruction; inline caches are CACHE units between instructions, as
    `dis` skips them): disassembling every code object a first trace meets took a few percent
    of it."""
    raw = code.co_code
    if _PRECALL is None or _PRECALL not in raw[::2]:
        return {}
    out, pending = {}, None
    for i in range(0, len(raw), 2):
        op = raw[i]
        if op == _CACHE:
            continue
        if pending is not None and op == _CALL:
            out[pending] = i
        pending = i if op == _PRECALL else None
    return out


def _line(code, lasti) -> int | None:
    """Source line of the instruction at bytecode offset `lasti`."""
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line
    return None


_library_files: dict = {}


def _is_library(filename: str) -> bool:
    known = _library_files.get(filename)
    if known is None:
        known = _library_files[filename] = os.path.realpath(filename).startswith(_LIBRARY_DIRS)
    return known


def find_loops(code) -> tuple:
    """Loop ranges of `code` from its backward jumps; overlapping ranges (``continue`` in a
    ``while`` loop jumps to the condition, the loop end to the body) merge into one loop.
    Code without a backward-jump opcode (opcodes sit at even offsets of the bytecode) has none,
    found without disassembling it (most of the code a traced step runs through)."""
    raw = code.co_code
    if not _BACKWARD_OPCODES.intersection(raw[::2]):
        return ()
    line_starts = {offset for offset, _ in dis.findlinestarts(code)}
    jumps = []
    extended = 0
    for i in range(0, len(raw), 2):  # as `dis` reads it, without building its Instructions
        op = raw[i]
        if op == _CACHE:
            continue
        if op >= dis.HAVE_ARGUMENT:
            arg = raw[i + 1] | extended
            extended = arg << 8 if op == _EXTENDED_ARG else 0
        else:
            arg, extended = 0, 0
        if op in _BACKWARD_JUMP_OPCODES:
            jumps.append((i + 2 - 2 * arg, i))
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


def _handlers(code) -> tuple:
    """(exception table entries, {handler offset: (kind, first offset it protects)}); kind is
    "except" (a clause that may catch), "with" (a context manager's exit), "finally" or
    "cleanup" (both re-raise)."""
    bc = dis.Bytecode(code)
    instrs = list(bc)
    at = {ins.offset: k for k, ins in enumerate(instrs)}
    entries = bc.exception_entries
    handlers = {}
    for e in entries:
        kind, start = handlers.get(e.target, (None, e.start))
        if kind is None:
            k = at[e.target]
            kind = "cleanup"
            if instrs[k].opname == "PUSH_EXC_INFO":
                nxt = instrs[k + 1].opname if k + 1 < len(instrs) else ""
                kind = "with" if nxt == "WITH_EXCEPT_START" else "finally"
                if nxt == "POP_TOP":  # a bare `except:`
                    kind = "except"
                for ins in instrs[k + 1:]:
                    if ins.opname == "CHECK_EXC_MATCH":
                        kind = "except"
                    if ins.opname in ("RERAISE", "CHECK_EXC_MATCH"):
                        break
        handlers[e.target] = (kind, min(start, e.start))
    return entries, handlers


_handler_tables: dict = {}


def except_regions(code, lasti: int) -> tuple:
    """Starts of the `try`/`except` blocks enclosing bytecode offset `lasti`, innermost first.
    The exception table names only the innermost handler of an offset; a `with`, `finally` or
    cleanup handler passes an exception on from its own code, so the chain is followed from
    there."""
    table = _handler_tables.get(code)
    if table is None:
        table = _handler_tables[code] = _handlers(code)
    entries, handlers = table
    out, offset = [], lasti
    for _ in range(64):
        entry = next((e for e in entries if e.start <= offset < e.end), None)
        if entry is None:
            break
        kind, start = handlers[entry.target]
        if kind == "except":
            out.append(start)
        offset = entry.target
    return tuple(out)


def caller_step_try(frame) -> bool:
    """Whether a program frame that (transitively) called `frame` runs it inside a `try` with
    an `except` entered anew on each pass of its innermost loop: the frame whose loop drives
    the steps (`for batch in data: try: step(batch) except ...`). The first caller with a loop
    around its call decides; a `try` around that loop does not count."""
    f = frame.f_back
    while f is not None:
        info = code_info(f.f_code)
        if not info.internal and not info.library:
            lasti = f.f_lasti
            loop = max((start for start, end, _ in info.loops if start <= lasti <= end),
                       default=None)
            if loop is not None:
                return any(s > loop for s in except_regions(f.f_code, lasti))
        f = f.f_back
    return False


# id(code) -> CodeInfo, which holds the code (so the id stays its own). Not keyed by the code:
# a code object hashes its contents (constants, nested code objects) on every lookup, and a
# location looks up every frame it walks.
_infos: dict = {}


def code_info(code) -> CodeInfo:
    info = _infos.get(id(code))
    if info is None or info.code is not code:
        info = _infos[id(code)] = CodeInfo(code)
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
        self.ignored = info.none_ignored if ignore_at is None else \
            tuple(s <= ignore_at <= e for s, e, _ in info.loops)
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


class LibraryFrameLoops:
    """Loop state of a library frame (TF, Keras, stdlib), updated at op time only: a pass ends
    when the frame issues an op at a smaller offset than its last op, or at the same offset
    through a different callee frame (the call ran again). Exact when each pass starts at or
    before the previous pass's last op offset (passes running the same code); an op-less pass,
    or one issuing only ops later in the body, is merged into the previous pass."""
    __slots__ = ("loops", "iters", "last", "last_child", "ignored")

    def __init__(self, info: CodeInfo, ignore_at: int | None = None):
        self.loops = info.loops
        self.iters = [None] * len(info.loops)
        self.last = None
        self.last_child = None
        self.ignored = info.none_ignored if ignore_at is None else \
            tuple(s <= ignore_at <= e for s, e, _ in info.loops)

    def at(self, o: int, child) -> tuple:
        iters, loops, last = self.iters, self.loops, self.last
        for i, (s, e, _) in enumerate(loops):
            if s <= o <= e:
                if iters[i] is None:
                    iters[i] = 0
            else:
                iters[i] = None
        if last is not None and (o < last or (o == last and child is not self.last_child)):
            inner = None
            for i, (s, e, _) in enumerate(loops):
                if s <= o <= e and s <= last <= e:
                    inner = i  # loops are sorted outermost first: the last hit is innermost
            if inner is not None:
                iters[inner] += 1
                s0, e0, _ = loops[inner]
                for j in range(inner + 1, len(loops)):  # loops nested inside restart
                    s, e, _ = loops[j]
                    if s0 <= s and e <= e0 and s <= o <= e:
                        iters[j] = 0
        self.last, self.last_child = o, child
        out = ()
        for i, (s, e, _) in enumerate(loops):
            if s <= o <= e and not self.ignored[i]:
                out += ((i, iters[i]),)
        return out


# id(code) -> (code, its CodeInfo for user code with loops, None for every other code)
_traced: dict = {}


def _global_trace(frame, event, arg, _get=_traced.get):
    """Called by CPython for every new (or resumed) frame on the recording thread: kept to one
    dict lookup for the frames that need nothing."""
    code = frame.f_code
    hit = _get(id(code))
    if hit is None or hit[0] is not code:
        info = code_info(code)
        hit = _traced[id(code)] = (code, info if info.traced else None)
    info = hit[1]
    if info is None:
        return None
    return frame.f_trace or FrameLoops(info).tracer


@atexit.register
def _stop_tracking_at_exit() -> None:
    # A program that ends inside a recorded iteration (its last step is only known to be over
    # at the next tape entry) would keep the trace function on while the interpreter tears
    # down modules: every frame run then (weakref callbacks, finalizers) would call into a
    # half-finalized module and print "Exception ignored". Atexit runs on the main thread,
    # where such an iteration records.
    if sys.gettrace() is _global_trace:
        sys.settrace(None)


def pause_tracking():
    """Turn line tracing off while Terra's own code runs (it would slow every line), or while
    library code that Terra runs as one unit does (a built-in layer's call, `tape.gradient`,
    `apply_gradients`): with a trace function installed, CPython calls it at every frame's
    start and runs every instruction through its tracing dispatch, about a fifth of a traced
    step of a convolutional model. A user frame that begins meanwhile (a user activation inside
    a built-in layer) counts its loop passes at op time, as library frames do."""
    if sys.gettrace() is _global_trace:
        sys.settrace(None)
        return True
    return False


def resume_tracking(paused: bool) -> None:
    if paused:
        sys.settrace(_global_trace)


class Locator:
    """Computes `Location`s for ops issued below `root` (a frame) on the current thread.

    `Locator(root, track_loops=True)` starts exact loop tracking for user frames (if another trace
    function, e.g. a debugger or coverage, is installed, or `track_loops=False`, user loops are
    counted at op time like library loops; a warning says so in the first case); `close()` stops
    it. `location()` is called from inside Terra at op time.
    """

    def __init__(self, root, track_loops: bool = True, resume=None, root_lasti=None):
        """`resume`: the location of the last op the iteration issued before this recording
        starts (a fallback records from the middle of an iteration), whose frames' loop passes
        the recording continues; `root_lasti`: the root frame's offset when the iteration
        began (which of its loops enclose the iteration, and are left out of locations)."""
        if root is None:
            raise ValueError("Locator: root frame is None")
        self._stop = set()
        f = root
        while f is not None:
            self._stop.add(f)
            f = f.f_back
        self._library: dict = {}  # frame -> LibraryFrameLoops (frames held until close)
        self._memo: dict = {}  # frame -> (offset, child frame, key above), see location()
        self._above: dict = {}  # frame -> the key of its callers, see location()
        self._generation = _generation
        self.memo_hits = 0
        self.tracking = False
        if track_loops:
            if sys.gettrace() is not None:
                warnings.warn("terra: a trace function (debugger/coverage) is active; loop "
                              "iterations are not part of recorded locations", RuntimeWarning)
            else:
                for f in self._stop:
                    info = code_info(f.f_code)
                    if info.traced and not isinstance(getattr(f.f_trace, "__self__", None),
                                                      FrameLoops):
                        at = root_lasti if f is root and root_lasti is not None else f.f_lasti
                        f.f_trace = FrameLoops(info, ignore_at=at).tracer
                sys.settrace(_global_trace)
                self.tracking = True
        if resume is not None:
            try:
                self._resume(root, resume)
            except Exception:  # noqa: BLE001 - counting from 0 is what a fallback did before
                self._library = {}

    def _resume(self, root, resume) -> None:
        """Continue the loop passes of the frames that issued the op at `resume` and are still
        in the same call. From the root down, frames at the same offsets as then wait in the
        same calls, down to the first frame that moved: at a later offset it is the same call
        gone on (and, back at an earlier one inside a loop of its own, a new pass of it); at an
        earlier offset outside its loops, another function, or the frame that issued that op
        (a call that has returned), it is a new call, made by a new pass of the nearest frame
        above it inside a loop (frames between, outside loops at the same offsets, are new
        calls too). Each continuing frame gets its state at that op, advanced as an op-time
        count advances it (`LibraryFrameLoops`); frames below begin afresh."""
        stack, f = [], sys._getframe(1)
        while f is not None:  # (a fallback starts recording from inside Terra, below the op)
            stack.append(f)
            if f is root:
                break
            f = f.f_back
        if f is not root:
            return
        stack.reverse()  # root first, as a location's frames
        live = [(k, info) for k, g in enumerate(stack)
                if not (info := code_info(g.f_code)).internal]
        then, loops = [], list(resume.loops)
        for label in resume.frames:
            name, _, offset = label.rpartition("@")
            mine = []
            while loops and loops[0].loop.rpartition("@")[0] == name:
                mine.append(loops.pop(0))
            then.append((name, -1 if offset == "op" else int(offset), mine))  # (`_op_frames`)
        n = min(len(live), len(then))
        e = 0
        at = [info.call_at(stack[k].f_lasti) for k, info in live]
        while e < n and live[e][1].label == then[e][0] and at[e] == then[e][1]:
            e += 1
        if e == 0 and not (n and live[0][1].label == then[0][0]):
            return
        new_pass = None  # the frame whose new pass made the new call below it
        if e < n and live[e][1].label == then[e][0] and (
                at[e] > then[e][1] or any(
                    s <= at[e] <= t and s <= then[e][1] <= t
                    for s, t, _ in live[e][1].loops)):
            same = e + 1  # the first frame that moved is the same call, gone on
        else:
            d = min(e, len(then) - 1)  # the first frame that is a new call
            looped = [j for j in range(d) if any(s <= then[j][1] <= t
                                                 for s, t, _ in live[j][1].loops)]
            same = d if not looped else looped[-1] + 1
            new_pass = looped[-1] if looped else None
        new_call = object()
        for j in range(same):
            k, info = live[j]
            if not info.loops:
                continue
            g, (_, o_then, its) = stack[k], then[j]
            child = stack[k + 1] if k + 1 < len(stack) else None
            state = LibraryFrameLoops(info)
            for it in its:
                if it.loop in info.loop_ids:
                    state.iters[info.loop_ids.index(it.loop)] = it.iteration
            for i, (s, t, _) in enumerate(info.loops):
                if s <= o_then <= t and state.iters[i] is None:
                    state.iters[i] = 0  # (a loop left out of locations: the root's own)
            state.last = o_then
            state.last_child = new_call if j == new_pass else child
            state.at(info.call_at(g.f_lasti), child)  # the passes since that op
            tracer = getattr(g.f_trace, "__self__", None)
            if isinstance(tracer, FrameLoops):  # the root: line events count from here on
                tracer.iters, tracer.last = list(state.iters), g.f_lasti
            else:
                state.ignored = info.none_ignored
                self._library[g] = state

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
        self._library = {}
        self._memo = {}
        self._above = {}

    def location(self, frame=None) -> Location:
        """Location of the op issued from `frame` (default: the caller's frame).

        Consecutive ops mostly share their callers: a frame reached through the same child
        frame at the same offset as in an earlier walk has not run since (its child, a plain
        function's frame, was on the stack all along), so neither it nor any frame above it
        has changed, and the interned key above it is taken from `_memo` instead of walking
        on. A frame met again through another child or at another offset has run since (it
        made another call), but its callers have not: they wait in the call that made it, so
        the key above it is taken from `_above` and only its own entry is computed (a backward
        pass's gradient functions, each called anew from one TF frame). A generator's frame
        can be resumed from another caller: never a memo hit through one, nor above one."""
        global _generation
        f = sys._getframe(1) if frame is None else frame
        if len(_nodes) > _MAX_LOCATIONS:
            _nodes.clear()
            _generation += 1
        memo, above = self._memo, self._above
        if self._generation != _generation or len(memo) > _MAX_MEMO or len(above) > _MAX_MEMO:
            memo.clear()
            above.clear()
            self._generation = _generation
        stop = self._stop
        walked = []
        node = None  # the interned key of the frames above the walk
        child = None
        top = False  # the walk ends at a frame whose callers' key is known
        while f is not None:
            if child is not None and _MEMO:
                m = memo.get(f)
                if m is not None and m[1] is child and m[0] == f.f_lasti:
                    node = m[2]
                    self.memo_hits += 1
                    break
                a = above.get(f, _ABSENT)
                if a is not _ABSENT:
                    node, top = a, True
                    self.memo_hits += 1
            code = f.f_code
            info = _infos.get(id(code))
            if info is None or info.code is not code:
                info = code_info(code)
            entry = None
            if not info.internal:
                lasti = info.call_at(f.f_lasti)
                if not info.loops:
                    entry = (info, lasti, ())
                else:
                    state = getattr(f.f_trace, "__self__", None) \
                        if self.tracking and not info.library else None
                    if isinstance(state, FrameLoops):
                        entry = (info, lasti, state.at(lasti))
                    else:  # op-time pass counting: library code, or a user frame that began
                        state = self._library.get(f)  # while tracking was paused
                        if state is None:
                            state = self._library[f] = LibraryFrameLoops(
                                info, ignore_at=lasti if f in stop else None)
                        entry = (info, lasti, state.at(lasti, child))
            walked.append((f, child, entry))
            if top or f in stop:
                break
            child = f
            f = f.f_back
        for f, child, entry in reversed(walked):
            if _MEMO and child is not None and not f.f_code.co_flags & _RESUMABLE:
                above[f] = node  # (a walk's first frame, the op's own, is never met again)
            if entry is not None:
                k = (entry, node)
                n = _nodes.get(k)
                if n is None:
                    n = _nodes[k] = _Key(entry, node)
                node = n
            if child is not None and not child.f_code.co_flags & _RESUMABLE:
                memo[f] = (f.f_lasti, child, node)
        if node is None:
            return _EMPTY
        loc = node.location
        if loc is None:
            loc = node.location = _build(node.entries())
        return loc


class _Key:
    """An interned location key: one frame's (info, offset, iterations) and the key of the
    frames above it (None at the root). Equal keys are the same object, so a lookup hashes one
    entry, not the whole stack."""
    __slots__ = ("entry", "parent", "location")

    def __init__(self, entry, parent):
        self.entry, self.parent, self.location = entry, parent, None

    def entries(self) -> list:
        """The frames' entries, op frame first (as `_build` takes them)."""
        out, k = [], self
        while k is not None:
            out.append(k.entry)
            k = k.parent
        return out


# Interned across recordings: the same program point gives the same `Location` object.
_nodes: dict = {}  # (entry, parent key) -> _Key
_MAX_LOCATIONS = 1 << 18
_generation = 0    # bumped when _nodes is cleared: memos hold keys of the old generation
# frames a Locator's memo holds alive at most: a finished call's frame keeps its locals (a
# layer's input and output tensors) alive while held; a hit needs only the current stack's
_MAX_MEMO = 256
_MEMO = True       # False: walk every frame (tests compare both)
_RESUMABLE = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
_EMPTY = Location((), ())
_ABSENT = object()
_frame_labels: dict = {}


_FALLBACK = "_eager_fallback"


def _op_frames(entries) -> list:
    """`entries` (root first) with the frames of a generated op wrapper made one program point.
    A `gen_*_ops.X` wrapper issues its op from the C fast path at one offset of `X`, or from
    `X_eager_fallback`, which it calls when an input is not an eager tensor (a placeholder,
    while Python runs ahead of the graph): the same op of the same call, whose two locations
    kept two traces of a site from sharing it (each path's copy of it in the site graph). The
    fallback frame is dropped and `X`'s offset replaced by "op" (`_build`)."""
    if len(entries) >= 2:
        info, caller = entries[-1][0], entries[-2][0]
        if info.library and info.name.endswith(_FALLBACK) and caller.file == info.file and \
                caller.name == info.name[:-len(_FALLBACK)]:
            entries = entries[:-1]
    if entries:
        info, lasti, iters = entries[-1]
        if info.library and info.file.startswith("gen_"):
            callers = entries[:-1]
            if info.label in _OPERATOR_WRAPPERS:
                callers = _operator_frames(callers)
            entries = callers + [(info, lasti, iters, "op")]
    return entries


# An arithmetic operator on tensors (`x * 0.5`, `1.0 - x`) reaches its op through these files'
# frames (operator override, traceback filter, API dispatch, `math_ops`, weak-tensor wrapper);
# skip mode issues it through `tf.raw_ops` (`tf_export`'s wrapper; runtime/python_runner.py
# `_OPERATORS`). Ops of `_OPERATOR_WRAPPERS` issued from user code through these frames alone
# get the user frame's location with none of them.
_OPERATOR_FILES = frozenset({"override_binary_operator.py", "tensor_math_operator_overrides.py",
                             "traceback_utils.py", "dispatch.py", "math_ops.py",
                             "weak_tensor_ops.py", "tf_export.py"})
_OPERATOR_WRAPPERS = frozenset({"gen_math_ops.py:add_v2", "gen_math_ops.py:sub",
                                "gen_math_ops.py:mul", "gen_math_ops.py:real_div",
                                "gen_math_ops.py:_pow"})


def _operator_frames(callers) -> list:
    """`callers` of a `_OPERATOR_WRAPPERS` op without the operator plumbing between the
    user's frame and the op (see `_OPERATOR_FILES`): one location for the eager operator and
    skip mode's `tf.raw_ops` call, so a trace recorded partly in skip mode shares the op with
    one recorded eagerly."""
    k = len(callers)
    while k > 0 and callers[k - 1][0].library and callers[k - 1][0].file in _OPERATOR_FILES \
            and not callers[k - 1][2]:
        k -= 1
    if k == len(callers) or k == 0 or callers[k - 1][0].library:
        return callers
    return callers[:k]


def _build(key) -> Location:
    frames, loops = [], []
    for info, lasti, iters, *at in _op_frames(list(reversed(key))):  # root first
        at = at[0] if at else lasti
        label = _frame_labels.get((info, at))
        if label is None:
            label = _frame_labels[(info, at)] = f"{info.label}@{at}"
            line = _line(info.code, lasti)
            FRAME_LINES[label] = (f"{info.file}:{line} ({info.name})", info.library)
            FRAME_SOURCES[label] = (info.code.co_filename, line, info.code.co_name,
                                    info.library)
            FRAME_TRIES[label] = () if info.library else except_regions(info.code, lasti)
            FRAME_LOOPS[label] = max((start for start, end, _ in info.loops
                                      if start <= lasti <= end), default=None)
        frames.append(label)
        for i, it in iters:
            loops.append(LoopIter(info.loop_ids[i], it))
    return Location(tuple(frames), tuple(loops))
