"""Schedule generators: structure, dependencies, deadlock freedom and memory profiles.

The checks here are written independently of `terra.pipeline.validate` (which is exercised
in test_validate.py) so that a bug shared by a generator and the validator still shows up."""
import itertools

import pytest

from terra.pipeline import B, F, W, Action, Schedule
from terra.pipeline.passes import add_evict_load, live_counts
from terra.pipeline.schedules import (chimera, dualpipe_v, from_orders, gpipe, interleaved_1f1b,
                                      kfkb, one_f_one_b, zb_h1, zb_v)
from terra.pipeline.simulate import simulate
from terra.pipeline.validate import problems

PS = range(2, 17)


def m_values(p):
    return sorted({p, p + 1, 2 * p + 1, 3 * p, 4 * p})


def multiples(p):
    return [p, 2 * p, 4 * p] if p <= 6 else [p, 2 * p]


# A sample of p in 2..16, m in p..4p (every case runs in test_exhaustive_sweep, marked slow).
PLAIN_CASES = [(p, m) for p in PS for m in m_values(p)]
INTERLEAVED_CASES = [(p, m, v) for p in PS for m in multiples(p) for v in (2, 3)]
KFKB_CASES = sorted({(p, m, k) for p in PS for m in (2 * p, 3 * p + 3)
                     for k in (2, 3, m // 2, m) if m % k == 0})
CHIMERA_CASES = [(p, m) for p in range(2, 17, 2) for m in multiples(p)]


def check_invariants(s: Schedule):
    """Coverage, per-stage F-before-B(-before-W), stage dependencies, and deadlock-free replay."""
    where = {}
    for r in range(s.p):
        for t, a in enumerate(s.compute[r]):
            if a is None:
                continue
            assert a.kind in (F, B, W), a
            assert a not in where, f"{a} appears twice"
            assert s.stage_ranks[a.stage] == r, f"{a} on rank {r}"
            where[a] = t
    depth = s.pipe_depth
    for mb in range(s.m):
        pipes = {a.stage // depth for a in where if a.microbatch == mb}
        assert len(pipes) == 1, f"micro-batch {mb} in pipelines {pipes}"
        (pipe,) = pipes
        for stage in range(pipe * depth, (pipe + 1) * depth):
            f, b = where[Action(stage, F, mb)], where[Action(stage, B, mb)]
            assert f < b, f"stage {stage} mb {mb}: B at {b} not after F at {f}"
            if stage % depth:
                assert where[Action(stage - 1, F, mb)] < f
            if (stage + 1) % depth:
                assert where[Action(stage + 1, B, mb)] < b
            if Action(stage, W, mb) in where:
                assert where[Action(stage, W, mb)] > b
    weights = sum(1 for a in where if a.kind is W)
    assert weights <= s.m * depth   # each W belongs to a B (checked above); DualPipeV splits some
    assert len(where) == 2 * s.m * depth + weights
    # deadlock freedom without the clock: each rank blocks on its next action
    orders = [[a for a in s.compute[r] if a is not None] for r in range(s.p)]
    done, pos, moved = set(), [0] * s.p, True
    while moved:
        moved = False
        for r in range(s.p):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                deps = ([Action(a.stage, F, a.microbatch)] if a.kind is B else
                        [Action(a.stage, B, a.microbatch)] if a.kind is W else [])
                if a.kind is F and a.stage % depth:
                    deps.append(Action(a.stage - 1, F, a.microbatch))
                if a.kind is B and (a.stage + 1) % depth:
                    deps.append(Action(a.stage + 1, B, a.microbatch))
                if not all(d in done for d in deps):
                    break
                done.add(a)
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(orders[r]) for r in range(s.p)), "deadlock"
    assert problems(s) == []
    assert Schedule.from_csv(s.to_csv()) == s


def peaks(s):
    return [max(live_counts(s, r)) for r in range(s.p)]


@pytest.mark.parametrize("p,m", PLAIN_CASES)
def test_one_f_one_b(p, m):
    s = one_f_one_b(p, m)
    check_invariants(s)
    assert peaks(s) == [min(p - r, m) for r in range(p)]
    assert s.steps == 2 * (m + p - 1)  # unit F and B: 2m busy steps plus 2(p-1) of ramp


@pytest.mark.parametrize("p,m", PLAIN_CASES)
def test_gpipe(p, m):
    s = gpipe(p, m)
    check_invariants(s)
    assert peaks(s) == [m] * p
    for r in range(p):  # all forwards before any backward
        kinds = [a.kind for a in s.compute_order(r)]
        assert kinds == [F] * m + [B] * m


@pytest.mark.parametrize("p,m,v", INTERLEAVED_CASES)
def test_interleaved(p, m, v):
    s = interleaved_1f1b(p, m, v)
    check_invariants(s)
    assert s.num_stages == p * v and s.pipe_depth == p * v
    assert s.stages_of(1 % p) == tuple(c * p + 1 % p for c in range(v))
    # BPipe appendix A: p(v-1) + 2(p-r-1) + 1 chunk activations before the first backward
    assert peaks(s) == [min(p * (v - 1) + 2 * (p - r - 1) + 1, m * v) for r in range(p)]


def test_interleaved_needs_multiple_of_p():
    with pytest.raises(ValueError, match=r"multiple of p.*m=6, p=4"):
        interleaved_1f1b(4, 6, 2)


@pytest.mark.parametrize("p,m,k", KFKB_CASES)
def test_kfkb(p, m, k):
    s = kfkb(p, m, k)
    check_invariants(s)
    assert peaks(s) == [k * min(p - r, m // k) for r in range(p)]
    for r in range(p):  # runs of F and of B come in whole groups of k
        kinds = [a.kind for a in s.compute_order(r)]
        runs = [len(list(g)) for _, g in itertools.groupby(kinds)]
        assert all(n % k == 0 for n in runs), runs


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (5, 10), (7, 21), (16, 32)])
def test_kfkb_extremes(p, m):
    assert kfkb(p, m, 1).compute == one_f_one_b(p, m).compute
    assert kfkb(p, m, m).compute == gpipe(p, m).compute


def test_kfkb_needs_divisor():
    with pytest.raises(ValueError, match=r"multiple of k.*m=10, k=4"):
        kfkb(4, 10, 4)


@pytest.mark.parametrize("p,m", CHIMERA_CASES)
def test_chimera(p, m):
    s = chimera(p, m)
    check_invariants(s)
    assert s.num_stages == 2 * p and s.pipe_depth == p
    assert s.stage_ranks == tuple(range(p)) + tuple(reversed(range(p)))
    down = {a.microbatch for r in range(p) for a in s.compute_order(r) if a.stage < p}
    assert sorted(down) == [u * p + i for u in range(m // p) for i in range(p // 2)]
    # Chimera's activation memory: between (D/2 + 1) and D micro-batches per device
    got = peaks(s)
    assert got[0] == got[-1] == p // 2 + 1 and max(got) == p and got == got[::-1]


def test_chimera_unit_matches_paper_figure():
    """Per-device orders of the 4-stage basic unit in the Chimera paper's figure."""
    s = chimera(4, 4)
    text = [" ".join(f"{a.kind.value}{a.microbatch}" for a in s.compute_order(r)) for r in range(4)]
    assert text == ["F0 F1 F2 B2 F3 B3 B0 B1",
                    "F0 F2 F1 F3 B2 B0 B3 B1",
                    "F2 F0 F3 F1 B0 B2 B1 B3",
                    "F2 F3 F0 B0 F1 B1 B2 B3"]


@pytest.mark.parametrize("p,m,match", [(3, 6, "even"), (4, 6, "multiple of p")])
def test_chimera_rejects(p, m, match):
    with pytest.raises(ValueError, match=match):
        chimera(p, m)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p,m", [(0, 4), (4, 0), (2.0, 4), (True, 3)])
def test_bad_sizes(make, p, m):
    with pytest.raises(ValueError, match="positive int"):
        make(p, m)


def test_one_f_one_b_grid_matches_figure_4_2():
    """BPipe Figure 4.2: stage 0's 22 computation decisions, C_0 = F0, C_9 = B1, C_18 bubble."""
    s = one_f_one_b(4, 8)
    row = s.compute[0]
    assert len(row) == 22
    assert row[0] == Action(0, F, 0) and row[9] == Action(0, B, 1) and row[18] is None
    assert str(s).splitlines()[1] == (
        "r0   0F0 0F1 0F2 0F3   .   .   . 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4   . 0B5   . 0B6   . 0B7")


def test_schedule_views_and_repr():
    s = one_f_one_b(3, 3)
    assert repr(s) == "Schedule(1f1b, p=3, m=3, stages=3, steps=10)"
    assert s[2] == s.compute[2] and len(s) == 3
    assert s.next_stage(1) == 2 and s.next_stage(2) is None and s.prev_stage(0) is None
    c = chimera(4, 4)
    assert c.next_stage(3) is None and c.prev_stage(4) is None and c.next_stage(4) == 5


def test_csv_round_trip_text():
    s = one_f_one_b(2, 2)
    text = s.to_csv()
    assert text.splitlines()[:3] == [
        "# name=1f1b;p=2;m=2;v=1;pipe_depth=2;stage_ranks=0 1",
        "rank,lane,0,1,2,3,4,5",
        "0,compute,0F0,0F1,,0B0,,0B1",
    ]
    assert Schedule.from_csv(text) == s
    with pytest.raises(ValueError, match="metadata"):
        Schedule.from_csv("rank,lane\n")


def test_schedule_rejects_bad_cells():
    with pytest.raises(TypeError, match=r"compute\[0\]\[0\] must be an Action or None, got '0F0'"):
        Schedule("x", 1, 1, (("0F0",),), stage_ranks=(0,), pipe_depth=1)
    with pytest.raises(ValueError, match="one row per rank"):
        Schedule("x", 2, 1, ((None,),), stage_ranks=(0, 1), pipe_depth=2)
    with pytest.raises(ValueError, match="outside 0..0"):
        Schedule("x", 1, 1, ((None,),), stage_ranks=(0, 1), pipe_depth=1)
    with pytest.raises(ValueError, match="multiple of pipe_depth"):
        Schedule("x", 1, 1, ((None,),), stage_ranks=(0, 0, 0), pipe_depth=2)


@pytest.mark.parametrize("p,m", PLAIN_CASES)
def test_zb_h1(p, m):
    s = zb_h1(p, m)
    check_invariants(s)
    # every rank holds p micro-batches at its peak (1F1B's stage 0), none more
    assert peaks(s) == [p] * p
    assert s.steps == 3 * m + p - 1  # unit F, B, W: only the ramp of p - 1 steps is idle
    for r in range(p):
        order = s.compute_order(r)
        kinds = [a.kind for a in order]
        assert kinds[:p - r] == [F] * (p - r) and kinds[p - r] is B   # 1F1B's warm-up
        first_w = kinds.index(W)
        assert kinds[:first_w].count(B) == r + 1                      # stage r defers r Ws
        ws = [a.microbatch for a in order if a.kind is W]
        assert ws == list(range(m))


@pytest.mark.parametrize("p,m", PLAIN_CASES)
def test_zb_v(p, m):
    s = zb_v(p, m)
    check_invariants(s)
    assert s.num_stages == s.pipe_depth == 2 * p and s.v == 2
    assert s.stage_ranks == tuple(range(p)) + tuple(reversed(range(p)))
    assert all(s.stages_of(r) == (r, 2 * p - 1 - r) for r in range(p))
    if m >= 2 * p - 1:
        assert s.steps == 6 * m + p - 1
        assert peaks(s) == [2 * p] * p   # 2p half-size stages: 1F1B's stage-0 peak


def test_zb_v_rank_orders():
    """p = 2, m = 3, worked by hand from the phase rules in the module docstring: rank 0 warms
    up with 3 down Fs (2(p - r) - 1) and 2 up F-B-W triples; rank 1 with 1 down F, 1 down/up
    F pair and 1 up triple, and defers the Ws of its cool-down Bs to the tail."""
    s = zb_v(2, 3)
    text = [" ".join(map(str, s.compute_order(r))) for r in range(2)]
    assert text == ["0F0 0F1 0F2 3F0 3B0 3W0 3F1 3B1 3W1 0B0 0W0 3F2 3B2 3W2 0B1 0W1 0B2 0W2",
                    "1F0 2F0 1F1 2F1 2B0 2W0 1F2 1B0 1W0 2F2 2B1 2W1 1B1 2B2 1B2 1W1 2W2 1W2"]


@pytest.mark.parametrize("p,m", PLAIN_CASES)
def test_dualpipe_v(p, m):
    s = dualpipe_v(p, m)
    check_invariants(s)
    assert s.num_stages == s.pipe_depth == 2 * p and s.v == 2
    assert s.stage_ranks == tuple(range(p)) + tuple(reversed(range(p)))
    split = s.split
    if m >= 2 * p:
        assert peaks(s) == [2 * p + 1] * p        # one half-size stage above ZB-V
        assert s.steps == 4 * m + 2 * p - 1         # rank 0 never idles: 4m Fs and Bs, 2p-1 Ws
        assert simulate(s).step_time == 6 * m + p - 1   # ZB-V's time with F = B = W
        # only the ramps split: rank r defers 2p - r - 1 Ws, the rest are whole backwards
        for r in range(p):
            assert sum(1 for a in s.compute_order(r) if a.kind is W) == 2 * p - r - 1
        assert len(split) == sum(2 * p - r - 1 for r in range(p))


def test_dualpipe_v_rank_orders():
    """p = 2, m = 4, worked by hand from the reference's eight steps: rank 0 runs 2 down Fs, a
    down/up F pair, one up B (split) + its W + up F, the main step (F down, B up, F up, B down),
    B up + F up + B down, then B up, a split B down, a W, a split B down and the last W. Rank 1
    (the V's turn) pairs its forwards at once and splits only its last up and down Bs."""
    s = dualpipe_v(2, 4)
    text = [" ".join(map(str, s.compute_order(r))) for r in range(2)]
    assert text == ["0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0B2 0W2 0B3 0W3",
                    "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2B3 1B3 2W3 1W3"]


def test_dualpipe_v_below_its_reference_size():
    """The reference needs m >= 2p; below it the orders cut from the 2p one stay valid."""
    for p in range(1, 9):
        for m in range(1, 2 * p):
            check_invariants(dualpipe_v(p, m))


@pytest.mark.parametrize("make", [zb_h1, zb_v, dualpipe_v])
def test_zero_bubble_rejects_bad_sizes(make):
    with pytest.raises(ValueError, match="positive int"):
        make(4, 0)


def test_bpipe_on_zero_bubble_moves_nothing():
    """ZB-H1 and ZB-V hold p (ZB-V: 2p half stages) on every rank: balanced already, so
    mu_opt is one above every peak and the pass adds no transfer; below it, the partner is
    full too."""
    from terra.pipeline.passes import Infeasible
    for s in (zb_h1(4, 8), zb_v(4, 8), dualpipe_v(4, 8)):
        out = add_evict_load(s)
        assert not out.has_transfers and out.compute == s.compute
    assert add_evict_load(zb_h1(4, 8)).name == "bpipe(mu=5, zb-h1)"
    with pytest.raises(Infeasible, match="without rank 3 exceeding 3"):
        add_evict_load(zb_h1(4, 8), capacity=3)


@pytest.mark.slow
def test_zero_bubble_sweep():
    """Every p in 2..16 and m in p..4p: ZB-H1 and ZB-V valid, with their step counts, peaks,
    BPipe's pass a valid no-op, and CSV round trips."""
    from terra.pipeline.validate import problems as check
    for p in range(2, 17):
        for m in range(p, 4 * p + 1):
            h1, v, dp = zb_h1(p, m), zb_v(p, m), dualpipe_v(p, m)
            check_invariants(h1)
            check_invariants(v)
            check_invariants(dp)
            if m >= 2 * p:
                assert dp.steps == 4 * m + 2 * p - 1 and peaks(dp) == [2 * p + 1] * p
            assert h1.steps == 3 * m + p - 1 and peaks(h1) == [p] * p
            if m >= 2 * p - 1:
                assert v.steps == 6 * m + p - 1 and peaks(v) == [2 * p] * p
            for s in (h1, v, dp):
                out = add_evict_load(s)
                assert not out.has_transfers and check(out) == []


def test_from_orders_reports_deadlock():
    orders = [[Action(0, F, 0), Action(0, B, 0), Action(0, F, 1), Action(0, B, 1)],
              [Action(1, F, 1), Action(1, B, 1), Action(1, F, 0), Action(1, B, 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        from_orders("bad", 2, 2, orders, stage_ranks=[0, 1], pipe_depth=2)
