"""Tracing: the dispatch hook (the only module that patches TF), the recorder, locations."""
from terra.tracing.recorder import Recorder, record

__all__ = ["Recorder", "record"]
