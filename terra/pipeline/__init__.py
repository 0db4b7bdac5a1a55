"""terra.pipeline: pipeline schedules (GPipe, 1F1B, interleaved, kFkB, Chimera, ZB-H1, ZB-V,
DualPipeV) as plain data, BPipe activation balancing as a pass over them, their validation and
memory simulation.

Pure data: nothing here imports TensorFlow (the executor, which does, lives beside it)."""
from terra.pipeline.actions import Action, Kind, B, EVICT, F, LOAD, RECV, SEND, W
from terra.pipeline.passes import Infeasible, add_evict_load, add_send_recv, mu_opt, pairs
from terra.pipeline.schedules import (Schedule, chimera, dualpipe_v, gpipe, interleaved_1f1b,
                                      kfkb, one_f_one_b, zb_h1, zb_v)
from terra.pipeline.simulate import Costs, SimResult, simulate
from terra.pipeline.validate import Problem, ScheduleError, problems, validate

__all__ = ["Action", "Kind", "F", "B", "W", "EVICT", "LOAD", "SEND", "RECV", "Schedule", "gpipe",
           "one_f_one_b", "interleaved_1f1b", "kfkb", "chimera", "zb_h1", "zb_v", "dualpipe_v",
           "add_evict_load",
           "add_send_recv", "mu_opt", "pairs", "Infeasible", "simulate", "Costs", "SimResult", "validate",
           "problems", "Problem", "ScheduleError"]


def __getattr__(name):
    """`terra.pipeline.PipelineTrainer` and `terra.pipeline.pipeline` without importing TensorFlow for the pure-data API."""
    if name == "PipelineTrainer":
        from terra.pipeline.executor import PipelineTrainer
        return PipelineTrainer
    if name == "pipeline":
        from terra.pipeline.model_pipeline import pipeline
        return pipeline
    raise AttributeError(f"module 'terra.pipeline' has no attribute {name!r}")
