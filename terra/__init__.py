"""Terra: imperative-symbolic co-execution for TensorFlow 2, and memory-balanced pipelines.

    import terra                      # also makes tf.TerraGradientTape available
    with tf.TerraGradientTape() as tape:
        loss = loss_fn(model(x), y)
    ...
    terra.stats(); print(terra.explain())
"""
__version__ = "0.1.0"

import tensorflow as _tf

from terra.config import CONFIG as _CONFIG
from terra.config import as_dict as _config_dict
from terra.config import configure as _configure
from terra.runtime.session import SESSION as _SESSION
from terra.tape import GradientTape, TerraGradientTape

_tf.TerraGradientTape = GradientTape


def config(**changes) -> dict:
    """Change settings (see `terra.config.Config` for each: enabled, coexecution,
    overlap_iterations, max_traces, max_fallbacks, xla, grappler, arithmetic_optimizer, remapper,
    timeout_s, verbose, max_trace_ops, layer_units, site_graph); with no arguments returns all
    current settings. Returns the previous values of the changed settings otherwise."""
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


def end_iteration() -> None:
    """Finish the open iteration now (otherwise the next tape or `reset` does). On a thread
    whose tapes run as plain tapes (another thread's iterations are running) it does nothing."""
    if not _SESSION.foreign():
        _SESSION.end()


def reset() -> None:
    """Forget every site, trace, graph and counter; stop intercepting TF."""
    _SESSION.reset()


__all__ = ["GradientTape", "TerraGradientTape", "config", "stats", "explain", "reset",
           "end_iteration"]
