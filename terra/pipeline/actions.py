"""Pipeline actions: the unit of work one rank does (or starts) in one time step.

An `Action` is plain data: which stage, what kind of work, which micro-batch, and (for transfers)
the peer. Its text form is compact and unambiguous so that schedules print as readable grids and
round-trip through CSV:

=========  =======================  ==========================================================
kind       text                     meaning
=========  =======================  ==========================================================
F          ``2F0``                  stage 2 runs the forward of micro-batch 0
B          ``2B0``                  stage 2 runs the backward of micro-batch 0: the input
                                    gradient, sent upstream at once, and (unless the schedule
                                    has ``2W0``) the weight gradient in the same step
W          ``2W0``                  stage 2 computes micro-batch 0's weight gradient from what
                                    ``2B0`` left (zero-bubble schedules split the backward)
EVICT      ``0EV3>3``               stage 0 moves micro-batch 3's saved activations to rank 3
LOAD       ``0LD3<3``               stage 0 brings micro-batch 3's activations back from rank 3
SEND       ``1S0>2`` / ``2S0>1``    stage 1 sends micro-batch 0 to stage 2 (peer above: the
                                    forward activation; peer below: the input gradient)
RECV       ``2R0<1`` / ``1R0<2``    stage 2 receives micro-batch 0 from stage 1 (peer below:
                                    activation; peer above: gradient)
=========  =======================  ==========================================================

`stage` is always a *global* stage id (see `terra.pipeline.schedules.Schedule.stage_ranks`): for
interleaved schedules stage ``c * p + r`` is model chunk ``c`` on rank ``r``; for Chimera stages
``p .. 2p-1`` are the second (upward) pipeline. The EVICT/LOAD peer is a *rank* (the acceptor
holds the activations in its memory); the SEND/RECV peer is a *stage* (what is sent is a stage's
input or input gradient). A B whose (stage, micro-batch) has a W in the same schedule is the
input half of a split backward; without one it is the whole backward, so schedules written before
the split (GPipe, 1F1B, ...) mean what they meant. The peer is optional in the text form (``0EV3`` parses with
``peer=None``) so hand-written schedules stay short.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Optional


class Kind(str, enum.Enum):
    """What an action does. The value is the letter(s) used in the text form."""
    F = "F"
    B = "B"
    W = "W"
    EVICT = "EV"
    LOAD = "LD"
    SEND = "S"
    RECV = "R"

    def __repr__(self) -> str:
        return f"Kind.{self.name}"

    __str__ = __repr__


F, B, W, EVICT, LOAD, SEND, RECV = (Kind.F, Kind.B, Kind.W, Kind.EVICT, Kind.LOAD, Kind.SEND,
                                    Kind.RECV)

#: Kinds that occupy the compute lane of a rank (one per time step).
COMPUTE_KINDS = frozenset({F, B, W})
#: Kinds that run alongside compute (the transfer lane; any number per step).
TRANSFER_KINDS = frozenset({EVICT, LOAD, SEND, RECV})
# Direction arrow of the peer suffix, per kind ('>' = to the peer, '<' = from the peer).
_ARROW = {EVICT: ">", LOAD: "<", SEND: ">", RECV: "<"}

_TEXT = re.compile(r"^\s*(\d+)(EV|LD|F|B|W|S|R)(\d+)(?:([<>])(\d+))?\s*$")


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of pipeline work; see the module docstring for the text form."""
    stage: int
    kind: Kind
    microbatch: int
    peer: Optional[int] = None

    def __post_init__(self):
        if not isinstance(self.kind, Kind):
            try:
                object.__setattr__(self, "kind", Kind(self.kind) if self.kind in Kind._value2member_map_
                                   else Kind[self.kind])
            except (KeyError, TypeError):
                raise ValueError(f"Action kind must be one of {[k.name for k in Kind]}, "
                                 f"got {self.kind!r}") from None
        for name in ("stage", "microbatch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Action {name} must be a non-negative int, got {value!r}")
        if self.peer is not None:
            if self.kind in COMPUTE_KINDS:
                raise ValueError(f"{self.kind.name} actions take no peer, got peer={self.peer!r}")
            if isinstance(self.peer, bool) or not isinstance(self.peer, int) or self.peer < 0:
                raise ValueError(f"Action peer must be a non-negative int or None, got {self.peer!r}")

    # ----------------------------------------------------------------------------- properties
    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_transfer(self) -> bool:
        return self.kind in TRANSFER_KINDS

    @property
    def payload(self) -> Optional[str]:
        """For SEND/RECV with a known peer: ``"activation"`` (moves up the pipeline) or
        ``"gradient"`` (moves down); ``"activations"`` for EVICT/LOAD; None otherwise."""
        if self.kind in (EVICT, LOAD):
            return "activations"
        if self.peer is None or self.kind not in (SEND, RECV):
            return None
        upward = self.peer > self.stage if self.kind is SEND else self.peer < self.stage
        return "activation" if upward else "gradient"

    # ---------------------------------------------------------------------------- text form
    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.peer is not None:
            text += f"{_ARROW[self.kind]}{self.peer}"
        return text

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of `str`: ``Action.parse(str(a)) == a``."""
        if not isinstance(text, str):
            raise TypeError(f"Action.parse expects a str, got {type(text).__name__}")
        match = _TEXT.match(text)
        if match is None:
            raise ValueError(f"not an action: {text!r} (expected e.g. '2F0', '2B0', '2W0', '0EV3>3', "
                             f"'0LD3<3', '1S0>2', '2R0<1')")
        stage, letters, mb, arrow, peer = match.groups()
        kind = Kind(letters)
        if arrow is not None:
            if kind in COMPUTE_KINDS:
                raise ValueError(f"not an action: {text!r} ({kind.name} takes no peer)")
            if arrow != _ARROW[kind]:
                raise ValueError(f"not an action: {text!r} ({kind.name} is written with "
                                 f"'{_ARROW[kind]}' before its peer)")
        return cls(int(stage), kind, int(mb), None if peer is None else int(peer))


def parse_cell(text: str) -> tuple[Action, ...]:
    """Parse a grid cell: empty or ``.`` is no action, otherwise actions separated by ``+``."""
    text = text.strip()
    if text in ("", ".", "-"):
        return ()
    return tuple(Action.parse(part) for part in text.split("+"))


def format_cell(actions) -> str:
    return "+".join(str(a) for a in actions)
