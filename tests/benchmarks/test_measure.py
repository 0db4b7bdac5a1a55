"""The harness runs modes interleaved and detects wrong results and failures."""
import re
import sys
import types

import pytest
import tensorflow as tf

from benchmarks import measure
from tests.benchmarks import toy_programs as toys

S = measure.Schedule(warmup=2, rounds=2, steps=2)


def run(cls, modes=("function",)):
    return measure.run_program(cls, list(modes), S, size="tiny")


def test_correct_program_passes_with_identical_losses():
    r = run(toys.Linear)
    assert r["eager"]["status"] == "ok" and r["function"]["status"] == "ok", r["function"]["reason"]
    assert [i for i, _ in r["eager"]["losses"]] == list(range(S.total_steps))
    assert r["function"]["max_rel_loss_diff"] < 1e-6 and r["function"]["var_rel_diff"] < 1e-6
    assert len(r["function"]["step_s"]) == S.rounds * S.steps and len(r["function"]["warmup_s"]) == 2


def test_python_counter_frozen_by_tracing_is_flagged_wrong():
    r = run(toys.PythonCounter)
    assert r["eager"]["status"] == "ok"
    assert r["function"]["status"] == "wrong"
    assert r["function"]["reason"].startswith("loss differs at step "), r["function"]["reason"]


def test_materialization_in_step_is_a_failure_with_reason():
    r = run(toys.Materializes)
    f = r["function"]
    assert f["status"] == "failed" and f["reason"].startswith("step 0: ")
    assert "Error" in f["reason"] and f["step_s"] == []


def test_eager_is_always_the_reference():
    assert list(run(toys.Linear, ())) == ["eager"]


def test_schedule_rejects_bad_values():
    with pytest.raises(ValueError, match="rounds"):
        measure.Schedule(rounds=0)


def test_terra_mode_unavailable_without_runtime(monkeypatch):
    monkeypatch.setitem(sys.modules, "terra", types.ModuleType("terra"))
    r = run(toys.Linear, ("terra", "terra_lazy"))
    for m in ("terra", "terra_lazy"):
        assert r[m]["status"] == "unavailable"
        assert "terra.GradientTape" in r[m]["reason"]
    assert r["eager"]["status"] == "ok"


def fake_terra(coexec_log):
    """A stand-in runtime with the interface the harness expects: tape, config, growing stats."""
    mod = types.ModuleType("terra")
    counters = dict(traces=0, new_paths=0, fallbacks=0, graph_builds=0, python_exec_s=0.0,
                    python_stall_s=0.0, graph_exec_s=0.0, graph_stall_s=0.0)

    class GradientTape(tf.GradientTape):
        def __enter__(self):
            counters["new_paths"] += counters["traces"] == 0  # (one path, met first here)
            counters["traces"] += 1
            counters["graph_exec_s"] += 0.5
            return super().__enter__()

    def end_iteration():   # an iteration is filed when it ends: a build happens then
        counters["graph_builds"] += 1

    mod.GradientTape = GradientTape
    mod.config = lambda **kw: coexec_log.append(kw["coexecution"])
    mod.stats = lambda: dict(counters)
    mod.end_iteration = end_iteration
    return mod


def test_terra_code_path_reads_stats_and_config(monkeypatch):
    log = []
    monkeypatch.setitem(sys.modules, "terra", fake_terra(log))
    r = run(toys.Linear, ("terra", "terra_lazy"))
    t = r["terra"]
    assert t["status"] == "ok", t["reason"]
    assert t["terra_stats"]["timed_steps"] == 4
    assert t["terra_stats"]["warmup"]["traces"] == 2 and t["terra_stats"]["timed"]["traces"] == 4
    assert t["terra_stats"]["warmup"]["new_paths"] == 1 and t["terra_stats"]["timed"]["new_paths"] == 0
    assert t["terra_stats"]["timed"]["graph_exec_s"] == pytest.approx(2.0)
    # what ending a block of steps counts belongs to the block's last step: one per warm-up step
    # (each is its own block) and one per round
    assert t["terra_stats"]["warmup"]["graph_builds"] == 2
    assert t["terra_stats"]["timed"]["graph_builds"] == S.rounds
    events = t["terra_stats"]["events"]
    assert [e[0] for e in events] == list(range(S.warmup + S.rounds * S.steps))
    last_of_round = {S.warmup + (k + 1) * S.steps - 1 for k in range(S.rounds)}
    assert all(e == [e[0], 1, 1 if e[0] < S.warmup or e[0] in last_of_round else 0, 0]
               for e in events)
    # config set before warm-up and before each round, per mode
    assert log.count(True) == 1 + S.rounds and log.count(False) == 1 + S.rounds


class SkipsUpdateWhenTraced(toys.Linear):
    """Same loss from the same state, but a traced step never applies its update."""

    def train_step(self, x, y):
        with self.tape_cls() as tape:
            loss = self.loss(x, y)
        grads = tape.gradient(loss, self.model.trainable_variables)
        if tf.executing_eagerly():
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss


def test_missing_update_is_flagged_from_synchronized_state():
    r = measure.run_program(SkipsUpdateWhenTraced, ["function"], measure.Schedule(warmup=3, rounds=1, steps=1),
                            size="tiny")
    assert r["function"]["status"] == "wrong"
    # step 0 starts from the seed state and only its loss is compared; step 1 is loaded with
    # eager's variables, so its loss agrees and its (missing) update is what differs
    reason = r["function"]["reason"]
    # the untouched step counter (its Keras name gets a suffix when several SGDs exist) or the weights
    assert re.fullmatch(r"step 1: variable sgd(_\d+)?/iteration updated differently from eager", reason) or \
        reason.startswith("update of step 1 differs from eager's: relative L2 1"), reason


def test_terra_modes_get_their_own_iteration_site():
    """terra and terra_lazy run interleaved in one process: their programs must not share the
    site Terra keys by the code that enters the tape (but must compute the same)."""
    import terra
    from benchmarks import modes as modes_mod
    a = modes_mod.prepare(modes_mod.get("terra"), toys.Linear, seed=0, size="tiny")
    b = modes_mod.prepare(modes_mod.get("terra_lazy"), toys.Linear, seed=0, size="tiny")
    code_a, code_b = a.train_step.__func__.__code__, b.train_step.__func__.__code__
    assert code_a is toys.Linear.train_step.__code__
    assert code_b != code_a and hash(code_b) != hash(code_a)
    assert code_b.co_name == "train_step_terra_lazy" and code_b.co_code == code_a.co_code
    try:
        assert float(a.step(0)) == float(b.step(0))
    finally:
        terra.reset()   # the steps' iterations stay open until the next tape: close them here
