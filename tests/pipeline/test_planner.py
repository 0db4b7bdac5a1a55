"""The planner as pure data: synthetic profiles with known costs, exact expected cuts."""
import pytest

from terra.pipeline import planner, schedules
from terra.pipeline.profile import CallProfile, Profile


def synthetic(times, acts, params=None, value_bytes=8):
    """A chain of calls: call i takes ``times[i]`` forward (twice that backward), saves
    ``acts[i]`` internal bytes, holds ``params[i]`` bytes of weights; the loss is free."""
    n = len(times)
    params = params or [0] * n
    calls = tuple(CallProfile(i, f"c{i}", ((i, params[i]),) if params[i] else (), 0, acts[i], (), 0,
                              float(times[i]), 2.0 * times[i]) for i in range(n))
    loss = CallProfile(n, "loss", (), 0, 0, (), 0, 0.0, 0.0)
    return Profile("synthetic", 1, calls, loss, {k: value_bytes for k in range(n + 1)}, {},
                   tuple((k,) for k in range(n + 1)), True, (0.0, 0.0))


def test_bottleneck_optimal_cut_and_in_flight_packs():
    plan = planner.plan(synthetic([1, 1, 1, 1, 4, 4], [0] * 6), schedules.one_f_one_b(3, 4))
    assert plan.cuts == (4, 5) and plan.bottleneck == pytest.approx(12.0)
    assert [p.inflight for p in plan.parts] == [3, 2, 1]
    assert plan.step_time == pytest.approx(12.0 * 4 + 2 * 12.0)   # (m + p - 1) x the balanced part


def test_memory_budget_takes_the_fastest_cut_that_fits():
    # Cut 2 is fastest (times 2 | 2) but part 0 then holds 2 packs of 100 + 100 bytes.
    profile = synthetic([1, 1, 1, 1], [100, 100, 1, 1])
    free = planner.plan(profile, schedules.one_f_one_b(2, 4))
    assert free.cuts == (2,) and free.parts[0].memory == 400
    tight = planner.plan(profile, schedules.one_f_one_b(2, 4), memory_budget=399)
    assert tight.cuts == (1,) and tight.parts[0].memory == 200 and tight.bottleneck == pytest.approx(9.0)
    assert "Memory binds hardest on part 0: 200 of 399 B" in tight.explain()
    assert any(not fits for _, _, _, fits in tight.alternatives)   # moving the cut right breaks it
    with pytest.raises(planner.NoPlan, match="fits 150 B per part"):
        planner.plan(profile, schedules.one_f_one_b(2, 4), memory_budget=150)


def test_static_bytes_count_weights_grads_and_optimizer_slots_once_per_variable():
    profile = synthetic([1, 1], [0, 0], params=[40, 0])
    plan = planner.plan(profile, schedules.gpipe(2, 2), optimizer_slots=2)
    assert [p.static_bytes for p in plan.parts] == [40 * 4, 0]
    assert planner.plan(profile, schedules.gpipe(2, 2), optimizer_slots=0).parts[0].static_bytes == 80


def test_ties_break_toward_fewer_bytes_crossing_the_cut():
    profile = synthetic([3, 0, 0, 3], [0] * 4)      # every cut gives parts of 9 and 9
    profile.value_bytes.update({1: 1000, 2: 1000, 3: 10})
    plan = planner.plan(profile, schedules.gpipe(2, 1))
    assert plan.cuts == (3,) and plan.parts[0].message_bytes == 10
    profile.value_bytes.update({1: 5})
    assert planner.plan(profile, schedules.gpipe(2, 1)).cuts == (1,)


def test_bad_cuts_and_budgets_are_refused():
    profile = synthetic([1, 1, 1], [0] * 3)
    sch = schedules.one_f_one_b(2, 2)
    with pytest.raises(ValueError, match="cuts must be 1 increasing"):
        planner.plan(profile, sch, cuts=[0])
    with pytest.raises(ValueError, match="memory_budget must be a positive"):
        planner.plan(profile, sch, memory_budget=-1)
    with pytest.raises(planner.NoPlan, match="fewer than the 4 parts"):
        planner.plan(profile, schedules.one_f_one_b(4, 4))
    with pytest.raises(ValueError, match="copies of the model"):
        planner.plan(profile, schedules.chimera(2, 2))


def test_parts_are_costed_from_the_half_of_the_model_they_lie_in():
    """Measured: a noop's launch (a part's fixed cost), the model in two halves. Each half's calls
    share that half's time beyond the launch by their own times beyond a noop's, so a half is
    predicted at exactly its measured time and a quarter at the launch plus its calls' share."""
    import dataclasses
    base = synthetic([3.0, 1.0, 2.0, 2.0], [0] * 4)   # alone: F 3, 1, 2, 2; B twice that
    profile = dataclasses.replace(base, overhead=(0.5, 0.25), whole=(6.0, 10.0),
                                  halves=((0, 2, 4.5, 9.0), (2, 4, 3.5, 5.0)))
    fwd, bwd, fixed, unit = planner._costs(profile)
    assert unit == "s" and fixed == (0.5, 0.25)
    assert fwd == pytest.approx([4.0 * 2.5 / 3, 4.0 * 0.5 / 3, 1.5, 1.5, 0.0])
    assert bwd == pytest.approx([8.75 * 5.75 / 7.5, 8.75 * 1.75 / 7.5, 2.375, 2.375, 0.0])
    parts = planner._Parts(profile, 0)
    assert parts.time(0, 2) == pytest.approx((4.5, 9.0))     # the halves, as measured
    assert parts.time(2, 4) == pytest.approx((3.5, 5.0))
    four = planner.plan(profile, schedules.one_f_one_b(4, 4))
    assert sum(p.time for p in four.parts) == pytest.approx(4.5 + 9.0 + 3.5 + 5.0 + 2 * 0.75)
    # Without the halves measured, the calls share the whole model's time.
    whole = dataclasses.replace(base, overhead=(0.5, 0.25), whole=(6.0, 10.0))
    assert parts.time(0, 4) != planner._Parts(whole, 0).time(0, 4)
    assert planner._Parts(whole, 0).time(0, 4) == pytest.approx((6.0, 10.0))
