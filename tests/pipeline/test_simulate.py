"""simulate: held micro-batches, accepted ones, bytes, text timeline and PNG plot."""
import math

import pytest

from terra.pipeline import Action, simulate
from terra.pipeline.passes import add_evict_load
from terra.pipeline.schedules import chimera, gpipe, interleaved_1f1b, one_f_one_b
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
