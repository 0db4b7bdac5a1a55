"""XLA for the compute-only spans of a generated graph (`terra.config(xla=True)`).

A path graph mixes compute with feed/fetch channel ops (queues, stall timers) that XLA cannot or
must not compile. TF's own explicit clustering does the split: ops built inside
`tf.xla.experimental.jit_scope()` carry `_XlaCompile=True` and an `_XlaScope`, and when the
function is instantiated TF's MarkForCompilation pass groups the marked ops that have XLA kernels
into clusters (never across two scopes), rewrites each into `_XlaCompile`/`_XlaRun` (lazily
compiled, mostly on first run; the original ops run behind `_XlaMerge` until then) and leaves
every other op (queues, ops without an XLA kernel) to the TF executor. This works on CPU whatever ran before; auto-clustering (`global_jit_level`) on
CPU needs the `tf_xla_cpu_global_jit` flag set before TF's first op, too late for a setting.

A span runs from one fetch point to the next: cutting clusters there keeps each fetched value
available as soon as its span finished (one cluster over the whole step would hold an early fetch
back until the step's end). Channel ops are built under `compile_ops=False`, so they stay out of
every cluster whatever they contain (the timed dequeue's timestamps and stall counter included).
"""
from __future__ import annotations

import contextlib

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

# Random ops stay out of clusters although XLA has kernels for them: XLA draws other numbers than
# TF's kernels for the same seed (stateless ops and Generators alike; a stateless_dropout mask
# differs), so a compiled draw would change the program's results. Their consumers still compile.
RANDOM_PREFIXES = ("Stateless", "Stateful", "Rng")
RANDOM_OPS = frozenset({"Multinomial", "TruncatedNormal", "ParameterizedTruncatedNormal"})


def compiled(op_type: str) -> bool:
    """Whether an op of this type may join an XLA cluster (if XLA has a kernel for it)."""
    return not ("Random" in op_type or op_type.startswith(RANDOM_PREFIXES)
                or op_type in RANDOM_OPS)


def _compile(node_def) -> bool:
    return compiled(node_def.op)


class Spans:
    """Builds a graph's compute ops in XLA scopes, one per span between fetch points.

    `compute()` wraps the ops of one record (opening the current span's scope on first use),
    `cut()` ends the current span, `channel()` wraps channel ops (never compiled). With
    `enabled=False` every method is a no-op, so the graph is exactly the one built without XLA.
    """

    def __init__(self, enabled: bool):
        if not isinstance(enabled, bool):
            raise TypeError(f"Spans: enabled must be a bool, got {enabled!r}")
        self.enabled = enabled
        self.count = 0          # spans opened (one _XlaScope each)
        self._open = None       # ExitStack holding the current span's scope

    def compute(self):
        if self.enabled and self._open is None:
            self._open = contextlib.ExitStack()
            self._open.enter_context(tf.xla.experimental.jit_scope(
                compile_ops=_compile, separate_compiled_gradients=False))
            self.count += 1
        return contextlib.nullcontext()

    def cut(self) -> None:
        if self._open is not None:
            self._open.close()
            self._open = None

    def channel(self):
        if not self.enabled:
            return contextlib.nullcontext()
        return tf.xla.experimental.jit_scope(compile_ops=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.cut()
        return False


def keep_fusable(config) -> None:
    """Grappler options for graphs built with XLA scopes (mutates a ConfigProto).

    Grappler runs before clustering; its remapper fuses e.g. Conv2D+BiasAdd+Relu into `_Fused*`
    ops that have no XLA kernel, which would leave the forward convolutions outside every cluster.
    XLA fuses them itself, so the remapper is turned off.
    """
    config.graph_options.rewrite_options.remapping = \
        rewriter_config_pb2.RewriterConfig.OFF
