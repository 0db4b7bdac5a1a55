"""Ada-Grouper as pure data: candidates on the memory-limit curve, and a tuner that follows the
best k as the network changes (a synthetic machine: the model's compute twice as slow, the
network as modelled), beating every fixed k over the run."""
import pytest

from terra.pipeline import ada_grouper as ag
from terra.pipeline.simulate import simulate
from terra.pipeline.schedules import kfkb

P, BATCH = 4, 48
ACT, STATIC, MSG = [400] * 4, [10000] * 4, [2000] * 4


def costs(b):
    f = [0.5 + 0.1 * b] * 4          # small micro-batches run below peak efficiency
    return f, [2 * x for x in f]


def test_candidates_lie_on_the_memory_limit_curve():
    cands = ag.candidates(P, BATCH, act_bytes_per_sample=ACT, static_bytes=STATIC, budget=24000)
    assert [(c.k, c.microbatch_size) for c in cands] == [(1, 8), (2, 4), (3, 2), (4, 2), (6, 1), (8, 1)]
    for c in cands:
        assert max(c.peak_bytes) <= 24000
        assert c.microbatches * c.microbatch_size == BATCH and c.microbatches % c.k == 0
        # The next larger micro-batch size that the group allows does not fit: nothing under-used.
        bigger = [b for b in range(c.microbatch_size + 1, BATCH + 1)
                  if BATCH % b == 0 and (BATCH // b) % c.k == 0 and BATCH // b >= P]
        if bigger:
            b = bigger[0]
            sim = simulate(kfkb(P, BATCH // b, c.k), act_bytes=[a * b for a in ACT], weight_bytes=STATIC)
            assert max(sim.peak_bytes) > 24000
    with pytest.raises(ValueError, match="one activation size"):
        ag.candidates(P, BATCH, act_bytes_per_sample=[1], static_bytes=STATIC, budget=1)
    assert ag.candidates(P, BATCH, act_bytes_per_sample=ACT, static_bytes=STATIC, budget=100) == []


_MACHINE = {}


def machine(c, per_byte):
    """The synthetic machine: compute twice the model's, the wire as modelled."""
    key = (c, per_byte)
    if key not in _MACHINE:
        nominal = ag.estimate(c, costs, MSG, 0.0)
        _MACHINE[key] = 2 * nominal + ag.estimate(c, costs, MSG, per_byte) - nominal
    return _MACHINE[key]


def test_tuner_follows_the_network_and_beats_every_fixed_k():
    cands = ag.candidates(P, BATCH, act_bytes_per_sample=ACT, static_bytes=STATIC, budget=24000)
    phases = [(0.0, 12), (3e-4, 18), (1e-3, 12), (0.0, 15)]
    trace = [pb for pb, n in phases for _ in range(n)]
    tuner = ag.Tuner(cands, costs, MSG, period=3, max_per_byte=0.01)
    total, ks = 0.0, []
    for pb in trace:
        seconds = machine(tuner.current, pb)
        total += seconds
        ks.append(tuner.current.k)
        tuner.observe(seconds)
    offline = {pb: min(cands, key=lambda c: (machine(c, pb), c.k)).k for pb, _ in phases}
    assert offline == {0.0: 1, 3e-4: 2, 1e-3: 4}
    start = 0
    for pb, n in phases:           # by the end of each phase the tuner runs the offline best
        assert ks[start + n - 1] == offline[pb], (pb, ks)
        start += n
    fixed = {c.k: sum(machine(c, pb) for pb in trace) for c in cands}
    assert total < min(fixed.values()), (total, fixed)
    # The network it inferred is the one that was there.
    assert [h[3] for h in tuner.history][-1] == pytest.approx(0.0)
    assert max(h[3] for h in tuner.history) == pytest.approx(1e-3, rel=1e-6)


def test_a_measured_link_switches_at_the_first_step_of_a_new_network():
    """Told the link's time per byte each step, the tuner runs the offline best from the step
    after the network changes (no period of step times to wait for), and so loses less to every
    change than the tuner that infers the network from step times."""
    cands = ag.candidates(P, BATCH, act_bytes_per_sample=ACT, static_bytes=STATIC, budget=24000)
    phases = [(0.0, 12), (3e-4, 18), (1e-3, 12), (0.0, 15)]
    trace = [pb for pb, n in phases for _ in range(n)]
    offline = {pb: min(cands, key=lambda c: (machine(c, pb), c.k)).k for pb, _ in phases}
    totals = {}
    for told in (True, False):
        tuner = ag.Tuner(cands, costs, MSG, period=3, max_per_byte=0.01, settle=2,
                         nominal_seconds={c.k: machine(c, 0.0) for c in cands})
        total, ks = 0.0, []
        for pb in trace:
            seconds = machine(tuner.current, pb)
            total += seconds
            ks.append(tuner.current.k)
            tuner.observe(seconds, pb if told else None)
        totals[told] = total
        if told:
            start = 0
            for pb, n in phases:   # the phase's first step runs the old plan, every later one the best
                assert ks[start + 1:start + n] == [offline[pb]] * (n - 1), (pb, ks)
                start += n
            assert [h[3] for h in tuner.history] == trace
    assert totals[True] < totals[False]
    assert totals[True] < min(sum(machine(c, pb) for pb in trace) for c in cands)


def test_measured_nominal_times_replace_the_calibration():
    cands = ag.candidates(P, BATCH, act_bytes_per_sample=ACT, static_bytes=STATIC, budget=24000)
    measured = {c.k: machine(c, 0.0) for c in cands}
    tuner = ag.Tuner(cands, costs, MSG, period=2, settle=1, nominal_seconds=measured, max_per_byte=0.01)
    assert tuner.factor == 1.0 and tuner.current.k == 1
    switched = [tuner.observe(machine(tuner.current, 1e-3)) for _ in range(3)]
    assert switched[:2] == [None, None] and switched[2].k == 4   # settle, then one period of 2
    with pytest.raises(ValueError, match="no candidate"):
        ag.Tuner([], costs, MSG)


def test_ranks_sharing_compute_are_modelled_as_such():
    """On one machine's cores (logical CPUs, local workers) the ranks' actions slow each other
    down: the tuner's model takes `Costs.parallel` and ranks candidates by it."""
    cands = ag.candidates(P, BATCH, act_bytes_per_sample=ACT, static_bytes=STATIC, budget=24000)
    shared = ag.Tuner(cands, costs, MSG, parallel=1, nominal_seconds={c.k: 1.0 for c in cands})
    alone = ag.Tuner(cands, costs, MSG, nominal_seconds={c.k: 1.0 for c in cands})
    for c in cands:
        assert shared._model(c, 1e-3) == ag.estimate(c, costs, MSG, 1e-3, parallel=1)
        assert alone._model(c, 1e-3) == ag.estimate(c, costs, MSG, 1e-3)
    # With one device's worth of compute for 4 ranks, the step is at least all the work.
    c = cands[0]
    f, b = costs(c.microbatch_size)
    assert shared._model(c, 0.0) == pytest.approx(c.microbatches * (sum(f) + sum(b)))
    assert alone._model(c, 0.0) < shared._model(c, 0.0)
