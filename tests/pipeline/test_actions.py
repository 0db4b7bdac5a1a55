"""Action text form: every kind prints compactly and parses back."""
import itertools

import pytest

from terra.pipeline.actions import (Action, B, EVICT, F, Kind, LOAD, RECV, SEND, W, format_cell,
                                    parse_cell)


ALL = ([Action(s, k, mb) for s, k, mb in itertools.product((0, 3, 12), Kind, (0, 7, 31))]
       + [Action(s, k, mb, peer) for s, k, mb, peer in
          itertools.product((0, 5), (EVICT, LOAD, SEND, RECV), (0, 9), (1, 14))])


@pytest.mark.parametrize("action", ALL, ids=str)
def test_parse_round_trips(action):
    assert Action.parse(str(action)) == action
    assert repr(action) == f"Action({action})"


@pytest.mark.parametrize("text,expected", [
    ("2F0", Action(2, F, 0)),
    ("2B0", Action(2, B, 0)),
    ("2W0", Action(2, W, 0)),
    ("0EV3>3", Action(0, EVICT, 3, 3)),
    ("0LD3<3", Action(0, LOAD, 3, 3)),
    ("0EV3", Action(0, EVICT, 3)),
    ("1S0>2", Action(1, SEND, 0, 2)),
    ("2R0<1", Action(2, RECV, 0, 1)),
    ("10B11", Action(10, B, 11)),
])
def test_text_form(text, expected):
    assert Action.parse(text) == expected
    assert str(expected) == text


def test_payload_direction():
    assert Action.parse("1S0>2").payload == "activation"
    assert Action.parse("2S0>1").payload == "gradient"
    assert Action.parse("2R0<1").payload == "activation"
    assert Action.parse("1R0<2").payload == "gradient"
    assert Action.parse("0EV3>3").payload == "activations"
    assert Action.parse("2F0").payload is None


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "2F0>1", "2W0<1", "0EV3<3", "0LD3>3", "-1F0", "2 F 0"])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="not an action"):
        Action.parse(text)


def test_parse_rejects_non_str():
    with pytest.raises(TypeError):
        Action.parse(3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(stage=-1, kind=F, microbatch=0), "stage"),
    (dict(stage=0, kind=F, microbatch=1.5), "microbatch"),
    (dict(stage=0, kind="Q", microbatch=0), "kind"),
    (dict(stage=0, kind=F, microbatch=0, peer=1), "no peer"),
    (dict(stage=0, kind=SEND, microbatch=0, peer=-2), "peer"),
])
def test_bad_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Action(**kwargs)


def test_kind_by_name_or_letters_and_frozen():
    assert Action(0, "EVICT", 1) == Action(0, "EV", 1) == Action(0, EVICT, 1)
    a = Action(0, F, 0)
    with pytest.raises(AttributeError):
        a.stage = 1
    assert hash(a) == hash(Action(0, F, 0))
    assert not hasattr(a, "__dict__")  # slotted


def test_cells():
    cell = (Action(0, LOAD, 1, 3), Action(0, EVICT, 5, 3))
    assert format_cell(cell) == "0LD1<3+0EV5>3"
    assert parse_cell("0LD1<3+0EV5>3") == cell
    assert parse_cell("") == parse_cell(".") == ()
