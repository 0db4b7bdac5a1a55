"""The ten bundled imperative TF2 programs (paper §3.3). Each module has
``build(tape_cls, seed=0, size="bench"|"tiny") -> Program``; see ``_common.Program``."""
import importlib

from ._common import SIZES, Program  # noqa: F401 - the interface every program implements

PROGRAMS = (
    "resnet50", "bert_qa", "bert_cls", "gpt2", "music_transformer",
    "dcgan", "dropblock", "sdpoint", "fasterrcnn_like", "yolov3_like",
)


def load(name):
    """The module of program ``name``."""
    if name not in PROGRAMS:
        raise ValueError(f"unknown program {name!r}; choose from {', '.join(PROGRAMS)}")
    return importlib.import_module(f"{__name__}.{name}")


def build(name, tape_cls, seed=0, size="bench"):
    return load(name).build(tape_cls, seed=seed, size=size)
