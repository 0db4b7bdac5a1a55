"""Pipeline schedule generators. Each returns a `Schedule` (rank x time-step grid of actions)."""
from terra.pipeline.schedules.base import Schedule, format_grid, from_orders
from terra.pipeline.schedules.gpipe import gpipe
from terra.pipeline.schedules.one_f_one_b import one_f_one_b

__all__ = ["Schedule", "format_grid", "from_orders", "gpipe", "one_f_one_b"]
