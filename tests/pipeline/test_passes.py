"""BPipe evict/load pass (Algorithm 2 and the Belady form) and the SEND/RECV pass."""
import itertools
import math

import pytest

from terra.pipeline import EVICT, RECV, SEND, Action, Schedule, simulate
from terra.pipeline.passes import (Infeasible, add_evict_load, add_send_recv, algorithm2, belady,
                                   items, mu_opt, pairs)
from terra.pipeline.schedules import chimera, gpipe, interleaved_1f1b, kfkb, one_f_one_b
from terra.pipeline.validate import problems
from tests.pipeline.test_schedules import (CHIMERA_CASES, INTERLEAVED_CASES, KFKB_CASES,
                                           PLAIN_CASES)


def transfers_of(s, rank):
    return {t: [str(x) for x in cell] for t, cell in enumerate(s.transfers[rank]) if cell}


# ---------------------------------------------------------------------------- Figure 4.2 case
def test_figure_4_2_transfer_schedule():
    """p=4, m=8 (BPipe Figure 4.2 and the text around Algorithm 2): stage 0 evicts micro-batch 1
    while computing F2 (the latest saved one, not micro-batch 0), evicts 3 and 5 in the steady
    phase one step before loading 1 and 3, loads 5 in the cooldown bubble without another
    eviction; stages 1 and 2 transfer nothing; mu(0) becomes 3."""
    s = add_evict_load(one_f_one_b(4, 8))
    assert s.name == "bpipe(mu=3, 1f1b)"
    assert transfers_of(s, 0) == {2: ["0EV1>3"], 7: ["0EV3>3"], 8: ["0LD1<3"],
                                  11: ["0EV5>3"], 12: ["0LD3<3"], 16: ["0LD5<3"]}
    row = s.compute[0]
    assert (row[2], row[7], row[8], row[11], row[12], row[16]) == tuple(
        Action.parse(t) if t != "." else None for t in ("0F2", "0B0", "0F4", "0B2", "0F6", "."))
    # evicting 3 and loading 1 span one BACKWARD-FORWARD pair (B0 at step 7, F4 at step 8)
    assert all(not s.transfers[r][t] for r in (1, 2, 3) for t in range(s.steps))
    r = simulate(s)
    assert r.peak_microbatches == (3, 3, 2, 3)
    assert r.peak_accepted == (0, 0, 0, 2)
    assert r.evictions == r.loads == 3
    assert r.held[0] == (1, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 1, 1)
    assert r.violations == ()


def test_algorithm2_raw_plan_figure_4_2():
    plan = algorithm2(list(one_f_one_b(4, 8).compute[0]), p=4, s=0, m=8)
    assert plan == {2: [("evict", 1)], 7: [("evict", 3)], 8: [("load", 1)],
                    11: [("evict", 5)], 12: [("load", 3)], 16: [("load", 5)]}
    assert algorithm2(list(one_f_one_b(4, 8).compute[1]), p=4, s=1, m=8) == {}


# ------------------------------------------------------------------------------ memory bounds
@pytest.mark.parametrize("p,m", PLAIN_CASES)
def test_bpipe_1f1b(p, m):
    base = one_f_one_b(p, m)
    s = add_evict_load(base)
    mu = math.ceil((p + 2) / 2)
    r = simulate(s)
    assert r.violations == ()
    assert max(r.peak_microbatches) <= mu
    for e, a in pairs(p):
        # evictors reach min(p-s, m) capped at mu; only s <= floor((p-4)/2) transfers at all
        assert r.peak_microbatches[e] == min(p - e, m, mu)
        moved = any(x.kind is EVICT for cell in s.transfers[e] for x in cell)
        assert moved == (min(p - e, m) > mu)
        if moved:
            assert e <= (p - 4) // 2
        # the acceptor holds at most (p - s) - mu + 1 of the evictor's micro-batches at once
        assert r.peak_accepted[a] <= max(0, (p - e) - mu + 1)
    # Algorithm 2 and the Belady form produce the same transfers on 1F1B
    assert add_evict_load(base, method="belady").transfers == s.transfers
    assert add_evict_load(base, method="algorithm2").transfers == s.transfers
    assert s.compute == base.compute


@pytest.mark.parametrize("p,m,v", INTERLEAVED_CASES)
def test_bpipe_interleaved(p, m, v):
    s = add_evict_load(interleaved_1f1b(p, m, v))
    r = simulate(s)
    assert r.violations == ()
    assert max(r.peak_microbatches) <= p * v + 1
    if m >= 2 * p:  # full warm-up: mu_opt is exactly p v + 1 (BPipe appendix A)
        assert mu_opt(interleaved_1f1b(p, m, v)) == p * v + 1
        for e, _ in pairs(p):
            first_b = next(t for t, a in enumerate(s.compute[e]) if a is not None and a.kind.value == "B")
            warm = sum(x.kind is EVICT for cell in s.transfers[e][:first_b] for x in cell)
            assert warm == max(0, p - 2 * (e + 1)), (e, warm)


@pytest.mark.parametrize("p,m,k", KFKB_CASES)
def test_bpipe_kfkb(p, m, k):
    base = kfkb(p, m, k)
    s = add_evict_load(base)
    r = simulate(s)
    cap = int(s.name.split("mu=")[1].split(",")[0])
    assert r.violations == ()
    assert max(r.peak_microbatches) <= cap
    assert mu_opt(base) <= cap <= mu_opt(base) + (k % 2)  # odd k may need one more slot


def test_kfkb_capacity_raised_where_needed():
    s = add_evict_load(kfkb(6, 24, 3))
    assert mu_opt(kfkb(6, 24, 3)) == 11 and s.name.startswith("bpipe(mu=12,")
    with pytest.raises(Infeasible, match="cannot stay within 11"):
        add_evict_load(kfkb(6, 24, 3), capacity=11)


@pytest.mark.parametrize("p,m", CHIMERA_CASES)
def test_bpipe_chimera_needs_nothing(p, m):
    """Chimera is balanced already: paired ranks mirror each other, so their peaks sum to
    2 x and mu_opt = ceil((2 x + 1) / 2) = x + 1 is above every peak; nothing moves."""
    base = chimera(p, m)
    s = add_evict_load(base)
    assert not s.has_transfers
    assert max(simulate(s).peak_microbatches) == p == mu_opt(base) - 1


def test_gpipe_unchanged():
    s = add_evict_load(gpipe(4, 8))
    assert not s.has_transfers and s.name == "bpipe(mu=9, gpipe)"
    # every rank of GPipe holds all m micro-batches: no partner has room
    with pytest.raises(Infeasible, match="without rank 3 exceeding 6"):
        add_evict_load(gpipe(4, 8), capacity=6)


def test_explicit_capacity_trades_memory_for_transfers():
    base = one_f_one_b(8, 16)
    runs = {cap: simulate(add_evict_load(base, capacity=cap)) for cap in (5, 6, 7, 8)}
    for cap, r in runs.items():
        assert r.violations == () and max(r.peak_microbatches) <= cap
    counts = [runs[cap].evictions for cap in (5, 6, 7, 8)]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 0 and counts[0] > counts[1]
    assert add_evict_load(base, capacity=5).transfers == add_evict_load(base).transfers


def test_pass_rejects():
    s = add_evict_load(one_f_one_b(4, 8))
    with pytest.raises(ValueError, match="already has EVICT/LOAD"):
        add_evict_load(s)
    with pytest.raises(ValueError, match="Algorithm 2 applies"):
        add_evict_load(interleaved_1f1b(4, 8, 2), method="algorithm2")
    with pytest.raises(ValueError, match="method"):
        add_evict_load(one_f_one_b(4, 8), method="lru")
    with pytest.raises(ValueError, match="capacity"):
        add_evict_load(one_f_one_b(4, 8), capacity=0)


def test_pairs():
    assert pairs(4) == [(0, 3), (1, 2)]
    assert pairs(5) == [(0, 4), (1, 3)]
    assert pairs(1) == []
    with pytest.raises(ValueError):
        pairs(0)


# ------------------------------------------------------------------- brute-force optimality
def brute_force_min_evictions(schedule, rank, capacity):
    """Fewest micro-batches to evict from ``rank`` so that it never holds more than ``capacity``.

    An evicted micro-batch is away at best from two steps after its forward (evicted in the
    step after the forward) to two steps before its backward (loaded in the step before it);
    widest windows are always best for the evictor, so trying every subset in increasing size
    is exhaustive."""
    spans = items(schedule, rank)
    keys = [k for k, (f, b, _) in spans.items() if b - f >= 4]  # others can never be away
    base = [0] * schedule.steps
    for f, _, end in spans.values():
        for t in range(f, end + 1):
            base[t] += 1
    if max(base) <= capacity:
        return 0
    for n in range(1, len(keys) + 1):
        for subset in itertools.combinations(keys, n):
            counts = list(base)
            for k in subset:
                f, b, _ = spans[k]
                for t in range(f + 2, b - 1):
                    counts[t] -= 1
            if max(counts) <= capacity:
                return n
    return None


BRUTE_CASES = ([("1f1b", p, m, None) for p in (4, 5, 6) for m in (p, p + 1, p + 3)]
               + [("interleaved", 4, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 3),
                  ("kfkb", 4, 8, 2), ("kfkb", 6, 12, 2), ("1f1b", 8, 10, None)])


@pytest.mark.parametrize("kind,p,m,extra", BRUTE_CASES)
def test_evictions_are_minimal(kind, p, m, extra):
    make = {"1f1b": lambda: one_f_one_b(p, m), "interleaved": lambda: interleaved_1f1b(p, m, extra),
            "kfkb": lambda: kfkb(p, m, extra)}[kind]
    base = make()
    capacity = mu_opt(base)
    s = add_evict_load(base, capacity=capacity)
    for e, _ in pairs(p):
        got = sum(x.kind is EVICT for cell in s.transfers[e] for x in cell)
        assert got == brute_force_min_evictions(base, e, capacity), (kind, p, m, e)
    assert simulate(s).violations == ()


def test_belady_evicts_furthest_next_use():
    base = one_f_one_b(6, 12)  # mu_opt = 4; stage 0 holds 6 in warm-up
    plan = belady(base, 0, 4)
    warm = [key for t, todo in sorted(plan.items()) for kind, key in todo if kind == "evict"][:2]
    assert warm == [(0, 2), (0, 3)]  # the latest saved micro-batches, needed last


# --------------------------------------------------------------------------------- send/recv
@pytest.mark.parametrize("make", [lambda: one_f_one_b(4, 8), lambda: interleaved_1f1b(2, 4, 2),
                                  lambda: chimera(4, 8), lambda: kfkb(3, 6, 2),
                                  lambda: add_evict_load(one_f_one_b(6, 12))])
def test_send_recv(make):
    base = make()
    s = add_send_recv(base)
    assert problems(s) == []
    sends = [(r, t, x) for r, t, x in s.actions() if x.kind is SEND]
    recvs = [(r, t, x) for r, t, x in s.actions() if x.kind is RECV]
    assert len(sends) == len(recvs) == 2 * base.m * (base.pipe_depth - 1)
    for r, t, x in sends:
        assert base.rank_of(x.stage) == r and x.peer in (x.stage - 1, x.stage + 1)
    assert Schedule.from_csv(s.to_csv()) == s
    with pytest.raises(ValueError, match="already has SEND/RECV"):
        add_send_recv(s)


def test_send_recv_exact_for_two_stages():
    s = add_send_recv(one_f_one_b(2, 2))
    assert transfers_of(s, 0) == {0: ["0S0>1"], 1: ["0S1>1"], 3: ["0R0<1"], 5: ["0R1<1"]}
    assert transfers_of(s, 1) == {1: ["1R0<0"], 2: ["1S0>0"], 3: ["1R1<0"], 4: ["1S1>0"]}
    assert [x.payload for x in s.transfers[0][0] + s.transfers[0][3]] == ["activation", "gradient"]


@pytest.mark.slow
def test_exhaustive_sweep():
    """Every p in 2..16 and m in p..4p: all generators valid, BPipe within mu_opt everywhere,
    Algorithm 2 == Belady on 1F1B (1-2 minutes)."""
    for p in range(2, 17):
        for m in range(p, 4 * p + 1):
            base = one_f_one_b(p, m)
            s = add_evict_load(base)
            assert s.transfers == add_evict_load(base, method="belady").transfers
            r = simulate(s)
            assert r.violations == () and max(r.peak_microbatches) <= math.ceil((p + 2) / 2)
            assert simulate(gpipe(p, m)).violations == ()
            for k in range(1, m + 1):
                if m % k == 0:
                    s = add_evict_load(kfkb(p, m, k))
                    cap = int(s.name.split("mu=")[1].split(",")[0])
                    r = simulate(s)
                    assert r.violations == () and max(r.peak_microbatches) <= cap
            if m % p == 0:
                for v in (2, 3):
                    r = simulate(add_evict_load(interleaved_1f1b(p, m, v)))
                    assert r.violations == () and max(r.peak_microbatches) <= p * v + 1
                if p % 2 == 0:
                    assert simulate(add_evict_load(chimera(p, m))).violations == ()
