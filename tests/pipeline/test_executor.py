"""PipelineTrainer equals single-device training for every schedule, with and without BPipe."""
import keras
import numpy as np
import pytest

from terra.pipeline import executor as ex
from terra.pipeline import stage as st
from terra.pipeline.actions import EVICT, LOAD
from tests.pipeline._model import batch, logical_cpus, max_err, reference

TOL = 1e-5
LR = 1e-3


def _run(p, schedule, balance, m=8, **options):
    devices = logical_cpus(p)
    plan = schedule if not isinstance(schedule, str) else ex.make_schedule(schedule, p, m, **options)
    nparts = plan.pipe_depth
    parts = st.tiny_gpt(nparts, devices=[devices[plan.stage_ranks[k]] for k in range(nparts)])
    replicas = (st.tiny_gpt(nparts, devices=[devices[p - 1 - k] for k in range(nparts)])
                if schedule == "chimera" else None)
    x, y = batch(2 * m)
    ref_loss, ref_grads, ref_weights, variables = reference(parts, x, y, keras.optimizers.Adam(LR))
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(LR), devices=devices,
                                 schedule=schedule, balance=balance, microbatches=m,
                                 replica_stages=replicas, **options)
    try:
        loss = trainer.step(x, y)
        grads = [g for part in trainer.last_gradients for g in part]
        assert loss == pytest.approx(ref_loss, abs=TOL)
        assert max_err(grads, ref_grads) < TOL
        assert max_err([v.numpy() for v in variables], ref_weights) < TOL
        if replicas is not None:  # both replicas took the same update
            rvars = [v for part in replicas for v in st.trainable_variables(part)]
            assert max_err([v.numpy() for v in rvars], ref_weights) < TOL
    finally:
        trainer.close()
    return trainer


CASES = [("1f1b", {}), ("gpipe", {}), ("interleaved", {"v": 2}), ("kfkb", {"k": 2}), ("chimera", {}),
         ("zb-h1", {}), ("zb-v", {}), ("dualpipe-v", {})]
# The default suite runs each schedule once (BPipe where it moves something); the rest is slow.
# BPipe moves nothing on ZB-H1 and ZB-V: every rank already holds p micro-batches at its peak.
DEFAULT = {("gpipe", None), ("interleaved", "bpipe"), ("kfkb", "bpipe"), ("chimera", "bpipe"),
           ("zb-h1", None), ("zb-v", None), ("dualpipe-v", None)}


def _four(schedule, options, balance):
    trainer = _run(4, schedule, balance, **options)
    moves = sum(1 for _, _, a in trainer.schedule.actions() if a.kind in (EVICT, LOAD))
    if balance == "bpipe" and schedule in ("1f1b", "interleaved", "kfkb"):
        assert moves > 0, "BPipe should move activations on 4 stages"
    if balance is None:
        assert moves == 0
    split = schedule.startswith("zb") or schedule == "dualpipe-v"
    assert all((part.program._split is not None) == split for part in trainer.parts)
    if split and balance is None:  # packs live until their W: p per rank at the peak
        peak = {"zb-v": 8, "dualpipe-v": 9}.get(schedule, 4)   # V: 2p (+1) half-size stages
        assert [r["peak_packs"] for r in trainer.memory_report()] == [peak] * 4
    return trainer


@pytest.mark.parametrize("schedule,options,balance", [
    pytest.param(s, o, b, id=f"{s}-{b}", marks=() if (s, b) in DEFAULT else pytest.mark.slow)
    for s, o in CASES if s != "1f1b" for b in (None, "bpipe")])
def test_four_stages_match_single_device(schedule, options, balance):
    _four(schedule, options, balance)


def test_1f1b_with_and_without_bpipe_match_and_bpipe_cuts_first_stage_peak():
    base = _four("1f1b", {}, None)
    bpipe = _four("1f1b", {}, "bpipe")
    p, mu_opt = 4, 3
    assert base.memory_report()[0]["peak_packs"] == p
    report = bpipe.memory_report()
    assert report[0]["peak_packs"] == mu_opt
    assert report[0]["peak_activation"] == mu_opt * bpipe.pack_bytes[0]
    assert all(r["peak_packs"] <= mu_opt for r in report)
    assert report[3]["accepted_packs"] == 0 and report[0]["held_packs"] == 0  # all returned


def test_split_backward_with_evict_load_matches_and_w_keeps_the_pack():
    """1F1B with each backward split in place (W right after B) keeps 1F1B's imbalance, so
    BPipe moves packs; a pack evicted and loaded back serves both its B and its W."""
    from terra.pipeline import Action, W, add_evict_load, simulate
    from terra.pipeline.schedules import from_orders, one_f_one_b
    plain = one_f_one_b(4, 8)
    orders = [[x for a in plain.compute_order(r)
               for x in ((a, Action(a.stage, W, a.microbatch)) if a.kind.name == "B" else (a,))]
              for r in range(4)]
    split = from_orders("1f1b-split", 4, 8, orders, stage_ranks=range(4), pipe_depth=4)
    schedule = add_evict_load(split)
    assert sum(1 for _, _, a in schedule.actions() if a.kind is EVICT) == 3
    trainer = _run(4, schedule, None)
    assert all(part.program._split is not None for part in trainer.parts)
    report = trainer.memory_report()
    assert [r["peak_packs"] for r in report] == list(simulate(schedule).peak_microbatches) == [3, 3, 2, 3]
    assert all(r["held_packs"] == r["accepted_packs"] == 0 for r in report)


@pytest.mark.slow
@pytest.mark.parametrize("balance", [None, "bpipe"])
@pytest.mark.parametrize("schedule,options", CASES, ids=[c[0] for c in CASES])
def test_eight_stages_match_single_device(schedule, options, balance):
    _run(8, schedule, balance, m=8, **options)


def test_eight_stage_bpipe_1f1b_matches_and_balances():
    trainer = _run(8, "1f1b", "bpipe")
    report = trainer.memory_report()
    assert report[0]["peak_packs"] == 5  # ceil((8 + 2) / 2)
    assert max(r["peak_packs"] for r in report) == 5


def test_several_steps_track_single_device_training():
    devices = logical_cpus(4)
    parts = st.tiny_gpt(4, devices=devices)
    variables = [v for part in parts for v in st.trainable_variables(part)]
    init = [v.numpy() for v in variables]
    ref_opt = keras.optimizers.Adam(LR)
    ref_losses = []
    for i in range(3):
        x, y = batch(8, seed=i)
        loss, _, updated, _ = reference(parts, x, y, ref_opt)
        ref_losses.append(loss)
        for v, w in zip(variables, updated):
            v.assign(w)
    ref_final = [v.numpy() for v in variables]
    for v, w in zip(variables, init):
        v.assign(w)
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(LR), devices=devices,
                                 schedule="1f1b", balance="bpipe", microbatches=4)
    losses = [trainer.step(*batch(8, seed=i)) for i in range(3)]
    trainer.close()
    np.testing.assert_allclose(losses, ref_losses, atol=TOL)
    assert max_err([v.numpy() for v in variables], ref_final) < TOL


def test_bad_inputs_raise_clear_errors():
    devices = logical_cpus(2)
    parts = st.tiny_gpt(2, devices=devices)
    opt = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        ex.PipelineTrainer(parts, opt, devices=devices, schedule="zigzag")
    with pytest.raises(ValueError, match="balance"):
        ex.PipelineTrainer(parts, opt, devices=devices, balance="even")
    with pytest.raises(ValueError, match="needs 2 model parts, got 1"):
        ex.PipelineTrainer(parts[:1], opt, devices=devices)
    with pytest.raises(ValueError, match="replica_stages"):
        ex.PipelineTrainer(parts, opt, devices=devices, schedule="chimera", microbatches=2)
    with pytest.raises(TypeError, match="optimizer_factory"):
        ex.PipelineTrainer(parts, None, devices=devices)
    trainer = ex.PipelineTrainer(parts, opt, devices=devices, microbatches=4)
    with pytest.raises(ValueError, match="multiple of microbatches=4"):
        trainer.step(*batch(6))
    trainer.close()


def test_bad_placement_options_and_schedules_are_rejected_before_running():
    from terra.pipeline import Action, B, F, Schedule
    devices = logical_cpus(2)
    parts = st.tiny_gpt(2, devices=devices)
    opt = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    with pytest.raises(ValueError, match=r"device '/device:GPU:7' does not exist"):
        ex.PipelineTrainer(parts, opt, devices=[devices[0], "/device:GPU:7"])
    with pytest.raises(ValueError, match=r"'/job:nowhere/task:0/device:CPU:0' does not exist"):
        ex.PipelineTrainer(parts, opt, devices=[devices[0], "/job:nowhere/task:0/device:CPU:0"])
    with pytest.raises(ValueError, match=r"device 'CPU-1' is not a device name"):
        ex.PipelineTrainer(parts, opt, devices=[devices[0], "CPU-1"])
    swapped = st.tiny_gpt(2, devices=devices[::-1])
    with pytest.raises(ValueError, match=r"variable 'tok:0' is on '.*CPU:1', but the part\(s\) using it run on "
                                         r"\['/device:CPU:0'\]"):
        ex.PipelineTrainer(swapped, opt, devices=devices)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['kk'\] for schedule 'kfkb'; it takes \['k'\]"):
        ex.PipelineTrainer(parts, opt, devices=devices, schedule="kfkb", kk=2)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['v'\] for schedule '1f1b'; it takes none"):
        ex.PipelineTrainer(parts, opt, devices=devices, v=2)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['k'\]: options apply to a schedule name"):
        ex.PipelineTrainer(parts, opt, devices=devices, schedule=ex.make_schedule("1f1b", 2, 2),
                           microbatches=2, k=2)
    # Stage 1 runs its B before stage 0's F: each rank waits on the other forever.
    deadlock = Schedule(name="deadlock", p=2, m=1, stage_ranks=(0, 1), pipe_depth=2, compute=(
        (Action(0, B, 0), Action(0, F, 0)), (Action(1, F, 0), Action(1, B, 0))))
    with pytest.raises(ex.ScheduleError, match="deadlock"):
        ex.PipelineTrainer(parts, opt, devices=devices, schedule=deadlock, microbatches=1)


def test_a_failing_stage_aborts_every_rank_quickly():
    devices = logical_cpus(2)
    parts = st.tiny_gpt(2, devices=devices)
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.SGD(0.1), devices=devices,
                                 microbatches=2, timeout=30)
    trainer.step(*batch(4))
    original = trainer.parts[1].program.forward

    def broken(*args):
        raise FloatingPointError("stage 1 blew up")
    trainer.parts[1].program.forward = broken
    with pytest.raises(FloatingPointError, match="stage 1 blew up"):
        trainer.step(*batch(4))
    trainer.parts[1].program.forward = original
    trainer.close()


def test_data_parallel_times_pipeline_matches_single_device():
    """4 stages x 2 data-parallel copies (MirroredStrategy per stage, ReductionToOneDevice)."""
    cpus = logical_cpus(8)
    devices = [[cpus[r], cpus[r + 4]] for r in range(4)]
    parts = st.tiny_gpt(4, devices=cpus[:4])
    copy = st.tiny_gpt(4, seed=5, devices=cpus[4:])       # other init: the trainer syncs it
    m = 4
    x, y = batch(2 * m * 2)
    ref_loss, ref_grads, ref_weights, variables = reference(parts, x, y, keras.optimizers.Adam(LR))
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(LR), devices=devices,
                                 schedule="1f1b", balance="bpipe", microbatches=m,
                                 data_parallel_stages=[copy])
    loss = trainer.step(x, y)
    trainer.close()
    assert loss == pytest.approx(ref_loss, abs=TOL)
    assert max_err([g for part in trainer.last_gradients for g in part], ref_grads) < TOL
    assert max_err([v.numpy() for v in variables], ref_weights) < TOL
    copy_vars = [v for part in copy for v in st.trainable_variables(part)]
    assert max_err([v.numpy() for v in copy_vars], ref_weights) < TOL
    assert trainer.memory_report()[0]["peak_packs"] == 3
    with pytest.raises(ValueError, match="same number of data-parallel devices"):
        ex.PipelineTrainer(parts, lambda: keras.optimizers.SGD(0.1), devices=[cpus[:2], cpus[2:3]])
    with pytest.raises(ValueError, match="need 1 more copies"):
        ex.PipelineTrainer(parts[:2], lambda: keras.optimizers.SGD(0.1), devices=[cpus[:2], cpus[2:4]])


def test_a_schedule_object_runs_as_given_and_unfinished_work_is_reported():
    from terra.pipeline import Action, F, Schedule
    from terra.pipeline.schedules import one_f_one_b
    devices = logical_cpus(2)
    parts = st.tiny_gpt(2, devices=devices)
    opt = lambda: keras.optimizers.SGD(0.1)  # noqa: E731
    ok = ex.PipelineTrainer(parts, opt, devices=devices, schedule=one_f_one_b(2, 2), microbatches=2)
    assert ok.schedule.name == "1f1b"
    ok.step(*batch(4), apply=False)
    ok.close()
    forward_only = Schedule(name="f-only", p=2, m=1, compute=((Action(0, F, 0), None), (None, Action(1, F, 0))),
                            stage_ranks=(0, 1), pipe_depth=2)
    # Rejected by the validator before anything runs (it used to run and report undone work).
    with pytest.raises(ex.ScheduleError, match=r"micro-batch 0 .*B") as info:
        ex.PipelineTrainer(parts, opt, devices=devices, schedule=forward_only, microbatches=1)
    assert info.value.problems
    with pytest.raises(ValueError, match="balance only with a schedule name"):
        ex.PipelineTrainer(parts, opt, devices=devices, schedule=forward_only, balance="bpipe", microbatches=1)


def test_the_last_steps_gradients_are_gone_while_the_next_step_runs():
    """`last_gradients` would be one more copy of every rank's weights beside the new step's
    accumulators: it is dropped when a step starts and set again when it ends."""
    devices = logical_cpus(2)
    seen = []
    trainer = None

    def delay(nbytes):  # called mid-step, for every message between the ranks
        seen.append(trainer.last_gradients is None)
        return 0.0

    trainer = ex.PipelineTrainer(st.tiny_gpt(2, devices=devices), lambda: keras.optimizers.SGD(0.1),
                                 devices=devices, schedule="1f1b", microbatches=2, link_delay=delay)
    try:
        x, y = batch(4)
        trainer.step(x, y)
        first = trainer.last_gradients
        assert first is not None and len(first) == 2
        trainer.step(x, y)
        assert trainer.last_gradients is not None and trainer.last_gradients is not first
    finally:
        trainer.close()
    assert seen and all(seen)
