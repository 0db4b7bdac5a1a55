"""Terra: imperative-symbolic co-execution for TensorFlow 2, and memory-balanced pipelines.

    import terra                      # also makes tf.TerraGradientTape available
    with tf.TerraGradientTape() as tape:
        loss = loss_fn(model(x), y)
    ...
    terra.stats(); print(terra.explain())
"""
__version__ = "0.1.0"

import os as _os

import tensorflow as _tf

from terra.config import CONFIG as _CONFIG
from terra.config import as_dict as _config_dict
from terra.config import configure as _configure
from terra.runtime.session import SESSION as _SESSION
from terra.tape import GradientTape, TerraGradientTape
from terra.tracing import hook as _hook
from terra.tracing import random_streams as _random_streams

_tf.TerraGradientTape = GradientTape
if _os.environ.get("TERRA_STATELESS_RANDOM", "1") != "0":
    _random_streams.install()   # (for the process: see terra/tracing/random_streams.py)


def config(**changes) -> dict:
    """Change settings (see `terra.config.Config` for each: enabled, coexecution,
    overlap_iterations, max_traces, max_fallbacks, xla, grappler, arithmetic_optimizer, remapper,
    timeout_s, verbose, max_trace_ops, tracing_gc_threshold, coexec_gc_threshold, layer_units,
    user_layer_units, site_graph, background_builds, tiered_instantiation, shape_groups,
    speculation, commit_writes); with no arguments returns all current
    settings. Returns the previous values of the changed settings otherwise."""
    if not changes:
        return _config_dict()
    if "enabled" in changes or "coexecution" in changes:
        _SESSION.end()
    return _configure(**changes)


def stats() -> dict:
    """traces, fallbacks, graph_builds, phase, iterations, and cumulative seconds:
    python_exec_s / python_stall_s (PythonRunner) and graph_exec_s / graph_stall_s (GraphRunner)."""
    return _SESSION.stats()


def explain() -> str:
    """Why each trace, graph build and fallback happened, with the user's source line."""
    return _SESSION.explain()


def summary() -> str:
    """A one-screen digest of `stats()` and `explain()`: totals, time in Python and in the graph,
    each site's state, what stayed eager and why, fallbacks grouped by reason."""
    return _SESSION.summary()


def wait_builds(timeout: float | None = None) -> bool:
    """Wait until the graphs being built on the builder thread (`background_builds`) are ready,
    and put them in place for the next iteration; False if `timeout` seconds passed first. A
    program never needs this (it goes on while graphs are built); a benchmark that wants its
    timed steps compiled calls it after its warm-up."""
    return _SESSION.builds.wait(timeout)


def end_iteration() -> None:
    """Finish the open iteration now (otherwise the next tape or `reset` does). On a thread
    whose tapes run as plain tapes (another thread's iterations are running) it does nothing."""
    if not _SESSION.foreign():
        _SESSION.end()


class _Enabling:
    """What `enable()` returns. As a context manager, its exit puts back the state before
    `enable()` (plain TF if Terra was not enabled then)."""

    def __init__(self, was_enabled: bool):
        self._was_enabled = was_enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if not self._was_enabled:
            disable()
        return False


def enable() -> _Enabling:
    """Every `tf.GradientTape` the program opens from now on is a Terra tape, including tapes
    opened inside libraries (Keras' `fit(..., run_eagerly=True)` among them); a tape opened while
    TF traces a `tf.function` stays plain. Code that bound the class before (`from tensorflow
    import GradientTape`) keeps TF's. Keras' `fit`, `evaluate` and `predict` end the open
    iteration when they begin and return. Also a context manager: `with terra.enable(): ...`."""
    was = _hook.gradient_tape_replaced()
    _hook.replace_gradient_tape(GradientTape, end_iteration)
    return _Enabling(was)


def disable() -> None:
    """Undo `enable()`: finish the open iteration, and give every public `tf.GradientTape` name
    back TF's own class (`tf.GradientTape is` the class it was before `enable()`), and Keras'
    trainer its own methods."""
    end_iteration()
    _hook.restore_gradient_tape()


def is_enabled() -> bool:
    """Whether `enable()` is in force (`tf.GradientTape` is Terra's tape)."""
    return _hook.gradient_tape_replaced()


def reset() -> None:
    """Forget every site, trace, graph and counter; stop intercepting TF. `enable()` stays in
    force (`disable()` undoes it)."""
    _SESSION.reset()


__all__ = ["GradientTape", "TerraGradientTape", "config", "stats", "explain", "reset",
           "wait_builds",
           "end_iteration", "enable", "disable", "is_enabled", "summary"]
