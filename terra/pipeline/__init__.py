"""terra.pipeline: pipeline schedules (GPipe, 1F1B, interleaved, kFkB, Chimera) as plain data,
BPipe activation balancing as a pass over them, and their validation and simulation."""
from terra.pipeline.actions import Action, Kind, B, EVICT, F, LOAD, RECV, SEND
from terra.pipeline.schedules import Schedule

__all__ = ["Action", "Kind", "F", "B", "EVICT", "LOAD", "SEND", "RECV", "Schedule"]
