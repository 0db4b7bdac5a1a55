"""Byte ledger driven by the schedule: 1F1B imbalance, BPipe balance, allocator readers."""
import math
import os
import subprocess
import sys

import pytest

from terra.pipeline import add_evict_load, gpipe, interleaved_1f1b, one_f_one_b
from terra.pipeline import memory


@pytest.mark.parametrize("p", [4, 8])
def test_1f1b_ledger_peaks_are_p_minus_s_packs_and_bpipe_cuts_them_to_mu_opt(p):
    m, pack = 2 * p, 1000
    base = memory.schedule_ledger(one_f_one_b(p, m), [pack] * p).report()
    assert [r["peak_packs"] for r in base] == [p - s for s in range(p)]
    assert [r["peak_activation"] for r in base] == [pack * (p - s) for s in range(p)]
    mu_opt = math.ceil((p + 2) / 2)
    bal = memory.schedule_ledger(add_evict_load(one_f_one_b(p, m)), [pack] * p).report()
    assert bal[0]["peak_packs"] == mu_opt
    assert max(r["peak_packs"] for r in bal) == mu_opt
    assert all(r["held"] == 0 and r["accepted"] == 0 for r in bal)  # everything came back


def test_static_bytes_and_totals():
    led = memory.schedule_ledger(gpipe(2, 3), [10, 20],
                                 static=[{"weights": 100, "optimizer": 200}, {"weights": 1}])
    r0, r1 = led.report()
    assert r0["peak_packs"] == 3 and r0["peak_activation"] == 30 and r0["peak_total"] == 330
    assert r1["peak_activation"] == 60 and r1["total"] == 1


def test_interleaved_ledger_counts_both_chunks_on_a_rank():
    sch = interleaved_1f1b(2, 4, 2)
    led = memory.schedule_ledger(sch, [1] * sch.num_stages).report()
    assert sum(r["held_packs"] for r in led) == 0
    assert led[0]["peak_packs"] >= led[1]["peak_packs"]


def test_ledger_apply_and_errors():
    led = memory.Ledger(2)
    led.apply([(0, "held", 5, 1), (1, "accepted", 7, 1)])
    led.apply([(0, "held", -5, -1)])
    r = led.report()
    assert r[0]["peak_activation"] == 5 and r[0]["held"] == 0 and r[1]["peak_packs"] == 1
    from terra.pipeline.actions import Action, EVICT
    with pytest.raises(ValueError, match="peer"):
        memory.step_deltas(0, None, [Action(0, EVICT, 0)], (0, 1), [1, 1])


def test_allocator_info_is_none_without_stats():
    """In a fresh process: once tf.data has run (other tests, in this one), TF keeps CPU
    allocator statistics for the rest of the process."""
    code = ("from terra.pipeline import memory\n"
            "print(memory.allocator_info('/device:CPU:0'),"  # no BFC stats in this process
            " memory.allocator_info('/job:nowhere/device:CPU:0'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["None", "None"]


def test_what_a_split_b_leaves_for_its_w_is_held_from_b_through_w():
    """ZB-H1 defers Ws: the output and intermediate gradients each split B leaves stay on the
    rank until its W. The ledger's replay and the simulator count them alike."""
    from terra.pipeline.schedules import zb_h1
    from terra.pipeline.simulate import simulate
    p, m = 4, 8
    sch = zb_h1(p, m)
    packs, residuals = [1000] * p, [100, 200, 300, 400]
    without = memory.schedule_ledger(sch, packs).report()
    led = memory.schedule_ledger(sch, packs, residual_bytes=residuals).report()
    # By hand: per rank, the most (stage, micro-batch) pairs between a B and its W at one step.
    b_at, w_at = {}, {}
    for r, t, a in sch.actions():
        if a.kind.name == "B":
            b_at[(a.stage, a.microbatch)] = (r, t)
        elif a.kind.name == "W":
            w_at[(a.stage, a.microbatch)] = t
    pending = [max(sum(1 for k, (r2, b) in b_at.items() if r2 == r and b <= t <= w_at[k])
                   for t in range(sch.steps)) for r in range(p)]
    assert all(n >= 1 for n in pending)
    for r in range(p):
        assert led[r]["residual"] == 0 and led[r]["residual_packs"] == 0   # all released
        assert without[r]["peak_total"] < led[r]["peak_total"] <= without[r]["peak_total"] + pending[r] * residuals[r]
    sim = simulate(sch, act_bytes=packs, residual_bytes=residuals)
    assert list(sim.peak_bytes) == [r["peak_total"] for r in led]
    # Schedules that do not split backwards hold no residuals.
    plain = memory.schedule_ledger(one_f_one_b(p, m), packs, residual_bytes=residuals).report()
    assert [r["peak_total"] for r in plain] == [r["peak_total"] for r in memory.schedule_ledger(one_f_one_b(p, m), packs).report()]
