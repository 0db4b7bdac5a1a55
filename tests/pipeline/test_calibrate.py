"""The cost model calibrated from a built trainer: the simulator, fed the built stages' packs and
the ledger's static bytes, predicts exactly the ledger's per-rank peaks (same counting rules), and
its step time from measured F/B/W follows the schedule's shape."""
import keras
import numpy as np
import pytest

from terra.pipeline import calibrate
from terra.pipeline import executor as ex
from terra.pipeline import stage as st
from tests.pipeline._model import batch, logical_cpus


@pytest.mark.parametrize("schedule,balance", [
    pytest.param("1f1b", None, marks=pytest.mark.slow),   # BPipe's 1F1B below covers it by default
    ("1f1b", "bpipe"), ("zb-h1", None)])
def test_predicted_peaks_equal_the_ledger_and_costs_are_measured(schedule, balance):
    devices = logical_cpus(4)
    parts = st.tiny_gpt(4, devices=devices)
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(1e-3), devices=devices,
                                 schedule=schedule, balance=balance, microbatches=8)
    x, y = batch(16)
    try:
        with pytest.raises(RuntimeError, match="after the first step"):
            calibrate.stage_costs(trainer)
        trainer.step(x, y)
        trainer.ledger.reset_peaks()
        trainer.step(x, y)
        pred = calibrate.predict(trainer, repeats=1)
        residuals = trainer.residual_bytes
    finally:
        trainer.close()
    assert list(pred.peak_bytes) == [r["peak_total"] for r in trainer.memory_report()]
    # ZB-H1's ledger and prediction hold what each split B leaves for its W; 1F1B holds none.
    assert (min(residuals) > 0) == (schedule == "zb-h1")
    costs = pred.costs
    assert all(t > 0 for t in costs.F) and all(t > 0 for t in costs.B)
    if schedule == "zb-h1":
        assert all(t > 0 for t in costs.W)
    else:
        assert list(costs.W) == [0.0] * 4
    # Never faster than the busiest rank's work, never slower than all work one after another.
    per_stage = [f + b + w for f, b, w in zip(costs.F, costs.B, costs.W)]
    assert 8 * max(per_stage) <= pred.step_time * (1 + 1e-9) <= 8 * sum(per_stage) * (1 + 1e-9)
    assert pred.bubble >= 0


def test_temporaries_are_each_ranks_largest_backward_working_set_or_accumulation():
    """With an allocator probe per rank, a stage's backward is run between a peak reset and a
    read; a rank's temporaries are the larger of that working set and twice its stage's weights
    (the new gradients beside the new sum), and the total peak adds them to the ledger's."""
    from terra.pipeline.memory import AllocatorProbe
    devices = logical_cpus(2)
    parts = st.tiny_gpt(2, devices=devices)
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.SGD(0.1), devices=devices,
                                 schedule="1f1b", microbatches=2)
    reads = {0: [], 1: []}

    def probe(rank, work):
        state = {"n": 0}

        def read():
            state["n"] += 1
            reads[rank].append(state["n"])
            return {"current": 1000, "peak": 1000 + (work if state["n"] % 2 == 0 else 0)}
        return AllocatorProbe(lambda: None, read)

    try:
        trainer.step(*batch(4))
        weights = [sum(int(np.prod(v.shape)) * 4 for v in row[0].program.variables)
                   for row in trainer.replicas]
        big = 10 * max(weights)
        pred = calibrate.predict(trainer, repeats=1, probes=[probe(0, big), probe(1, 1)])
    finally:
        trainer.close()
    assert reads == {0: [1, 2], 1: [1, 2]}            # one backward measured per stage
    assert pred.temp_bytes == (big, 2 * weights[1])   # rank 1's working set is below its accumulation
    assert pred.total_peak_bytes == tuple(a + b for a, b in zip(pred.peak_bytes, pred.temp_bytes))
    assert calibrate.Prediction(pred.costs, pred.result).total_peak_bytes == pred.peak_bytes
