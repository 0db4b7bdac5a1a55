"""Standard vs pair-adjacent assignment of (data, pipeline, tensor) ranks to (node, gpu)."""
import pytest

from terra.pipeline.placement import pair_adjacent, pair_slot, standard


def stages_by_gpu(placement):
    return [[f"PP{s}" for _, s, _ in row] for row in placement.gpu_table()]


def test_figure_4_4_sixteen_stages_two_nodes():
    std, adj = standard(pipeline=16, gpus_per_node=8), pair_adjacent(pipeline=16, gpus_per_node=8)
    assert stages_by_gpu(std) == [[f"PP{s}" for s in range(8)], [f"PP{s}" for s in range(8, 16)]]
    assert std.intra_node_pairs == 0.0      # every pair straddles the two nodes
    assert [s for _, s, _ in adj.gpu_table()[0]] == [0, 15, 1, 14, 2, 13, 3, 12]
    assert [s for _, s, _ in adj.gpu_table()[1]] == [4, 11, 5, 10, 6, 9, 7, 8]
    assert adj.intra_node_pairs == 1.0


def test_figure_4_5_with_tensor_and_data_parallelism():
    """4-way pipeline, 2-way tensor, 2-way data on two 8-GPU nodes (BPipe Figure 4.5)."""
    adj = pair_adjacent(data=2, pipeline=4, tensor=2, gpus_per_node=8)
    table = adj.gpu_table()
    assert [(s, t) for _, s, t in table[0]] == [(0, 0), (0, 1), (3, 0), (3, 1),
                                                (1, 0), (1, 1), (2, 0), (2, 1)]
    assert {d for d, _, _ in table[0]} == {0} and {d for d, _, _ in table[1]} == {1}
    assert [(s, t) for _, s, t in table[1]] == [(s, t) for _, s, t in table[0]]
    assert adj.device(1, 3, 1) == (1, 3)
    assert adj.intra_node_pairs == 1.0
    std = standard(data=2, pipeline=4, tensor=2, gpus_per_node=8)
    assert [(s, t) for _, s, t in std.gpu_table()[0]] == [(s, t) for s in range(4) for t in range(2)]


@pytest.mark.parametrize("d,p,t,g", [(1, 8, 1, 4), (2, 8, 2, 8), (4, 6, 2, 4), (2, 5, 1, 2),
                                     (1, 4, 8, 8), (3, 4, 4, 16), (2, 16, 1, 8)])
def test_priorities_and_bijection(d, p, t, g):
    for place in (standard(d, p, t, g), pair_adjacent(d, p, t, g)):
        gpus = list(place.devices.values())
        assert len(set(gpus)) == d * p * t == len(gpus)            # one rank per GPU
        assert all(0 <= gpu < g for _, gpu in gpus)
        for dd in range(d):
            for s in range(p):
                nodes = {place.device(dd, s, tt)[0] for tt in range(t)}
                flat = sorted(place.device(dd, s, tt)[0] * g + place.device(dd, s, tt)[1]
                              for tt in range(t))
                assert flat == list(range(flat[0], flat[0] + t))   # tensor ranks contiguous
                if g % t == 0:
                    assert len(nodes) == 1                          # ... and inside one node
            # pipeline before data: one data replica is a contiguous block of p * t GPUs
            block = sorted(place.device(dd, s, tt)[0] * g + place.device(dd, s, tt)[1]
                           for s in range(p) for tt in range(t))
            assert block == list(range(dd * p * t, (dd + 1) * p * t))


@pytest.mark.parametrize("d,p,t,g,expect", [(1, 16, 1, 8, 1.0), (1, 8, 2, 8, 1.0),
                                            (1, 4, 8, 8, 0.0), (2, 6, 1, 4, 1.0),
                                            (1, 6, 1, 3, 2 / 3)])
def test_pair_adjacent_keeps_pairs_local(d, p, t, g, expect):
    assert pair_adjacent(d, p, t, g).intra_node_pairs == pytest.approx(expect)
    assert standard(d, p, t, g).intra_node_pairs <= pair_adjacent(d, p, t, g).intra_node_pairs


def test_odd_pipeline_middle_stage_last():
    assert [pair_slot(s, 5) for s in range(5)] == [0, 2, 4, 3, 1]


@pytest.mark.parametrize("args,match", [((1, 3, 1, 8), "fill whole nodes"),
                                        ((1, 8, 3, 8), "do not fill|tensor=3"),
                                        ((0, 4, 1, 4), "data must be a positive int"),
                                        ((1, 4, 1, True), "gpus_per_node")])
def test_bad_sizes(args, match):
    with pytest.raises(ValueError, match=match):
        pair_adjacent(*args)


def test_bad_sizes_tensor_straddles():
    with pytest.raises(ValueError, match="tensor=4 must divide gpus_per_node=6"):
        standard(1, 3, 4, 6)


def test_unknown_rank_and_text():
    place = pair_adjacent(1, 4, 1, 4)
    with pytest.raises(ValueError, match="no rank"):
        place.device(0, 4, 0)
    assert str(place).splitlines() == [
        "pair_adjacent: data=1 pipeline=4 tensor=1 gpus_per_node=4",
        "node 0: DP0/PP0/TP0 DP0/PP3/TP0 DP0/PP1/TP0 DP0/PP2/TP0"]
    assert repr(place) == "Placement(pair_adjacent, d=1, p=4, t=1, gpus_per_node=4)"


def test_rank_devices_puts_bpipe_pairs_on_one_host_and_the_trainer_refuses_split_pairs():
    from terra.pipeline import placement
    from terra.pipeline.executor import _check_pairs, make_schedule
    hosts = [f"/job:worker/replica:0/task:{t}/device:GPU:{g}" for t in range(2) for g in range(2)]
    ranks = placement.rank_devices(hosts, "bpipe")
    assert ranks == [hosts[0], hosts[2], hosts[3], hosts[1]]
    assert placement.split_pairs(ranks, [(0, 3), (1, 2)]) == []
    assert placement.split_pairs(hosts, [(0, 3), (1, 2)]) == [(0, 3), (1, 2)]
    assert placement.rank_devices(hosts) == hosts
    assert placement.host("/device:CPU:1") == placement.host("/job:localhost/replica:0/task:0/device:CPU:0")
    bpipe = make_schedule("1f1b", 4, 8, "bpipe")
    with pytest.raises(ValueError, match=r"BPipe pairs \(evictor, acceptor\) \[\(0, 3\)\] run on "
                                         r"different hosts.*leaves 0 of 1 pairs split"):  # 1F1B on 4: one pair moves
        _check_pairs(hosts, bpipe)
    _check_pairs(ranks, bpipe)
    _check_pairs(hosts, make_schedule("1f1b", 4, 8))             # no BPipe: nothing moves
    one_each = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(4)]
    _check_pairs(one_each, bpipe)                                  # no order does better
    with pytest.raises(ValueError, match="balance must be None or 'bpipe'"):
        placement.rank_devices(hosts, "even")
