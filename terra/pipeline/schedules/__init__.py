"""Pipeline schedule generators. Each returns a `Schedule` (rank x time-step grid of actions)."""
from terra.pipeline.schedules.base import Schedule, format_grid, from_orders
from terra.pipeline.schedules.chimera import chimera
from terra.pipeline.schedules.gpipe import gpipe
from terra.pipeline.schedules.interleaved import interleaved_1f1b
from terra.pipeline.schedules.kfkb import kfkb
from terra.pipeline.schedules.one_f_one_b import one_f_one_b
from terra.pipeline.schedules.zero_bubble import dualpipe_v, zb_h1, zb_v

__all__ = ["Schedule", "format_grid", "from_orders", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "kfkb", "chimera", "zb_h1", "zb_v", "dualpipe_v"]
