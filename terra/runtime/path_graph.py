"""One compiled path as one graph (lowered by terra/compiler/path_lowering.py), with the runtime's
bookkeeping of its channels, run with the session's graph settings (Grappler, no arithmetic
rewrites or remapping by default, XLA)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from tensorflow.core.protobuf import rewriter_config_pb2

from terra import _tf_private as tfp
from terra.compiler import xla
from terra.compiler.channels import Unread
from terra.compiler.path_lowering import LoweredPath
from terra.config import CONFIG
from terra.ir.records import OutputRef
from terra.runtime.graph_runner import GraphRunner

if TYPE_CHECKING:
    from terra.runtime.sites import Path


# ------------------------------------------------------------------------------------ path graphs
def skip_fetch_points(path) -> dict:
    """The path's fetch points that skip mode can read. Skip mode matches a coarse unit
    (`tape.gradient`, a Keras layer, ...) as a whole without running its Python, so it never
    makes the reads that unit's Python made while tracing (`tape.gradient` reading a shape, or
    `apply_gradients` the dense shape of an IndexedSlices gradient); fetched anyway, those values
    would be left unread every step. A value also read outside units is fetched: that includes
    a read skip mode made (a unit not matched whole runs its Python op by op), which is logged
    as such and brings the value in with the next build.

    An eager twin's value (`PathView.twins`) is not fetched: skip mode runs its op eagerly
    and holds the result, so a fetched copy would be left unread every step (the next batch
    sliced after the tape: two enqueues, and a call dropping them, per step). A read that found
    the twin without its value (`Path.twin_misses`) fetches it after all."""
    units = (path.view.units if path.view is not None else path.usable_units()).values()
    spans = [(u.start, u.end) for u in units]
    view = path.view
    twins = view.twins if view is not None else frozenset()
    # values skip mode checks before a unit, once it has checked the shapes the unit read
    checked = {r for u in units for r, _ in u.reads if isinstance(r, OutputRef) and
               path.static.get(r, frozenset(view.shapes_read_by(u)) if view is not None
                               else frozenset()) is None}
    return {ref: after for ref, after in path.fetch_points.items()
            if (ref.record not in twins or ref in path.twin_misses) and
            (ref in path.outside_reads or ref in checked or
             not any(a <= after <= b for a, b in spans))}


def _shape_reads(path, unknown) -> None:
    """Fetch each value whose shape Python read outside units while traced (`Path.shape_reads`)
    where the graph leaves that shape open: skip mode's read of it waits for the value, which
    the graph then has to give (learning such reads one fallback and one build at a time cost a
    text batch's split four fallbacks). A shape the graph knows is answered without a fetch."""
    for r, after in path.shape_reads.items():
        if r in unknown:
            prev = path.fetch_points.get(r)
            path.fetch_points[r] = after if prev is None else min(prev, after)
            path.outside_reads.add(r)


def _unit_shape_checks(path, unknown) -> dict:
    """`{start: end}` of the path's coarse units whose Python may have read a shape the graph
    does not know before it runs (`PathView.shapes_read_by`): skip mode checks those shapes
    before it skips the unit (`PythonRunner._changed_shape`), so the unit's ops wait for that
    check (a gate), and the path fetches every value the check reads (learning them one
    fallback at a time would cost one fallback per value)."""
    if not unknown or path.view is None:
        return {}
    gates = {}
    for u in path.view.units.values():
        read = [r for r in path.view.shapes_read_by(u) if r in unknown]
        # not a unit whose Python read a value it computes itself (LossScaleOptimizer's finite
        # check): skip mode reads that value before it opens the unit's gate, and the graph
        # would compute it only after (each waiting for the other). Its ops run ungated then:
        # the check still comes first on the Python side, and a run it rejects is abandoned
        if read and not any(isinstance(r, OutputRef) and u.start <= r.record < u.end
                            for r, _ in u.reads):
            gates[u.start] = u.end
        for r in read:
            if r not in path.fetch_points:
                path.fetch_points[r] = r.record
                path.outside_reads.add(r)
    return gates


class PathGraph:
    """One generated graph for one path: feed channels per feed slot, fetch channels per fetched
    output, and the path's live-out values as the function's outputs."""

    run_config = None  # each run keeps the configured ConfigProto (see SiteGraph.run_config)
    build_seconds = 0.0  # its lowering's time, as `Builds` measured it (policy.takes_site_graph)

    def __init__(self, path: "Path", unknown=None, bundled=(), derived=None):
        """`unknown`: the outputs whose shapes the graph cannot know before it runs, where that
        is not what this graph's inference says (a shape group's relaxed trace, whose relaxed
        dimensions each member knows: shape_groups.py). `bundled`: feed slots put together,
        as one element of one channel (a shape group's constants); `derived`: feed slots the
        graph computes from shapes (`LoweredPath.derived`)."""
        self.path = path
        commit = CONFIG.commit_writes
        # Which fetch points skip mode reads depends on which shapes are data-dependent. Rather
        # than a separate inference pass over the trace first (a fifth of a build), assume none
        # and let this graph's own inference say; where it finds some, the fetch points are
        # taken again, and the graph lowered again if they changed.
        guess = unknown is None and path.static.unknown_pending()
        if guess or unknown is not None and path.static.unknown_pending():
            path.static.assume_unknown(unknown or ())  # (a shape group's: its members')
        fetch_points = skip_fetch_points(path)
        twins = path.view.twins if path.view is not None else frozenset()
        held = frozenset(r for r in path.liveouts
                         if r.record in twins and r not in path.twin_misses)
        lowered = LoweredPath(path.trace, fetch_points, path.liveouts, CONFIG.xla,
                              bundled=bundled, derived=derived, commit=commit, held=held)
        if unknown is None:
            unknown = frozenset(r for r, s in lowered.shapes.items() if not s.is_fully_defined())
        if guess and unknown:
            path.static.assume_unknown(unknown)
        gates = _unit_shape_checks(path, unknown)  # (adds the fetch points the checks read)
        _shape_reads(path, unknown)
        if gates or skip_fetch_points(path) != fetch_points:
            lowered = LoweredPath(path.trace, skip_fetch_points(path), path.liveouts, CONFIG.xla,
                                  gates, bundled, derived, commit, held)
        self.gate_channels = lowered.gate_channels
        # the writes wait for Python's commit (None: a snapshot before every run instead)
        self.commit_channel = lowered.commit_channel
        self.commit_dependent = lowered.commit_dependent
        self.feed_channels = lowered.feed_channels
        self.bundled = lowered.bundled
        self.fetch_channels = lowered.fetch_channels
        self.shapes = lowered.shapes
        # outputs whose shape the graph cannot know before it runs (a data-dependent op's, a
        # shape computed from a value): a unit whose Python read them checks them (units)
        self.unknown_shapes = frozenset(unknown)
        self.fetch_at = lowered.fetch_at
        self.liveouts = lowered.liveouts
        self.concrete = lowered.concrete
        self.stall = lowered.stall  # the graph's waits on its feeds (channels.StallTimer)
        self.xla_spans = lowered.xla_spans
        # fetch channel -> elements that finished iterations left in it unread (their runs
        # enqueue them; the next reader skips them first)
        self.stale = Unread(self.fetch_channels)
        self.unsized = frozenset(r for r, ch in self.fetch_channels.items()
                                 if ch.element_bytes is None and r in set(self.liveouts))

    def bind(self, path, renaming: dict) -> bool:
        """Serve `path` too: its trace is this graph's path's over other variables
        (`sites.variable_renaming`), so its runs call this graph with their handles captured in
        place of the old ones (no lowering, tracing or optimization). False if a renamed
        variable is not among the graph's captures."""
        old, new = self.path.trace.variables, path.trace.variables
        handles = {id(old[a].handle): new[b].handle for a, b in renaming.items()}
        captured = self.concrete.captured_inputs
        if len(handles.keys() & {id(c) for c in captured}) != len(handles):
            return False
        path.rebound = tfp.ReboundFunction(self.concrete,
                                           [handles.get(id(c), c) for c in captured])
        path.graph = self
        return True

    def function_for(self, path):
        """What a run of `path` on this graph calls."""
        return self.concrete if path is self.path or path.rebound is None else path.rebound

    def drain(self, fetched=None) -> None:
        """Empty the channels after a cancelled run; after a finished one (`fetched` given) the
        feeds were all consumed and only the fetches Python did not take are left. Only when no
        run of this graph is pending or running."""
        if fetched is None:
            for ch in (*dict.fromkeys(self.feed_channels), *self.gate_channels.values(),
                       self.commit_channel):
                if ch is not None and ch.size():
                    ch.drain()
        for ref, ch in self.fetch_channels.items():
            if fetched is None or ref not in fetched:
                if ch.size():
                    ch.drain()
        self.stale.clear()

    def leave_unread(self, fetched) -> None:
        """A finished iteration whose run may still be going read only `fetched`: the elements
        its run enqueues on the other channels are skipped by the next reader."""
        for ref in self.fetch_channels:
            if ref not in fetched:
                self.stale[ref] = self.stale.get(ref, 0) + 1

    def drop_stale(self, now: bool = False, outputs=None) -> None:
        """A run of this graph was collected (`outputs`: its live-out values): take the elements
        finished runs left unread when they are due (`Unread.collected`), or `now`. Only when
        every run that added to `stale` has ended: then they are at the heads of their queues."""
        if now:
            self.stale.drop()
            return
        unread = self.stale
        for ref in unread:
            if ref in self.unsized:  # (a live-out's channel is fed the run's output)
                v = (outputs or {}).get(ref)
                if v is not None:
                    unread.seen_bytes[ref] = v.shape.num_elements() * v.dtype.size
        unread.collected()

    @property
    def stall_seconds(self) -> float:
        return (self.stall.seconds if self.stall is not None else 0.0) + sum(
            ch.stall_seconds for ch in dict.fromkeys(self.feed_channels) if ch is not None)


def _no_arithmetic_rewrites(config) -> None:
    """Grappler without its arithmetic optimizer (mutates a ConfigProto). Its rewrites change
    rounding, and training amplifies that: on ResNet-50 (benchmarks/programs/resnet50.py) the
    loss was 24% away from eager's after 14 steps with it, and equal without. Where a value
    is fetched the rewrite cannot apply, which hid this while graphs fetched many values."""
    config.graph_options.rewrite_options.arithmetic_optimization = \
        rewriter_config_pb2.RewriterConfig.OFF


def _no_remapping(config) -> None:
    """Grappler without its remapper (mutates a ConfigProto): its fused kernels (MatMul + BiasAdd
    + Relu) map a NaN input to 0 where eager's Relu gives NaN (config.remapper)."""
    config.graph_options.rewrite_options.remapping = rewriter_config_pb2.RewriterConfig.OFF


def _no_constant_folding(config) -> None:
    """Grappler without constant folding (mutates a ConfigProto): it also rewrites arithmetic
    around constants, which changes rounding (config.constant_folding)."""
    config.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF


class ConfiguredRunner(GraphRunner):
    """GraphRunner that runs graphs with or without Grappler (config.grappler), its arithmetic
    optimizer (config.arithmetic_optimizer), remapper (config.remapper) and constant folding
    (config.constant_folding), and with XLA's clusters kept fusable (config.xla), as configured
    when each run starts."""

    def _call(self, run):
        if not CONFIG.grappler:
            with tfp.function_call_config(tfp.disable_grappler):
                return super()._call(run)
        changes = [m for m, on in ((_no_arithmetic_rewrites, not CONFIG.arithmetic_optimizer),
                                   (_no_remapping, not CONFIG.remapper),
                                   (_no_constant_folding, not CONFIG.constant_folding),
                                   (xla.keep_fusable, CONFIG.xla)) if on]
        if not changes:
            return super()._call(run)

        def mutate(config):
            for change in changes:
                change(config)
        with tfp.function_call_config(mutate):
            return super()._call(run)
