"""validate / problems: each kind of broken schedule is caught and the culprit marked."""
from dataclasses import replace

import pytest

from terra.pipeline import Action, Schedule
from terra.pipeline.passes import add_evict_load, add_send_recv
from terra.pipeline.schedules import chimera, interleaved_1f1b, kfkb, one_f_one_b, zb_h1, zb_v
from terra.pipeline.validate import ScheduleError, problems, validate


def edit(schedule, rank, changes=None, transfers=None):
    """Copy of ``schedule`` with compute cells ``{step: text or None}`` (and transfer cells
    ``{step: (texts,)}``) of ``rank`` replaced."""
    compute = [list(row) for row in schedule.compute]
    for t, text in (changes or {}).items():
        compute[rank][t] = None if text is None else Action.parse(text)
    lanes = [list(row) for row in schedule.transfers]
    for t, texts in (transfers or {}).items():
        lanes[rank][t] = tuple(Action.parse(x) for x in texts)
    return replace(schedule, compute=tuple(map(tuple, compute)), transfers=tuple(map(tuple, lanes)))


@pytest.mark.parametrize("s", [one_f_one_b(4, 8), kfkb(4, 8, 2), interleaved_1f1b(4, 8, 2),
                               chimera(4, 8), add_send_recv(add_evict_load(one_f_one_b(6, 12))),
                               zb_h1(4, 8), zb_v(4, 8), add_send_recv(zb_v(3, 6))],
                         ids=repr)
def test_valid_schedules_pass(s):
    assert problems(s) == []
    assert validate(s) is s


def test_backward_before_its_dependencies_is_marked():
    s = one_f_one_b(4, 8)
    # swap 3F0 (step 3) and 3B0 (step 4) on the last rank
    broken = edit(s, 3, {3: "3B0", 4: "3F0"})
    with pytest.raises(ScheduleError) as info:
        validate(broken)
    err = info.value
    text = str(err)
    assert "[3B0] depends on 3F0 at step 4" in text
    grid_row = [line for line in text.splitlines() if line.startswith("r3")][0]
    assert grid_row.split()[4] == "3B0!"
    assert [(p.rank, p.step, str(p.action)) for p in err.problems][0] == (3, 3, "3B0")
    # 3B0 now precedes 3F0 in rank 3's own order: a real deadlock, every rank blocks on B0
    assert [str(p) for p in err.problems[1:]] == [
        "rank 0 step 7: [0B0] deadlock: rank 0 blocks here waiting for 1B0",
        "rank 1 step 6: [1B0] deadlock: rank 1 blocks here waiting for 2B0",
        "rank 2 step 5: [2B0] deadlock: rank 2 blocks here waiting for 3B0",
        "rank 3 step 3: [3B0] deadlock: rank 3 blocks here waiting for 3F0"]


def test_forward_too_early_is_marked():
    s = one_f_one_b(4, 8)
    broken = edit(s, 1, {1: None, 0: "1F0"})  # 1F0 in step 0, same step as 0F0
    errs = problems(broken)
    assert [(p.rank, p.step, str(p.action)) for p in errs] == [(1, 0, "1F0")]
    assert "depends on 0F0 at step 0 (must finish in an earlier step)" in errs[0].message


def test_missing_duplicate_and_misplaced_actions():
    s = one_f_one_b(3, 3)
    missing = edit(s, 2, {s.compute[2].index(Action.parse("2B1")): None})
    msgs = [str(p) for p in problems(missing)]
    assert any("micro-batch 1 is missing ['2B1']" in m for m in msgs)
    assert any("[1B1] depends on 2B1, which never runs" in m for m in msgs)

    dup = edit(s, 0, {s.steps - 1: None})
    dup = edit(dup, 0, {4: "0B0"})  # 0B0 twice (it is also at step 5)
    assert any("runs twice" in str(p) for p in problems(dup))

    wrong_rank = edit(s, 1, {1: "0F0"})
    assert any("stage 0 runs on rank 0, not rank 1" in str(p) for p in problems(wrong_rank))

    out_of_range = edit(s, 0, {0: "0F7"})
    assert any("micro-batch 7 out of range (m=3)" in str(p) for p in problems(out_of_range))

    transfer_in_compute = edit(s, 0, {3: "0EV1>2"})
    assert any("EVICT belongs in the transfer lane" in str(p) for p in problems(transfer_in_compute))


def test_deadlock_is_reported():
    compute = ((Action.parse("0F0"), Action.parse("0B0"), Action.parse("0F1"), Action.parse("0B1")),
               (Action.parse("1F1"), Action.parse("1B1"), Action.parse("1F0"), Action.parse("1B0")))
    s = Schedule("crossed", 2, 2, compute, stage_ranks=(0, 1), pipe_depth=2)
    errs = problems(s)
    dead = [p for p in errs if p.message.startswith("deadlock")]
    assert [(p.rank, str(p.action), p.message) for p in dead] == [
        (0, "0B0", "deadlock: rank 0 blocks here waiting for 1B0"),
        (1, "1F1", "deadlock: rank 1 blocks here waiting for 0F1")]


def test_evict_load_errors_are_marked_in_transfer_row():
    s = add_evict_load(one_f_one_b(4, 8))
    no_load = edit(s, 0, transfers={8: ()})       # drop 0LD1<3
    errs = problems(no_load)
    assert any("evicted at step 2 are never loaded back" in str(p) for p in errs)

    early = edit(s, 0, transfers={0: ("0EV0>3",)})  # evict during its own forward
    with pytest.raises(ScheduleError) as info:
        validate(early)
    assert "before their forward finished" in str(info.value)
    row = [line for line in str(info.value).splitlines() if line.startswith("  ~")][0]
    assert row.split()[1] == "0EV0>3!"

    stray = edit(s, 1, transfers={5: ("1LD0<2",)})
    assert any("loads activations that were not evicted" in str(p) for p in problems(stray))

    self_peer = edit(s, 0, transfers={2: ("0EV1>0",)})
    assert any("peer rank 0 must be another rank" in str(p) for p in problems(self_peer))


def test_send_recv_errors():
    s = add_send_recv(one_f_one_b(2, 2))
    no_recv = edit(s, 1, transfers={1: ()})          # drop 1R0<0
    msgs = [str(p) for p in problems(no_recv)]
    assert any("[1F0] input from stage 0 is never received" in m for m in msgs)
    assert any("[0S0>1] has no matching RECV" in m for m in msgs)

    late = edit(edit(s, 1, transfers={1: ()}), 1, transfers={3: ("1R0<0", "1R1<0")})
    assert any("received after 1F0 needed it" in str(p) for p in problems(late))

    bad_peer = edit(s, 0, transfers={0: ("0S0>5",)})
    assert any("peer must be a neighbouring stage" in str(p) for p in problems(bad_peer))


def test_validate_type_error():
    with pytest.raises(TypeError, match="Schedule"):
        problems("1F0")


def test_weight_gradient_errors():
    s = zb_h1(2, 2)
    # stage 1 defers one W: 1F0 1B0 1F1 1B1 1W0 1W1 from step 1 on
    assert [str(a) for a in s.compute[1]] == ["None", "1F0", "1B0", "1F1", "1B1", "1W0", "1W1"]
    early = edit(s, 1, {2: "1W0", 5: "1B0"})
    assert ("rank 1 step 2: [1W0] depends on 1B0 at step 5 (must finish in an earlier step)"
            in [str(p) for p in problems(early)])
    twice = edit(s, 1, {6: "1W0"})
    msgs = [str(p) for p in problems(twice)]
    assert "rank 1 step 6: [1W0] runs twice (also at rank 1 step 5)" in msgs
    one_split = edit(one_f_one_b(2, 2), 1, {5: "1W0"})   # split one backward of 1F1B: fine
    assert problems(one_split) == [] and one_split.split == {(1, 0)}
    no_b = edit(s, 1, {2: None})
    assert any("[1W0] depends on 1B0, which never runs" in str(p) for p in problems(no_b))
    with pytest.raises(ValueError, match="W actions take no peer"):
        Action(1, "W", 0, peer=2)
    misplaced = edit(s, 0, transfers={0: ("0W0",)})
    assert any("W belongs in the compute lane" in str(p) for p in problems(misplaced))


def test_evicting_between_b_and_w_is_refused():
    """W reads the activations B read: they may not leave between the two."""
    s = zb_h1(4, 8)
    b_at = s.compute[0].index(Action.parse("0B0"))
    assert s.compute[0][b_at + 1] == Action.parse("0W0")
    between = edit(s, 0, transfers={b_at: ("0EV0>3",)})
    assert any("[0EV0>3] evicts activations after their backward" in str(p)
               for p in problems(between))
