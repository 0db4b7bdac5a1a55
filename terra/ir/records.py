"""Plain-data records of what one iteration of an imperative program did.

A `Trace` is the linear list of `OpRecord`s one iteration issued, in execution order. Everything
here is immutable data with a readable `repr`; the recorder (`terra.tracing`) builds it, the
compiler (`terra.compiler`) consumes it. Nothing in this module imports TensorFlow.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union


# --------------------------------------------------------------------------------------- location
@dataclass(frozen=True, slots=True)
class LoopIter:
    """One enclosing Python loop: which loop (`loop`, stable across iterations and traces) and
    which pass through its body (`iteration`, 0-based)."""
    loop: str
    iteration: int

    def __repr__(self) -> str:
        return f"{self.loop}#{self.iteration}"


@dataclass(frozen=True, slots=True)
class Location:
    """Where in the program an op was issued (the paper's call-id stack and loop-id stack).

    `frames` are call sites from the iteration's root frame down to the op, each a short stable
    string such as ``"train.py:step@42"`` (file:function@bytecode offset). `loops` are the loops
    enclosing the op, outermost first. Two ops can be the same TraceGraph node only if their
    locations are equal; `site` (locations without iteration numbers) is what a folded loop body
    matches on.
    """
    frames: tuple[str, ...]
    loops: tuple[LoopIter, ...] = ()

    @property
    def site(self) -> "Location":
        return Location(self.frames, tuple(LoopIter(l.loop, -1) for l in self.loops))

    def __repr__(self) -> str:
        where = " > ".join(self.frames[-3:])
        if len(self.frames) > 3:
            where = "… > " + where
        if self.loops:
            where += " [" + ", ".join(map(repr, self.loops)) + "]"
        return where

    def describe(self) -> str:
        """For messages: the innermost frame of the program's own code and the frame that issued
        the op, as ``file:line (function)`` (a bytecode offset names a call exactly; a line is
        what a user can find)."""
        if not self.frames:
            return "<no location>"
        lines = [FRAME_LINES.get(f, (f, False)) for f in self.frames]
        own = [i for i, (_, library) in enumerate(lines) if not library]
        shown = sorted({own[-1], len(lines) - 1} if own else {len(lines) - 1})
        parts = []
        for k, i in enumerate(shown):
            if k and i > shown[k - 1] + 1:
                parts.append("…")
            parts.append(lines[i][0])
        return " > ".join(parts)


# Frame label (``file:function@offset``) -> (``file:line (function)``, whether the frame is
# library code (TF, Keras, site-packages)); filled as labels are made (terra/tracing/locations.py).
FRAME_LINES: dict = {}

# Frame label -> (full file name, line, function name, whether library code): where a traceback
# shows the frame (terra/runtime/user_traceback.py).
FRAME_SOURCES: dict = {}

# Frame label -> bytecode offsets where the `try` blocks with an `except` clause that enclose the
# frame's call in flight begin (program frames only; library frames: ()); filled with FRAME_LINES.
# An op issued inside such a block must raise its error there (terra/runtime/python_runner.py).
FRAME_TRIES: dict = {}
# Frame label -> bytecode offset where the innermost loop enclosing its call in flight begins
# (None: no loop); a `try` that begins after it is entered anew on every pass.
FRAME_LOOPS: dict = {}


# ------------------------------------------------------------------------------------ input refs
@dataclass(frozen=True, slots=True)
class OutputRef:
    """Output `index` of the record at position `record` of the same trace."""
    record: int
    index: int = 0

    def __repr__(self) -> str:
        return f"%{self.record}:{self.index}" if self.index else f"%{self.record}"


@dataclass(frozen=True, slots=True)
class VariableRef:
    """A variable, by the identity of its resource handle (key into `Trace.variables`)."""
    key: int

    def __repr__(self) -> str:
        return f"$var{self.key}"


@dataclass(frozen=True, slots=True)
class ConstRef:
    """A small constant, by value. `value` is a hashable canonical form (see `freeze`); `dtype` a
    TF dtype name such as ``"float32"``. `origin` (not part of equality) numbers the tensor object
    the constant was, within its trace: uses of one object (a slice's bounds in the forward pass
    and in its gradient) share it, so generalization feeds them from one slot, and two objects
    that merely hold equal values do not share one."""
    value: Any
    dtype: str
    origin: Optional[int] = field(default=None, compare=False)

    def __repr__(self) -> str:
        return f"const({self.value!r}:{self.dtype})"


@dataclass(frozen=True, slots=True)
class FeedRef:
    """An external value the program supplied (new data, a changing Python scalar): slot `slot` of
    `Trace.feeds`."""
    slot: int

    def __repr__(self) -> str:
        return f"feed{self.slot}"


InputRef = Union[OutputRef, VariableRef, ConstRef, FeedRef]
# An op input is one ref, or a tuple of refs for list inputs (ConcatV2, AddN, ShapeN, ...).
InputArg = Union[InputRef, tuple]


# ------------------------------------------------------------------------------------- op record
@dataclass(frozen=True, slots=True)
class TensorSpec:
    """dtype name and shape (None for an unknown dimension) of one tensor."""
    dtype: str
    shape: Optional[tuple]

    def __repr__(self) -> str:
        dims = "?" if self.shape is None else "x".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.dtype}[{dims}]"


ROUTES = ("fast", "fallback", "function")


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One executed TF op (or one `tf.function` call, `route == "function"`).

    `attrs` holds every attribute, inferred ones too, as a sorted tuple of (name, frozen value)
    pairs so records hash and compare. `function` names the called function for function calls.
    """
    index: int
    op_type: str
    attrs: tuple
    inputs: tuple  # of InputArg, one per op_def input arg (or per flat input of a function call)
    outputs: tuple  # of TensorSpec
    location: Location
    route: str = "fast"
    function: Optional[str] = None
    taped: bool = True  # a gradient tape recorded it (False inside `stop_recording()`)

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    def input_refs(self) -> tuple:
        """Every input ref in order, the entries of list inputs flattened."""
        return tuple(r for a in self.inputs for r in (a if isinstance(a, tuple) else (a,)))

    @property
    def signature(self) -> tuple:
        """What must agree for two records to be the same node, data flow aside."""
        return (self.op_type, self.attrs, self.location, self.function, self.recorded)

    @property
    def recorded(self) -> bool:
        """Whether a tape records this op, as far as a path tells it apart: an op eager ran
        inside `stop_recording()` and the same op recorded get different gradients. A function
        call's flag is left out (TF runs every taped call's forward with the tapes stopped)."""
        return self.taped or self.route == "function"

    def __repr__(self) -> str:
        name = self.function or self.op_type
        args = ", ".join(map(repr, self.inputs))
        outs = ", ".join(map(repr, self.outputs))
        return f"%{self.index} = {name}({args}) -> ({outs}) @ {self.location!r}"


@dataclass(frozen=True, slots=True)
class Fetch:
    """Python materialized output `ref` (via `.numpy()`, `bool()`, ...) after `after_record`
    records had run. Fetch points become Output-Fetching ops. `in_unit`: read by the Python of
    a coarse unit (`tape.gradient`, a Keras layer, ...), which skip mode does not run."""
    ref: OutputRef
    after_record: int
    how: str = "numpy"
    in_unit: bool = False


# Feed.source of a constant the members of a shape group hold different values of (the
# runtime puts the member's: terra/runtime/shape_groups.py)
SHAPE_CONSTANT = "shape-constant"
# Feed.source of a constant the paths of one site hold different values of (a site graph's
# plan puts the path's: terra/compiler/site_constants.py)
SITE_CONSTANT = "site-constant"


@dataclass(frozen=True, slots=True)
class Feed:
    """One external input: its spec and where it came from (e.g. "numpy", "python-scalar",
    "eager-tensor", SHAPE_CONSTANT: a shape group's constant the runtime puts, or SITE_CONSTANT:
    a path's constant its site graph's plan puts)."""
    slot: int
    spec: TensorSpec
    source: str


@dataclass(slots=True)
class Trace:
    """The ops of one iteration in execution order, plus the tables their refs point into.

    `variables` maps VariableRef keys to the live variable objects; `feed_values` holds this
    iteration's value for each feed slot (used to replay and to compare). `unsupported` lists op
    types the recorder could not represent: a trace with any is not compiled. `functions`,
    `unseeded_random` and `fast_fallbacks` are described where they are declared.
    """
    site: str
    records: list = field(default_factory=list)
    feeds: list = field(default_factory=list)
    feed_values: list = field(default_factory=list)
    fetches: list = field(default_factory=list)
    variables: dict = field(default_factory=dict)
    unsupported: list = field(default_factory=list)
    # Optional, added for replay and skip mode (empty by default):
    functions: dict = field(default_factory=dict)        # function name -> callable function object
    unseeded_random: list = field(default_factory=list)  # indices of function calls whose bodies
    #                                                      hold stateful random ops without a
    #                                                      generator: graph replay cannot reproduce them
    fast_fallbacks: list = field(default_factory=list)   # indices of records whose fast-path attempt
    #                                                      raised the fallback exception first
    shape_reads: dict = field(default_factory=dict)      # OutputRef -> records run when Python
    #                                                      first read its shape (outside units)
    first_unsupported: int | None = None                 # the record of the first problem in
    #                                                      `unsupported` (0: not an op's)

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return (f"Trace({self.site!r}, {len(self.records)} ops, {len(self.feeds)} feeds, "
                f"{len(self.fetches)} fetches, {len(self.variables)} variables)")


def replace(obj, **changes):
    """`dataclasses.replace` for the records here (they are frozen)."""
    return dataclasses.replace(obj, **changes)
