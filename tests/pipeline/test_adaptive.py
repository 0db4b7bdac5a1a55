"""Ada-Grouper on the executor: switching k of kFkB between steps keeps training equal to one
device; injected link delays hold messages back; the adaptive trainer's set-up leaves the model
as it was."""
import time

import keras
import numpy as np
import pytest

from terra.pipeline import executor as ex
from terra.pipeline import stage as st
from terra.pipeline import transport
from terra.pipeline.adaptive import AdaptiveKFKB
from terra.pipeline.schedules import kfkb, one_f_one_b
from tests.pipeline._model import batch, logical_cpus, max_err

TOL = 1e-5


def _snapshot(parts):
    return [v.numpy() for part in parts for v in st.trainable_variables(part)]


def test_switching_k_between_steps_trains_like_one_device():
    """Three steps, each with another kFkB plan (another k and micro-batch count): the same as
    three steps of the same plan, since every plan accumulates the same batch's gradient."""
    devices = logical_cpus(2)
    x, y = batch(16)
    runs = []
    for plans in ([kfkb(2, 2, 1), kfkb(2, 4, 4), kfkb(2, 8, 2)], [kfkb(2, 2, 1)] * 3):
        parts = st.tiny_gpt(2, devices=devices)
        trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(1e-2), devices=devices,
                                     schedule=plans[0], microbatches=2)
        try:
            losses = []
            for plan in plans:
                trainer.set_schedule(plan)
                assert trainer.m == plan.m
                losses.append(trainer.step(x, y))
        finally:
            trainer.close()
        runs.append((losses, _snapshot(parts)))
    (l1, v1), (l2, v2) = runs
    assert l1 == pytest.approx(l2, abs=TOL)
    assert max_err(v1, v2) < TOL


def test_set_schedule_refuses_another_placement():
    devices = logical_cpus(4)
    trainer = ex.PipelineTrainer(st.tiny_gpt(4, devices=devices), lambda: keras.optimizers.SGD(0.1),
                                 devices=devices, schedule="1f1b", microbatches=4)
    try:
        with pytest.raises(ValueError, match="places parts differently"):
            trainer.set_schedule(one_f_one_b(2, 4))
    finally:
        trainer.close()


def test_a_delayed_message_arrives_no_earlier_than_its_delay():
    box = transport.Mailbox(timeout=30)
    start = time.monotonic()
    box.put("a", 1, delay=0.2)
    box.put("b", 2)
    assert box.get("b") == 2
    assert box.get("a") == 1
    assert time.monotonic() - start >= 0.2
    box.put("c", 3, delay=60)
    box.abort("stop")
    with pytest.raises(transport.PipelineAborted):
        box.get("c")


def test_link_delay_counts_bytes_between_ranks_only():
    devices = logical_cpus(2)
    seen = []
    trainer = ex.PipelineTrainer(st.tiny_gpt(2, devices=devices), lambda: keras.optimizers.SGD(0.1),
                                 devices=devices, schedule="1f1b", microbatches=2,
                                 link_delay=lambda n: seen.append(n) or 0.0)
    try:
        trainer.step(*batch(4))
    finally:
        trainer.close()
    # One activation forward and one gradient back per micro-batch: (2, 16, 32) float32 each.
    assert sorted(seen) == [2 * 16 * 32 * 4] * 4


def test_a_step_measures_the_timed_links_per_byte():
    devices = logical_cpus(2)
    runs = {}
    for name, delay in (("none", None), ("zero", lambda n: 0.0), ("slow", lambda n: n * 2e-9)):
        trainer = ex.PipelineTrainer(st.tiny_gpt(2, devices=devices), lambda: keras.optimizers.SGD(0.1),
                                     devices=devices, schedule="1f1b", microbatches=2, link_delay=delay)
        try:
            assert trainer.link_per_byte is None
            trainer.step(*batch(4))
            runs[name] = trainer.link_per_byte
        finally:
            trainer.close()
    assert runs["none"] is None          # no timed link: nothing measured
    assert runs["zero"] == 0.0           # a link that takes no time is measured as such
    assert runs["slow"] == pytest.approx(2e-9, rel=1e-9)


def test_adaptive_set_up_measures_every_candidate_and_leaves_the_model_as_it_was():
    devices = logical_cpus(4)
    parts = st.tiny_gpt(4, devices=devices)
    x, y = batch(16)
    before = _snapshot(parts)
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(1e-2), devices=devices,
                                 schedule="1f1b", microbatches=4)
    try:
        ada = AdaptiveKFKB(trainer, x, y, budget=10**9, period=2, repeats=1, max_k=2, nominal_repeats=1)
        assert max_err(_snapshot(parts), before) == 0.0
        ks = [c.k for c in ada.candidates]
        assert ks == [1, 2] and set(ada.nominal_seconds) == set(ks)
        assert all(t > 0 for t in ada.nominal_seconds.values())
        assert ada.tuner.current in ada.candidates and trainer.schedule.m == ada.tuner.current.microbatches
        loss = ada.step(x, y)
        assert np.isfinite(loss)
    finally:
        trainer.close()
