"""simulate: held micro-batches, accepted ones, bytes, step time and bubble, text timeline and
PNG plot."""
import math

import pytest

from terra.pipeline import Action, Costs, simulate
from terra.pipeline.passes import add_evict_load
from terra.pipeline.schedules import (chimera, dualpipe_v, gpipe, interleaved_1f1b, one_f_one_b,
                                      zb_h1, zb_v)
from tests.pipeline.test_validate import edit


def test_one_f_one_b_counts():
    r = simulate(one_f_one_b(4, 8))
    assert r.peak_microbatches == (4, 3, 2, 1)
    assert r.peak_accepted == (0, 0, 0, 0) and r.evictions == 0 and r.ok
    # rank 3 holds micro-batch i exactly during its F and B steps (3 + 2i, 4 + 2i)
    assert r.held[3] == (0, 0, 0) + (1,) * 16 + (0, 0, 0)
    assert r.peak_stage_microbatches == {0: 4, 1: 3, 2: 2, 3: 1}


def test_bpipe_bytes_balance():
    """Bytes = weights + act_bytes per held micro-batch; BPipe moves the peak from rank 0."""
    act, w = 1000, 50_000
    plain = simulate(one_f_one_b(8, 16), act_bytes=act, weight_bytes=w)
    bp = simulate(add_evict_load(one_f_one_b(8, 16)), act_bytes=act, weight_bytes=w)
    assert plain.peak_bytes == tuple(w + act * min(8 - s, 16) for s in range(8))
    mu = math.ceil((8 + 2) / 2)
    assert bp.peak_bytes == tuple(w + act * n for n in bp.peak_microbatches)
    assert max(bp.peak_bytes) == w + act * mu < max(plain.peak_bytes)
    for rank in range(8):
        for t in range(bp.schedule.steps):
            assert bp.bytes[rank][t] == w + act * bp.held[rank][t]


def test_per_stage_sizes_and_interleaved_ranks():
    s = interleaved_1f1b(2, 2, 2)   # rank 0 runs stages 0 and 2, rank 1 stages 1 and 3
    r = simulate(s, act_bytes={0: 1, 1: 10, 2: 100, 3: 1000}, weight_bytes=[7, 70, 700, 7000])
    static = [7 + 700, 70 + 7000]
    for rank in range(2):
        for t in range(s.steps):
            held = [(st, mb) for st in s.stages_of(rank) for mb in range(2)
                    if _step(s, st, "F", mb) <= t <= _step(s, st, "B", mb)]
            assert r.bytes[rank][t] == static[rank] + sum(10 ** st for st, _ in held)


def _step(s, stage, kind, mb):
    a = Action.parse(f"{stage}{kind}{mb}")
    return next(t for r in range(s.p) for t, x in enumerate(s.compute[r]) if x == a)


def test_accepted_counted_on_acceptor():
    s = add_evict_load(one_f_one_b(4, 8))
    r = simulate(s, act_bytes=10)
    # micro-batch 1 is away from rank 0 during steps 3..7 and on rank 3 during steps 2..8
    assert [r.accepted[3][t] for t in range(1, 10)] == [0, 1, 1, 1, 1, 1, 2, 2, 1]
    assert r.peak_accepted == (0, 0, 0, 2) and r.peak_microbatches[3] == 3
    assert r.loads == r.evictions == 3


def test_gpipe_and_chimera_peaks():
    assert simulate(gpipe(3, 5)).peak_microbatches == (5, 5, 5)
    assert simulate(chimera(4, 8)).peak_microbatches == (3, 4, 4, 3)


def test_violations_are_reported_not_raised():
    broken = edit(one_f_one_b(2, 2), 1, {1: "1B0", 2: "1F0"})
    r = simulate(broken)
    assert not r.ok and "[1B0] depends on 1F0" in str(r.violations[0])


def test_timeline_text():
    text = simulate(add_evict_load(one_f_one_b(4, 8))).timeline()
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["step", "0", "1"]
    assert lines[1].split()[:5] == ["r0", "0F0", "0F1", "0F2", "0F3"]
    assert lines[2].split() == ["~", "0EV1>3", "0EV3>3", "0LD1<3", "0EV5>3", "0LD3<3", "0LD5<3"]
    assert lines[3].split()[1:] == ["1", "2", "3", "3", "3", "3", "3", "3", "3", "3", "3", "3",
                                    "3", "3", "3", "3", "3", "3", "2", "2", "1", "1"]
    assert lines[-1] == "peak micro-batches per rank: 3 3 2 3; evictions: 3"
    assert "more steps" in simulate(one_f_one_b(4, 8)).timeline(max_steps=5)


def test_plot_png(tmp_path):
    pytest.importorskip("matplotlib")  # an optional dependency (the "bench" extra)
    path = simulate(add_evict_load(one_f_one_b(4, 8))).plot(tmp_path / "bpipe.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    path2 = simulate(chimera(4, 4)).plot(tmp_path / "sub" / "chimera.png", title="chimera")
    assert open(path2, "rb").read()[:4] == b"\x89PNG"


def test_plot_draws_w_cells(tmp_path):
    """W boxes are drawn in their own colour (purple), with a legend entry."""
    pytest.importorskip("matplotlib")
    import numpy as np
    from matplotlib.image import imread
    purple = np.array([0x81, 0x72, 0xB3]) / 255
    for schedule, has_w in ((zb_h1(2, 2), True), (one_f_one_b(2, 2), False)):
        path = simulate(schedule).plot(tmp_path / f"{schedule.name}.png")
        pixels = imread(path)[..., :3]
        found = np.isclose(pixels, purple, atol=0.02).all(axis=-1).sum()
        assert (found > 100) == has_w, (schedule.name, found)


@pytest.mark.parametrize("kwargs,match", [
    (dict(act_bytes=-1), "non-negative"),
    (dict(act_bytes=[1, 2]), "needs 4 entries"),
    (dict(weight_bytes={0: 1}), "lacks stages"),
    (dict(act_bytes=1.5), "non-negative ints"),
])
def test_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        simulate(one_f_one_b(4, 4), **kwargs)


def test_repr():
    r = simulate(one_f_one_b(2, 2), act_bytes=1)
    assert repr(r) == ("SimResult(1f1b, peak_microbatches=[2, 1], peak_accepted=[0, 0], "
                       "evictions=0, violations=0, peak_bytes=[2, 1])")
    with pytest.raises(TypeError):
        simulate([[None]])


def test_docs_grid_is_current():
    import pathlib
    doc = pathlib.Path(__file__).resolve().parents[2] / "docs" / "pipeline_schedules.md"
    text = doc.read_text()
    assert simulate(add_evict_load(one_f_one_b(4, 8))).timeline() in text
    assert simulate(one_f_one_b(4, 8)).timeline() in text
    assert str(zb_h1(4, 8)) in text and str(zb_v(4, 8)) in text


# ---------------------------------------------------------------------------- split backward
def test_split_backward_holds_activations_until_w():
    s = zb_h1(4, 8)
    r = simulate(s, act_bytes=10)
    assert r.peak_microbatches == (4, 4, 4, 4)          # 1F1B: (4, 3, 2, 1)
    # the last rank holds micro-batch 0 from 3F0 (step 3) through 3W0 (step 11), not 3B0 (4)
    assert _step(s, 3, "F", 0) == 3 and _step(s, 3, "B", 0) == 4 and _step(s, 3, "W", 0) == 11
    assert r.held[3][:12] == (0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 4)   # 3F1 at 5, 3F2 at 7, ...; 3W0 at 11
    assert r.peak_bytes == (40, 40, 40, 40)


# ------------------------------------------------------------------------------- cost model
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (4, 16), (8, 8), (8, 24), (16, 32)])
def test_closed_form_bubbles(p, m):
    """F = B = W = 1, a whole backward costs 2: bubble (p-1)/m for 1F1B (and GPipe), (p-1)/3m
    for ZB-H1, (p-1)/6m for ZB-V from m = 2p - 1 on (its ranks idle only for the ramp)."""
    one, h1, v = simulate(one_f_one_b(p, m)), simulate(zb_h1(p, m)), simulate(zb_v(p, m))
    assert one.step_time == 3 * (m + p - 1) and one.busy == (3 * m,) * p
    assert one.rank_bubble == ((p - 1) / m,) * p and one.bubble == (p - 1) / m
    assert simulate(gpipe(p, m)).bubble == (p - 1) / m
    assert h1.step_time == 3 * m + p - 1 and h1.bubble == (p - 1) / (3 * m)
    assert h1.rank_bubble == ((p - 1) / (3 * m),) * p
    assert v.busy == (6 * m,) * p
    if m >= 2 * p - 1:
        assert v.step_time == 6 * m + p - 1 and v.bubble == (p - 1) / (6 * m)
    else:
        assert v.bubble > (p - 1) / (6 * m)


def test_costs_per_stage_and_transfer_time():
    """Two stages, one micro-batch: 0F0 [0, 1); the activation (4 bytes at 0.5 per byte) lands
    at 3; 1F0 [3, 4); 1B0 unsplit costs B + W = 2 + 1: [4, 7); the gradient lands at 9;
    0B0 [9, 12)."""
    r = simulate(one_f_one_b(2, 1), costs=Costs(F=1, B=2, W=1, per_byte=0.5, message_bytes=4))
    assert r.times == {Action.parse("0F0"): (0, 1), Action.parse("1F0"): (3, 4),
                       Action.parse("1B0"): (4, 7), Action.parse("0B0"): (9, 12)}
    assert r.step_time == 12 and r.busy == (4, 4) and r.bubble == 2.0
    # per-stage costs; a split backward costs B, then W
    r = simulate(zb_h1(2, 1), costs=Costs(F=[1, 2], B={0: 1, 1: 3}, W=0.5))
    assert r.times == {Action.parse("0F0"): (0, 1), Action.parse("1F0"): (1, 3),
                       Action.parse("1B0"): (3, 6), Action.parse("1W0"): (6, 6.5),
                       Action.parse("0B0"): (6, 7), Action.parse("0W0"): (7, 7.5)}
    assert r.step_time == 7.5 and r.busy == (2.5, 5.5)
    assert r.rank_bubble == (5 / 2.5, 2 / 5.5) and r.bubble == 2.0
    # per link: only the 1 -> 2 link of three stages is slow (3 per byte, 2 bytes: 6 each way)
    r = simulate(one_f_one_b(3, 1), costs=Costs(per_byte={(0, 1): 0, (2, 1): 3}, message_bytes=2))
    assert [r.times[Action.parse(t)] for t in ("0F0", "1F0", "2F0", "2B0", "1B0", "0B0")] == [
        (0, 1), (1, 2), (8, 9), (9, 11), (17, 19), (19, 21)]
    with pytest.raises(ValueError, match="no link between ranks 1 and 2"):
        simulate(one_f_one_b(3, 1), costs=Costs(per_byte={(0, 1): 1}))
    # sends between stages on one rank (ZB-V's turn at the last rank) are free
    free = simulate(zb_v(2, 3), costs=Costs(per_byte=1.0, message_bytes={0: 0, 1: 5, 2: 0, 3: 0}))
    assert free.step_time == simulate(zb_v(2, 3)).step_time


def test_costs_are_checked_and_deadlocks_have_no_time():
    for costs, match in [(Costs(F=-1), "non-negative numbers"), (Costs(B=[1, 2]), "needs 4 entries"),
                         (Costs(W={0: 1}), "lacks stages"), (Costs(per_byte=-0.1), "per_byte"),
                         (Costs(per_byte={(0, 1): -1}), "per_byte"),
                         (Costs(message_bytes=1.5), "non-negative ints")]:
        with pytest.raises(ValueError, match=match):
            simulate(one_f_one_b(4, 4), costs=costs)
    broken = edit(one_f_one_b(2, 2), 1, {1: "1B0", 2: "1F0"})
    r = simulate(broken)
    assert r.step_time is None and r.bubble is None and r.times is None and not r.ok


@pytest.mark.parametrize("make", [gpipe, one_f_one_b, zb_h1, zb_v, dualpipe_v])
def test_ranks_sharing_compute(make):
    """`Costs.parallel`: with a device per rank (or more) nothing changes; with one device's worth
    for all ranks the actions are serialized, and with no transfer time something is always
    ready, so the step takes exactly the total work; in between it lies between the two."""
    s = make(4, 8)
    alone = simulate(s, costs=Costs(F=1.0, B=2.0, W=1.5))
    total = sum(alone.busy)
    assert simulate(s, costs=Costs(F=1.0, B=2.0, W=1.5, parallel=4)).step_time == \
        pytest.approx(alone.step_time)
    assert simulate(s, costs=Costs(F=1.0, B=2.0, W=1.5, parallel=1)).step_time == \
        pytest.approx(total)
    two = simulate(s, costs=Costs(F=1.0, B=2.0, W=1.5, parallel=2)).step_time
    assert max(alone.step_time, total / 2) - 1e-9 <= two <= total + 1e-9
    # a transfer on the critical path leaves the shared devices idle while it is on the wire
    slow = Costs(F=1.0, B=2.0, W=1.5, parallel=1, per_byte=1.0, message_bytes=3)
    assert simulate(s, costs=slow).step_time > total


def test_parallel_is_checked():
    for bad in (0, -1, True, "2"):
        with pytest.raises(ValueError, match="Costs.parallel"):
            simulate(gpipe(2, 2), costs=Costs(parallel=bad))
