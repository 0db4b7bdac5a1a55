"""Execution modes: how one program is run. Only the tape class and, for the ``tf.function`` modes,
the wrapping of ``program.train_step`` differ between modes.

Interface the Terra runtime must provide (imported lazily; a Terra mode is "unavailable" until it
exists):
- ``terra.GradientTape``: drop-in for ``tf.GradientTape``.
- ``terra.config(**options)``: sets global options, read at each tape ``__enter__``. The harness
  calls it before each round of a Terra mode with ``enabled=True`` and ``coexecution`` (False
  serializes PythonRunner and GraphRunner: the lazy evaluation of Table 3.2) and ``xla``
  (compile the compute spans of the generated graph with XLA; ``terra_xla`` is left out of the
  default modes because on CPU it made Terra's steps slower, see docs/usage.md).
- ``terra.stats()``: dict of cumulative, monotonically growing counters since import, with keys
  ``traces, fallbacks, graph_builds`` (counts) and ``python_exec_s, python_stall_s, graph_exec_s,
  graph_stall_s`` (seconds); the harness attributes differences to the mode that ran in between.
"""
import dataclasses
import types

import tensorflow as tf

STATS_KEYS = ("traces", "new_paths", "fallbacks", "graph_builds",
              "python_exec_s", "python_stall_s", "graph_exec_s", "graph_stall_s")


class Unavailable(Exception):
    """The mode cannot run in this installation (not a failure of the program)."""


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    label: str
    runtime: str                 # "tf" or "terra": where the tape class comes from
    jit_compile: bool | None     # None: step runs as written; else tf.function(jit_compile=...)
    terra_config: tuple = ()     # (key, value) pairs for terra.config before each round
    rtol: float = 1e-5           # loss of a step from eager's state (numpy.isclose); see check.py
    atol: float = 1e-6
    update_rtol: float = 0.1     # update of a step from eager's state: relative L2 of the difference

    @property
    def is_terra(self):
        return self.runtime == "terra"


MODES = {m.name: m for m in (
    Mode("eager", "TF eager", "tf", None),
    Mode("function", "AutoGraph", "tf", False),
    Mode("function_xla", "AutoGraph+XLA", "tf", True),
    Mode("terra", "Terra", "terra", None, (("enabled", True), ("coexecution", True), ("xla", False))),
    Mode("terra_xla", "Terra+XLA", "terra", None, (("enabled", True), ("coexecution", True), ("xla", True))),
    Mode("terra_lazy", "Terra LazyEval", "terra", None, (("enabled", True), ("coexecution", False), ("xla", False))),
)}
# terra_xla is runnable on request (--modes); out of the default set: slower on CPU (docs/usage.md).
DEFAULT_MODES = ("eager", "function", "function_xla", "terra", "terra_lazy")


def get(name):
    if name not in MODES:
        raise ValueError(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    return MODES[name]


def terra_runtime():
    """The ``terra`` module if its runtime is usable, else ``Unavailable`` saying what is missing."""
    try:
        import terra
    except Exception as e:  # noqa: BLE001 - any import problem makes the mode unavailable
        raise Unavailable(f"import terra failed: {type(e).__name__}: {e}") from None
    missing = [n for n in ("GradientTape", "config") if not hasattr(terra, n)]
    if missing:
        raise Unavailable("Terra runtime not built yet (missing " + ", ".join(f"terra.{n}" for n in missing) + ")")
    return terra


def tape_class(mode):
    return terra_runtime().GradientTape if mode.is_terra else tf.GradientTape


def prepare(mode, build, seed=0, size="bench"):
    """Build the program for ``mode``; the tf.function modes decorate ``train_step`` as a user would.

    Terra keys an iteration site by the code that enters the tape. The Terra modes run their own
    program instances interleaved in one process, so each Terra mode but ``terra`` gets its own
    copy of ``train_step``'s code: otherwise both modes' models would share one site (its traces,
    paths and trace limit), which no single user program does."""
    program = build(tape_class(mode), seed=seed, size=size)
    if mode.jit_compile is not None:
        program.train_step = tf.function(program.train_step, jit_compile=mode.jit_compile)
    elif mode.is_terra and mode.name != "terra":
        program.train_step = _own_code(program.train_step, mode.name)
    return program


def _own_code(method, tag):
    """``method`` (bound) re-made from a copy of its code object renamed ``<name>_<tag>`` (code
    objects compare by value, so the copy must differ): same behaviour, another site."""
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return types.MethodType(copy, method.__self__)


def enter(mode):
    """Called before each round of ``mode``: Terra modes set their options (global in terra)."""
    if mode.is_terra:
        terra_runtime().config(**dict(mode.terra_config))


def leave(mode):
    """Called after each block of steps of ``mode``: a Terra iteration lasts until the next tape
    ``__enter__`` at the same site, so without this the harness's own work between blocks (other
    modes' steps, loading eager's variables) would run inside the open Terra iteration."""
    if mode.is_terra:
        terra = terra_runtime()
        if hasattr(terra, "end_iteration"):
            terra.end_iteration()


def read_stats(mode):
    """``terra.stats()`` restricted to STATS_KEYS, or None (non-Terra mode, or no stats yet)."""
    if not mode.is_terra:
        return None
    terra = terra_runtime()
    if not hasattr(terra, "stats"):
        return None
    s = terra.stats()
    return {k: float(s[k]) for k in STATS_KEYS if k in s}
