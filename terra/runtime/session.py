"""The iteration manager: phases, traces, graph builds, co-execution, fallbacks, stats, explain.

An *iteration* runs from one `TerraGradientTape.__enter__` to the next `__enter__` at the same
program site (ARCHITECTURE.md §2); a tape entered at another site while the iteration's frame is
still running (a GAN's second tape, a nested tape) belongs to the current iteration.

Per site the session goes through phases:
- tracing: the iteration runs eagerly under a Recorder; the trace is filed under its *path
  signature* (records, feed specs, coarse units), after generalizing constants that changed
  between traces of the same path into feeds;
- co-execution: once a path was traced twice, its graph is generated and the next iterations run
  it on the GraphRunner while the PythonRunner skips the user's ops along the same path;
- eager: a site that needed more than `max_traces` traces or `max_fallbacks` fallbacks, or whose
  traces cannot be compiled, stays eager (one warning, reason in `explain()`).

Graph generation here compiles one path (a straight-line trace) into one graph with feed and fetch
channels; divergence from the path falls back (terra/runtime/fallback.py) and the new trace
becomes another path. A site with two or more compiled paths also gets a SiteGraph
(terra/runtime/site_graph.py: all paths merged and lowered with switch_case / while_loop), on
which a divergence to another path that made the same choices so far costs no restart.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field

import tensorflow as tf
from tensorflow.core.protobuf import rewriter_config_pb2

from terra import _tf_private as tfp
from terra.compiler import replay
from terra.compiler.shapes import shapes_fixed
from terra.config import CONFIG
import numpy as np

from terra.ir.records import (ConstRef, Feed, FeedRef, OutputRef, TensorSpec, Trace,
                              VariableRef, replace)
from terra.compiler.channels import FeedChannel, FeedFetchOrder, FetchChannel, drop_elements
from terra.runtime import xla
from terra.errors import TerraRuntimeError
from terra.runtime.fallback import (ContinuingRecorder, EagerReplay, Snapshot, bind_placeholders,
                                    unsnapshotable,
                                    written_variables)
from terra.compiler.names import op_node_name
from terra.runtime.graph_runner import GraphRunner, extended_error
from terra.runtime.interrupts import held_interrupts
from terra.runtime.placeholders import Placeholder
from terra.runtime.python_runner import (PAST_END, UNSET, Diverged, Divergence, GradUnit, PathView,
                                         PythonRunner, placeholder_ref, user_line)
from terra.runtime.site_graph import SiteGraph, SiteRun
from terra.runtime.static_values import StaticValues
from terra.tracing import hook
from terra.ir.op_kinds import HOST_OPS, UNSEEDED_RANDOM_OPS
from terra.tracing.recorder import frozen_value


# ------------------------------------------------------------------------------------ hook control
def _set_active(interceptor) -> None:
    """Route this thread's ops to `interceptor` (None: nobody)."""
    hook.deactivate((interceptor, threading.get_ident() if interceptor is not None else None))


# ------------------------------------------------------------------------------------ path graphs
class _ChannelBuilder(replay.Builder):
    """Replay's builder with feeds dequeued from channels and fetches enqueued at their points."""

    def __init__(self, trace, graph, order):
        self.spans = xla.Spans(CONFIG.xla)  # XLA scopes per compute span (no-ops without xla)
        super().__init__(trace, _LazyFeeds(graph, order, self.spans))
        self.graph = graph
        self.order = order

    def _emit_fetches(self, at):
        refs = self.graph.fetch_at.get(at, ())
        if refs:
            self.spans.cut()
        for ref in refs:
            with self.spans.channel():
                self.order.fetch(self.graph.fetch_channels[ref], self.env[(ref.record, ref.index)])

    def run(self):
        with self.spans:
            for rec in self.trace.records:
                self._emit_fetches(rec.index)
                with self.spans.compute(), tf.name_scope(op_node_name(rec.index)):
                    outs = self.function(rec) if rec.route == "function" else self.op(rec)
                for j, t in enumerate(outs or ()):
                    self.env[(rec.index, j)] = t
        self._emit_fetches(len(self.trace.records))
        return self.env


class _LazyFeeds:
    """`feeds[slot]` dequeues the slot's channel on first use (in trace order)."""

    def __init__(self, graph, order, spans):
        self.graph, self.order, self.spans, self.values = graph, order, spans, {}

    def __getitem__(self, slot):
        v = self.values.get(slot)
        if v is None:
            with self.spans.channel():
                v = self.values[slot] = self.order.feed(self.graph.feed_channels[slot])
        return v


def skip_fetch_points(path) -> dict:
    """The path's fetch points that skip mode can read. Skip mode matches a coarse unit
    (`tape.gradient`, a Keras layer, ...) as a whole without running its Python, so it never
    makes the reads that unit's Python made while tracing (`tape.gradient` reading a shape, or
    `apply_gradients` the dense shape of an IndexedSlices gradient); fetched anyway, those values
    would be left unread every step. A value also read outside units is fetched: that includes
    a read skip mode made (a unit not matched whole runs its Python op by op), which is logged
    as such and brings the value in with the next build."""
    units = (path.view.units if path.view is not None else path.usable_units()).values()
    spans = [(u.start, u.end) for u in units]
    checked = {r for u in units for r, _ in u.reads  # values skip mode checks before a unit
               if isinstance(r, OutputRef) and path.static.get(r) is None}
    return {ref: after for ref, after in path.fetch_points.items()
            if ref in path.outside_reads or ref in checked or
            not any(a <= after <= b for a, b in spans)}


class PathGraph:
    """One generated graph for one path: feed channels per feed slot, fetch channels per fetched
    output, and the path's live-out values as the function's outputs."""

    run_config = None  # each run keeps the configured ConfigProto (see SiteGraph.run_config)

    def __init__(self, path: "Path"):
        trace = path.trace
        self.path = path
        self.feed_channels = [FeedChannel(f.spec.dtype, f.spec.shape, name=f"terra_feed{f.slot}")
                              for f in trace.feeds]
        self.fetch_at: dict = {}
        self.fetch_channels: dict = {}

        def fetch_channel(ref, at):
            spec = trace.records[ref.record].outputs[ref.index]
            self.fetch_channels[ref] = FetchChannel(spec.dtype, spec.shape,
                                                    name=f"terra_fetch{ref.record}_{ref.index}")
            self.fetch_at.setdefault(at, []).append(ref)

        for ref, after in sorted(skip_fetch_points(path).items(), key=lambda kv: kv[1]):
            fetch_channel(ref, max(after, ref.record + 1))
        self.liveouts = tuple(sorted(path.liveouts, key=lambda r: (r.record, r.index)))
        # Live-outs are fetched too: the next iteration often consumes one right away (inputs
        # sliced for the next step after the tape's block) and then needs not wait for the run
        # to end.
        for ref in self.liveouts:
            if ref not in self.fetch_channels and trace.records[ref.record].outputs[
                    ref.index].dtype not in ("resource", "variant"):
                fetch_channel(ref, len(trace.records))
        # fetch channel -> elements that finished iterations left in it unread (their runs
        # enqueue them; the next reader skips them first)
        self.stale: dict = {}
        self.droppers: dict = {}  # pattern of unread counts -> function that drops them
        liveouts = self.liveouts

        def body():
            order = FeedFetchOrder()
            builder = _ChannelBuilder(trace, self, order)
            env = builder.run()
            self.xla_spans = builder.spans.count
            return [env[(r.record, r.index)] for r in liveouts]

        self.concrete = tf.function(body, autograph=False).get_concrete_function()

    def drain(self, fetched=None) -> None:
        """Empty the channels after a cancelled run; after a finished one (`fetched` given) the
        feeds were all consumed and only the fetches Python did not take are left. Only when no
        run of this graph is pending or running."""
        if fetched is None:
            for ch in self.feed_channels:
                if ch.size():
                    ch.drain()
        for ref, ch in self.fetch_channels.items():
            if fetched is None or ref not in fetched:
                if ch.size():
                    ch.drain()
        self.stale = {}

    def leave_unread(self, fetched) -> None:
        """A finished iteration whose run may still be going read only `fetched`: the elements
        its run enqueues on the other channels are skipped by the next reader."""
        for ref in self.fetch_channels:
            if ref not in fetched:
                self.stale[ref] = self.stale.get(ref, 0) + 1

    def drop_stale(self) -> None:
        """Take now the elements finished runs left unread: with no later reader of a channel
        they would pile up, one per iteration (all runs that added to `stale` have ended, so
        they are at the heads of their queues)."""
        drop_elements(self.stale, self.fetch_channels, self.droppers)

    @property
    def stall_seconds(self) -> float:
        return sum(ch.stall_seconds for ch in self.feed_channels)


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


class _Runner(GraphRunner):
    """GraphRunner that runs graphs with or without Grappler (config.grappler), its arithmetic
    optimizer (config.arithmetic_optimizer) and remapper (config.remapper), and with XLA's
    clusters kept fusable (config.xla), as configured when each run starts."""

    def _call(self, run):
        if not CONFIG.grappler:
            with tfp.function_call_config(tfp.disable_grappler):
                return super()._call(run)
        changes = [m for m, on in ((_no_arithmetic_rewrites, not CONFIG.arithmetic_optimizer),
                                   (_no_remapping, not CONFIG.remapper),
                                   (xla.keep_fusable, CONFIG.xla)) if on]
        if not changes:
            return super()._call(run)

        def mutate(config):
            for change in changes:
                change(config)
        with tfp.function_call_config(mutate):
            return super()._call(run)


# ------------------------------------------------------------------------------------ data
def _rec_sig(rec):
    return (rec.op_type, rec.attrs, rec.inputs, rec.route == "function", rec.function, rec.outputs)


def path_signature(trace: Trace, units: dict) -> tuple:
    """What two traces must share to run on one generated graph."""
    return (tuple(_rec_sig(r) for r in trace.records),
            tuple(f.spec for f in trace.feeds),
            tuple(sorted((u.start, u.end) for u in units.values())))


def generalize(base: Trace, new: Trace, frozen=()):
    """`base` with every small constant whose value differs in `new` turned into a feed (a Python
    value the program changes, e.g. a mutated keep_prob); None if the traces differ otherwise or
    in nothing. Feed slots are renumbered in first-use order; values are `new`'s. A constant
    becomes a feed only where its op's output shapes do not depend on its value (`shapes_fixed`):
    elsewhere each value keeps its own path; nor inside the record spans `frozen` (units whose
    Python read tensor values: their constants may be made from those values)."""
    if len(base.records) != len(new.records):
        return None
    feeds, values, records = [], [], []
    by_base, by_new, by_const = {}, {}, {}
    changed = fed_constant = False

    def slot_for(key_map, key, spec, source, value):
        s = key_map.get(key)
        if s is None:
            s = key_map[key] = len(feeds)
            feeds.append(Feed(s, spec, source))
            values.append(value)
        return s

    def merge_ref(b, n):
        nonlocal changed, fed_constant
        if isinstance(b, FeedRef) and isinstance(n, FeedRef):
            spec = base.feeds[b.slot].spec
            if spec != new.feeds[n.slot].spec:
                return None
            s1 = slot_for(by_base, b.slot, spec, new.feeds[n.slot].source, new.feed_values[n.slot])
            if by_new.setdefault(n.slot, s1) != s1:
                return None
            return FeedRef(s1)
        if b == n:
            return b
        if isinstance(n, ConstRef) and n.dtype != "string":
            shape = tuple(np.shape(n.value))
            if isinstance(b, ConstRef) and b.dtype == n.dtype and tuple(np.shape(b.value)) == shape:
                changed = fed_constant = True
                # equal value pairs share a slot (one Python value used by forward and backward)
                return FeedRef(slot_for(by_const, (b.value, n.value, n.dtype),
                                        TensorSpec(n.dtype, shape), "python-constant", n.value))
            if isinstance(b, FeedRef) and base.feeds[b.slot].source == "python-constant" and \
                    base.feeds[b.slot].spec == TensorSpec(n.dtype, shape):
                sl = slot_for(by_base, b.slot, base.feeds[b.slot].spec, "python-constant", n.value)
                fed_constant = True
                return FeedRef(sl) if _same_constant(values[sl], n.value, n.dtype) else None
        return None

    def spec_of(ref):
        if isinstance(ref, OutputRef):
            return base.records[ref.record].outputs[ref.index]
        return feeds[ref.slot].spec

    for rb, rn in zip(base.records, new.records):
        if (rb.op_type, rb.attrs, rb.route == "function", rb.function, rb.outputs) != \
                (rn.op_type, rn.attrs, rn.route == "function", rn.function, rn.outputs):
            return None
        fed_constant = False
        pinned = any(a <= rb.index < b for a, b in frozen)
        inputs = []
        for ab, an in zip(rb.inputs, rn.inputs):
            if isinstance(ab, tuple) or isinstance(an, tuple):
                if not (isinstance(ab, tuple) and isinstance(an, tuple) and len(ab) == len(an)):
                    return None
                m = tuple(merge_ref(x, y) for x, y in zip(ab, an))
                if any(x is None for x in m):
                    return None
                inputs.append(m)
            else:
                m = merge_ref(ab, an)
                if m is None:
                    return None
                inputs.append(m)
        merged = replace(rb, inputs=tuple(inputs))
        if fed_constant and (pinned or not shapes_fixed(merged, spec_of)):
            return None
        records.append(merged)
    if not changed:
        return None
    return Trace(new.site, records, feeds, values, list(new.fetches), dict(new.variables),
                 list(new.unsupported), dict(new.functions), list(new.unseeded_random),
                 list(new.fast_fallbacks))


def _same_constant(value, frozen, dtype: str) -> bool:
    """Whether feed value `value` (a frozen constant, a Python or NumPy value, or an EagerTensor
    when the slot was first merged from two feeds) is the constant `frozen`, by value. `==` on a
    tensor or an array compares elementwise, and its truth value raises."""
    if isinstance(value, tfp.EagerTensorBase):
        value = value.numpy()
    try:
        return frozen_value(value, dtype) == frozen
    except (TypeError, ValueError):  # not convertible to the constant's dtype: not equal
        return False


@dataclass(eq=False)
class Path:
    signature: tuple
    trace: Trace
    units: dict
    liveouts: set = field(default_factory=set)
    fetch_points: dict = field(default_factory=dict)   # OutputRef -> earliest after_record
    outside_reads: set = field(default_factory=set)  # refs read outside coarse units
    count: int = 0
    hits: int = 0
    graph: PathGraph | None = None
    built_for: tuple = ()
    view: PythonRunner | None = None
    snapshot: Snapshot | None = None
    id: int = 0
    verified: set = field(default_factory=set)   # units whose feeds were seen identical twice

    @functools.cached_property
    def static(self) -> StaticValues:
        return StaticValues(self.trace)

    @functools.cached_property
    def early_feed(self) -> bool:
        """The path's first feed comes within its first few ops (then its run starts there)."""
        return any(isinstance(r, FeedRef) for rec in self.trace.records[:16]
                   for r in rec.input_refs())

    def usable_units(self) -> dict:
        return {s: u for s, u in self.units.items() if not u.feeds or s in self.verified}

    def absorb(self, trace: Trace, liveouts, fetches, seen_objects=None) -> None:
        for u in self.units.values():  # unit feeds must be the very same (cached) tensors
            if u.start not in self.verified and (self.count and all(
                    trace.feed_values[sl] is self.trace.feed_values[sl] for sl in u.feeds) or
                    seen_objects is not None and all(
                    seen_objects.get(id(trace.feed_values[sl])) is trace.feed_values[sl]
                    for sl in u.feeds)):
                self.verified.add(u.start)
                self.view = None
        self.count += 1
        self.liveouts |= set(liveouts)
        for f in fetches:
            if f.ref.record < len(self.trace.records):
                prev = self.fetch_points.get(f.ref)
                self.fetch_points[f.ref] = f.after_record if prev is None else min(prev, f.after_record)
                if not f.in_unit:
                    self.outside_reads.add(f.ref)

    def absorb_fetch(self, ref, after_record: int) -> None:
        """A value Python read outside units, in an iteration that fell back at that read."""
        prev = self.fetch_points.get(ref)
        self.fetch_points[ref] = after_record if prev is None else min(prev, after_record)
        self.outside_reads.add(ref)

    @property
    def stale(self) -> bool:
        return self.graph is None or self.built_for != self.build_key()

    def build_key(self) -> tuple:
        """What the path's graph depends on beyond its trace."""
        return (frozenset(self.liveouts), frozenset(self.fetch_points),
                frozenset(self.outside_reads))


@dataclass(eq=False)
class Site:
    key: tuple
    label: str
    paths: dict = field(default_factory=dict)
    traces: int = 0
    fallbacks: int = 0
    known_fallbacks: int = 0              # rare ones onto a filed path: not held against the site
    last_fallback: int = 0                # iteration number of the latest fallback
    eager_reason: str | None = None
    last_path: Path | None = None
    prev_path: Path | None = None         # the path the previous iteration ended on
    successors: dict = field(default_factory=dict)  # path id -> {next path id: count}

    def note_path(self, path) -> None:
        """The iteration that just ended ran `path`: count it as the previous one's successor."""
        if self.prev_path is not None:
            nxt = self.successors.setdefault(self.prev_path.id, {})
            nxt[path.id] = nxt.get(path.id, 0) + 1
        self.prev_path = path

    def likely_next(self) -> list:
        """Path ids in the order the previous path's successors were seen most often."""
        if self.prev_path is None:
            return []
        nxt = self.successors.get(self.prev_path.id, {})
        return sorted(nxt, key=lambda i: -nxt[i])
    phase: str = "tracing"
    seen_objects: dict = field(default_factory=dict)
    site_graph: SiteGraph | None = None   # one graph for all compiled paths (>= 2 of them)
    site_graph_failed: tuple | None = None  # SiteGraph.key_of the paths whose lowering failed


@dataclass(frozen=True)
class Event:
    """One line of `terra.explain()`."""
    kind: str      # trace | graph_build | fallback | eager
    site: str
    iteration: int
    detail: str
    where: str

    def __str__(self):
        return f"[{self.kind}] {self.site} iteration {self.iteration}: {self.detail} ({self.where})"


# A fallback onto a path already filed, after at least this many iterations without one, does
# not count towards `max_fallbacks` (a fit's or a loop's epoch end: new data iterator, new path).
_KNOWN_FALLBACK_GAP = 8


# ------------------------------------------------------------------------------------ iteration
class Iteration:
    """One iteration of one site; `mode` is tracing, skip (co-execution), eager or done."""

    def __init__(self, session, site, frame, number):
        self.session = session
        self.site = site
        self.frame = frame
        self.number = number
        self.mode = "eager"
        self.recorder: ContinuingRecorder | None = None
        self.runner: PythonRunner | None = None
        self.path: Path | None = None
        self.run = None
        self.snap = None
        self.fallback_gap: int | None = None   # iterations since the site's previous fallback
        self.fetched: set = set()
        self.outputs: dict = {}
        self.tapes: list = []
        self.tape_spans: list = []   # [tape, first op, end op or None]
        self.t0 = time.perf_counter()
        self.stall = 0.0
        self.replayed: dict = {}
        self.pending = False   # finished, its graph run not yet collected (pipelined)
        self.site_run: SiteRun | None = None   # set when the iteration drives the site's SiteGraph

    def release(self) -> None:
        """Drop what a finished, collected iteration no longer needs; its values resolve from
        `outputs` and `replayed`. Its runner, run and snapshot closure refer back to it, so
        without this every iteration whose placeholders the program dropped would be cyclic
        garbage, freed only by a full collection, which CPython runs rarely in a process holding
        TF's many long-lived objects: memory grew by every run's outputs and variable snapshot
        (0.4 GB per ResNet-50 step)."""
        self.run = self.snap = self.runner = self.site_run = None

    # ---------------------------------------------------------------- graph of the iteration
    def graph(self):
        """The graph this iteration runs: the site's SiteGraph or its path's PathGraph."""
        return self.site_run.graph if self.site_run is not None else self.path.graph

    def snapshot(self) -> Snapshot:
        return self.site_run.graph.snapshot if self.site_run is not None else self.path.snapshot

    def liveouts(self):
        return self.site_run.plan.liveouts if self.site_run is not None else \
            self.path.graph.liveouts

    def use_site_graph(self, graph, plan) -> None:
        """Drive SiteGraph `graph` along `plan` (None: the path's own PathGraph)."""
        runner = self.runner
        if plan is None:
            self.site_run = None
            runner.advance = None
            return
        self.site_run = SiteRun(graph, plan, runner)
        runner.advance = self.site_run.advance

    def collect_outputs(self, fetch) -> dict:
        """Live-out values of a finished site-graph run (taken from their fetch channels)."""
        sr = self.site_run
        out = {}
        for ref in sr.plan.liveouts:
            if sr.fetchable(ref):
                out[ref] = sr.fetch(fetch, ref, CONFIG.timeout_s)
        sr.leave_unread()
        return out

    # ---------------------------------------------------------------- co-execution
    def position(self) -> int:
        if self.mode == "skip":
            return self.runner.pos
        if self.mode == "tracing" and self.recorder is not None:
            return len(self.recorder.trace.records)
        return 0

    def add_tape(self, tape) -> None:
        self.tapes.append(tape)
        self.tape_spans.append([tape, self.position(), None])

    def tape_exited(self, tape) -> None:
        for span in self.tape_spans:
            if span[0] is tape and span[2] is None:
                span[2] = self.position()

    def frame_alive(self) -> bool:
        f = sys._getframe(1)
        target = self.frame
        while f is not None:
            if f is target:
                return True
            f = f.f_back
        return False

    def put_feed(self, slot, value) -> None:
        if self.site_run is not None:  # put by the plan's events (runner.advance)
            return
        ch = self.path.graph.feed_channels[slot]
        ch.put(value._terra_materialize() if isinstance(value, Placeholder) else value)
        if CONFIG.coexecution:
            self.start_graph()  # (a no-op once started) after the put: no blocked dequeue

    def run_failed(self) -> bool:
        r = self.run
        return r is not None and r.state == "error"

    def abandon_run(self, eager_next: bool = True) -> None:
        """Stop this iteration's graph run (cancel it, or collect a finished one whose result is
        no longer wanted: the path taken next recomputes, an eager replay reports any error),
        drop its unread fetches and restore the variables it may have written."""
        s = self.session
        # Earlier iterations' runs end first (and may fail), also when this iteration's run has
        # not started, if eager ops follow (a fallback's replay must see all their writes) or
        # channels are drained (their runs must have enqueued everything). A path switch before
        # anything was put needs neither: the next run simply queues after theirs.
        if eager_next or self.run is not None or self.runner is not None and self.runner.fed:
            s.collect_pending(convert=False)
        if self.run is None:
            if self.mode == "skip" and self.runner is not None and (
                    self.runner.fed or self.site_run is not None and self.site_run.done):
                # lazy mode: nothing ran, but what Python put is queued (on a site graph the
                # next path would dequeue it)
                self.graph().drain()
            return
        if not self.run.done:
            s.runner.cancel(timeout=CONFIG.timeout_s, first=self.run)
        else:
            try:
                s.runner.result(timeout=CONFIG.timeout_s, run=self.run)
            except Exception:  # noqa: BLE001 - see the docstring
                pass
        self.graph().drain()
        if self.snap is not None:  # None: the run never started, so it wrote nothing
            self.snapshot().restore(self.snap)
        self.run = None
        self.snap = None

    def start_graph(self) -> None:
        """Queue this iteration's run; right before it starts (after every earlier run ended)
        the worker snapshots the variables it may write, for a fallback to restore."""
        if self.run is None:
            graph, snap = self.graph(), self.snapshot()
            self.snap = None

            def snapshot():
                self.snap = snap.take()
            self.run = self.session.runner.start(graph.concrete, before=snapshot,
                                                 config=graph.run_config)

    def resolve(self, ref: OutputRef):
        """Value of a placeholder of this iteration (a Python sync point)."""
        s = self.session
        with s.internal():
            if self.mode == "skip":
                v = self.path.static.get(ref)  # a shape the path fixes: no need to wait
                if v is not None:
                    self.runner.log_fetch(ref)
                    s.static_reads += 1
                    return v
            if self.mode == "skip" and s.pending:
                s.collect_pending()  # our run comes after theirs anyway; may fall back
            if self.mode == "skip":
                sr = self.site_run
                if sr is not None:
                    ch = sr.fetchable(ref) or None
                else:
                    graph = self.path.graph
                    ch = graph.fetch_channels.get(ref)
                if ch is not None and ref not in self.fetched:
                    self.start_graph()
                    t = time.perf_counter()
                    try:
                        if sr is not None:
                            v = sr.fetch(s.runner.fetch, ref, CONFIG.timeout_s)
                        else:
                            for _ in range(graph.stale.pop(ref, 0)):  # earlier runs' unread
                                s.runner.fetch(ch, timeout=CONFIG.timeout_s)
                            v = s.runner.fetch(ch, timeout=CONFIG.timeout_s)
                    except tf.errors.OpError:
                        v = None
                    finally:
                        dt = time.perf_counter() - t
                        self.stall += dt
                        s.python_stall_s += dt
                    if v is not None:
                        self.fetched.add(ref)
                        self.runner.log_fetch(ref)
                        return v
                    self.fallback(Divergence(user_line(), "a value", "a graph error",
                                             self.runner.pos, "graph error"))
                else:
                    self.runner.log_fetch(ref)  # the next graph fetches it
                    if sr is None and ref.record < len(self.path.trace.records):
                        # this path's next build fetches it too: a value Python read once
                        # (every tenth step, say) is read again, and then needs no fallback
                        self.path.absorb_fetch(ref, self.runner.pos)
                    self.fallback(Divergence(user_line(), "no fetch", f"fetch of %{ref.record}",
                                             self.runner.pos, "value needed by Python that the "
                                             "graph does not fetch"))
                return self.replayed[(ref.record, ref.index)]
            if self.pending:
                v = self._early_liveout(ref) if self.site_run is None else \
                    self._early_site_liveout(ref)
                if v is not None:
                    return v
                s.collect_pending()
            v = self.outputs.get(ref)
            if v is None:
                v = self.replayed.get((ref.record, ref.index))
            if v is None:
                raise TerraRuntimeError(f"terra: the value of op #{ref.record} of iteration "
                                        f"{self.number} at {self.site.label} was not kept")
            return v

    def unit_read(self, ref):
        """The value a skipped unit's Python would read at `ref` now (GradUnit.reads): a feed's
        value (UNSET: a feed the unit supplies itself, as recorded), what Python already has,
        a value the path fixes, or a fetch; None if the graph does not fetch it."""
        runner = self.runner
        if isinstance(ref, FeedRef):
            v = runner.fed.get(ref.slot)
            if v is None:
                return UNSET
            return np.asarray(v._terra_materialize() if isinstance(v, Placeholder) else v)
        ph = runner.placeholders.get((ref.record, ref.index))
        if ph is not None and ph.is_materialized:
            return ph.numpy()
        v = self.path.static.get(ref)
        if v is not None:
            return np.asarray(v)
        sr = self.site_run
        fetchable = sr.fetchable(ref) if sr is not None else \
            ref in self.path.graph.fetch_channels
        if not fetchable or ref in self.fetched:
            return None
        return runner._placeholder(self.path.trace.records[ref.record], ref.index).numpy()

    def _early_site_liveout(self, ref):
        """`_early_liveout` on a SiteGraph: this iteration's elements precede those of later
        runs in the channel, and what it takes now is counted for its collection."""
        sr, s = self.site_run, self.session
        if ref not in sr.plan.liveouts or not sr.fetchable(ref):
            return None
        t = time.perf_counter()
        try:
            v = sr.fetch(s.runner.fetch, ref, CONFIG.timeout_s)
        except tf.errors.OpError:
            return None  # its run failed: collecting it reports the error
        finally:
            s.python_stall_s += time.perf_counter() - t
        self.outputs[ref] = v
        return v

    def _early_liveout(self, ref):
        """A value this finished iteration left to the program, read from its fetch channel
        while its run may still be going (None: not there any more; wait for the run)."""
        graph = self.path.graph
        ch = graph.fetch_channels.get(ref)
        v = self.outputs.get(ref)
        if v is not None or ch is None or ref in self.fetched or not graph.stale.get(ref):
            return v
        s = self.session
        t = time.perf_counter()
        try:
            for _ in range(graph.stale[ref] - 1):  # older iterations' unread values
                s.runner.fetch(ch, timeout=CONFIG.timeout_s)
            v = s.runner.fetch(ch, timeout=CONFIG.timeout_s)
        except tf.errors.OpError:
            return None  # its run failed: collecting it reports the error
        finally:
            s.python_stall_s += time.perf_counter() - t
        graph.stale[ref] = 0
        self.fetched.add(ref)
        self.outputs[ref] = v
        return v

    def switch(self, d: Divergence, at_end: bool = False, tried=None, accepts=None) -> bool:
        """Restart the iteration on another compiled path that agrees with the current one on
        every op matched so far (a branch both paths were traced through): cancel the graph,
        restore the variables, start the other graph and feed it what Python fed so far.
        Placeholders keep their refs (the prefixes are equal). False if there is none.

        On a SiteGraph, a path whose plan agrees with the current one before op `pos` (same
        nodes, same selects, conds and feeds put) is taken without touching the run: a seamless
        switch (`case_switches`). `accepts(q)`: whether path `q` can take what Python does at
        `pos` (paths that cannot are not tried: each restart costs a variable restore)."""
        runner, cur, pos = self.runner, self.path, self.runner.pos
        prefix = cur.signature[0][:pos]
        fed_specs = [cur.trace.feeds[sl].spec for sl in sorted(runner.fed)]
        tried = set() if tried is None else tried
        tried.add(id(cur))
        candidates = []
        for q in self.site.paths.values():
            if id(q) in tried or q.graph is None or q.stale or q.view is None:
                continue
            if at_end and q.view.n != pos or not at_end and q.view.n <= pos:
                continue
            if q.signature[0][:pos] != prefix:
                continue
            if [q.trace.feeds[sl].spec for sl in sorted(runner.fed) if sl < len(q.trace.feeds)] \
                    != fed_specs:
                continue
            if {u.start for u in cur.units.values() if u.end <= pos} != \
                    {u.start for u in q.units.values() if u.end <= pos}:
                continue
            if accepts is not None and not accepts(q):
                continue
            candidates.append(q)
        sr = self.site_run
        if sr is not None:
            sg = sr.graph
            for q in candidates:
                plan = sg.plan_of(q)
                if plan is not None and sr.done == sr.plan.count_before(pos) and \
                        sr.plan.agrees(plan, pos):
                    tried.add(id(q))
                    sr.plan = plan
                    self.path = q
                    runner.view = q.view
                    s = self.session
                    s.case_switches += 1
                    s._event("case_switch", self.site, self.number, f"p{cur.id} -> p{q.id} at "
                             f"op #{pos} in the site graph: {d.reason}", d.location)
                    return True
        for q in candidates:
            tried.add(id(q))
            s = self.session
            with s.internal():
                self.abandon_run(eager_next=False)
                if s.deferred_error is not None:  # an earlier iteration failed: fall back
                    return False
                self.run = None
                self.path = q
                runner.view = q.view
                sg = sr.graph if sr is not None else None
                self.use_site_graph(sg, sg.plan_of(q) if sg is not None else None)
                if self.site_run is not None:
                    self.site_run.advance(pos)
                else:
                    for slot in runner.fed_order:
                        self.put_feed(slot, runner.fed[slot])
                self.fetched = set()
                if CONFIG.coexecution and (self.site_run is not None or runner.fed_order or
                                           not q.early_feed):
                    self.start_graph()
            s.switches += 1
            s._event("switch", self.site, self.number, f"p{cur.id} -> p{q.id} at op #{pos}: "
                     f"{d.reason}", d.location)
            return True
        return False

    def fallback(self, d: Divergence):
        """Leave skip mode (see terra/runtime/fallback.py); returns the recorder now active."""
        s = self.session
        runner = self.runner
        runner.skipping = False
        s.count_fallback(self, d)
        with s.internal():
            self.abandon_run()
            self.use_site_graph(None, None)
            self.mode = "done"  # until the replay succeeded
            watches: dict = {}
            pre_watch: dict = {}
            for tape in self.tapes:
                now, later = tape._terra_rewatch(
                    lambda ph: (lambda r: None if r is None else (r.record, r.index))(
                        placeholder_ref(ph, runner)))
                pre_watch[tape] = now
                for key in later:
                    watches.setdefault(key, []).append(tape)
            replay = EagerReplay(self.path.trace, runner.fed, self.tape_spans, watches, pre_watch)
            try:
                env = replay.run(runner.pos)
            except tf.errors.OpError as e:  # the op raises as in eager; say which one it is
                raise _with_location(e, self, replay.at) from None
            self.replayed = env
            bind_placeholders(runner.placeholders, env)
            rec = ContinuingRecorder(self.site.label, CONFIG.max_trace_ops)
            rec.seed(self.path.trace, runner.pos, runner.fed, env, runner.placeholders,
                     self.path.units, runner.fetch_log, replay, runner.born)
            runner.placeholders = {}
            for handle, variable in runner.handles.values():
                rec.variable_handle(variable, handle)
            _set_active(None)
            rec.start(self.frame)
            _set_active(None)  # internal() hands ops to the recorder when Terra's work is done
            rec._keep = None
            self.recorder = rec
            self.mode = "tracing"
        s.raise_deferred()
        return rec

    # ---------------------------------------------------------------- end
    def extended_elsewhere(self) -> bool:
        """Another path of the site goes on where this one ended, with the same ops so far: an
        op after the end is then that path's next op (a GAN's generator step after its last
        critic step, first traced when its optimizer created slots), not the program leaving
        the loop, and the iteration falls back to trace it instead of ending."""
        pos = self.runner.pos
        prefix = self.path.signature[0][:pos]
        return any(q is not self.path and len(q.signature[0]) > pos and
                   q.signature[0][:pos] == prefix for q in self.site.paths.values())

    def finish_past_end(self, d: Divergence) -> None:
        """The program issued an op after the last op of the path (typically: the training loop
        is over): end the iteration here; that op and the next ones run eagerly, outside any
        iteration, until the next tape."""
        s = self.session
        s._event("end", self.site, self.number, f"iteration ended by {d.observed} after the "
                 f"last op of the path; following ops run eagerly", d.location)
        with s.internal():
            self.finish()
        s.collect_pending()  # the next ops run eagerly

    def finish(self) -> None:
        """End the iteration (the next __enter__, reset, or leaving the site)."""
        s = self.session
        # The frame of the tape's site is needed only while the iteration runs. Once that frame
        # has returned, holding it would keep its locals (the last step's gradients, loss, tape)
        # alive: they would pass for values the program keeps (`_liveouts`, `_kept_unresolved`)
        # and be fetched every step. (A fallback from here records from the current frame.)
        self.frame = None
        if self.mode == "skip":
            if self.runner.pos < self.path.view.n and not self.switch(
                    Divergence(user_line(), "", "", self.runner.pos, "iteration ended"), True):
                if self._pure_tail():
                    self._finish_pure_tail()
                else:
                    self.fallback(Divergence(user_line(), f"{self.path.view.n} ops",
                                             f"{self.runner.pos} ops", self.runner.pos,
                                             "iteration ended early"))
            else:
                self._finish_skip()
        if self.mode == "tracing":
            self.replayed = {}  # bound placeholders keep what the program still holds
            s.finish_trace(self)
        if self.mode == "skip":
            s.python_exec_s += time.perf_counter() - self.t0 - self.stall
            self.path.hits += 1
            self.site.last_path = self.path
            self.site.note_path(self.path)
        self.mode = "done"
        _set_active(None)

    def _pure_tail(self) -> bool:
        """The iteration ends before the last ops of its path (typically ops that prepare the
        next step's data before the next tape, when the program or a benchmark harness ends the
        iteration between steps), and every op left is pure: no state, no randomness, no function
        call. Then the path's graph may compute them anyway: nothing the program holds comes
        from them, and they change nothing."""
        if self.site_run is not None or self.runner.pos == 0:
            return False
        for rec in self.path.view.records[self.runner.pos:]:
            op_def = tfp.get_op_def(rec.op_type) if rec.route != "function" else None
            if op_def is None or op_def.is_stateful:
                return False
        return True

    def _finish_pure_tail(self) -> None:
        """Finish on the path's graph (see `_pure_tail`): the feeds of the ops left get the
        values the path was traced with (the same ops ran on them eagerly), and their outputs
        are not read."""
        s, runner, trace = self.session, self.runner, self.path.trace
        with s.internal():
            for slot in range(len(trace.feeds)):
                if slot not in runner.fed:
                    runner.record_feed(slot, trace.feed_values[slot], trace.feed_values[slot])
        s.pure_tails += 1
        s._event("end", self.site, self.number, f"iteration ended {self.path.view.n - runner.pos} "
                 f"ops before the end of path p{self.path.id}; those ops are pure: the graph runs "
                 f"them on the traced feed values, unread", None)
        self._finish_skip()

    def _finish_skip(self) -> None:
        s = self.session
        if s.pending:
            s.collect_pending()  # at most one iteration in flight; may fall back (and raise)
            if self.mode != "skip":
                return
        sr = self.site_run
        if sr is not None:
            with s.internal():
                ended = sr.finish()  # the choices known only at the end
            if not ended:
                self.fallback(Divergence(user_line(), "every feed put", "a feed never supplied",
                                         self.runner.pos, "iteration ended before a feed"))
                return
        if CONFIG.coexecution and CONFIG.overlap_iterations:
            with s.internal():
                self.start_graph()
                missing = _kept_unresolved(self.runner.placeholders, set(self.liveouts()))
            if missing:
                self.fallback(Divergence(user_line(), "values kept by the graph",
                                         f"%{missing[0].record} kept by the program",
                                         self.runner.pos, "value kept past the iteration"))
                return
            if sr is None:
                self.path.graph.leave_unread(self.fetched)
            self.runner.placeholders = {}
            self.pending = True
            s.pending.append(self)
            s.overlapped += 1
            return
        with s.internal():
            self.start_graph()
            t = time.perf_counter()
            try:
                outs = s.runner.result(timeout=CONFIG.timeout_s, run=self.run)
            except tf.errors.OpError:
                outs = _FAILED
            finally:
                dt = time.perf_counter() - t
                self.stall += dt
                s.python_stall_s += dt
            if outs is _FAILED:
                self.fallback(Divergence(user_line(), "a value", "a graph error",
                                         self.runner.pos, "graph error"))
                return
            if sr is not None:
                try:
                    self.outputs = self.collect_outputs(s.runner.fetch)
                except tf.errors.OpError:  # the run finished: an element missing is a bug
                    raise TerraRuntimeError("terra: a finished site-graph run did not fetch "
                                            "every live-out value") from None
                sr.graph.drain()
            else:
                self.outputs = dict(zip(self.path.graph.liveouts, outs))
                self.path.graph.drain(self.fetched)
            missing = _kept_unresolved(self.runner.placeholders, self.outputs)
            if missing:
                self.fallback(Divergence(user_line(), "values kept by the graph",
                                         f"%{missing[0].record} kept by the program",
                                         self.runner.pos, "value kept past the iteration"))
                return
            self.runner.placeholders = {}
        self.release()


_FAILED = object()  # a run's result when it raised (a site graph's function returns None)


def _kept_unresolved(placeholders: dict, outputs: dict) -> list:
    """Refs of placeholders the program still holds whose value neither Python fetched nor the
    graph returned. Held means reachable from outside `placeholders`: a reference from another
    placeholder's attributes counts only if that one is held (Keras sets `_keras_logits` on an
    activation's output, pointing at its input: a GRU's gate logits stay referenced by a gate
    that nothing holds)."""
    inner, edges = _placeholder_edges(placeholders)
    d = {"probe": object()}
    base = None
    for _, v in d.items():
        base = sys.getrefcount(v)
    del v
    stack = []
    for key, ph in placeholders.items():  # (counting adds no reference: ids only)
        if sys.getrefcount(ph) - base > inner.get(key, 0):
            stack.append(key)
    del ph
    held = set()
    while stack:
        key = stack.pop()
        if key not in held:
            held.add(key)
            stack.extend(edges.get(key, ()))
    return [OutputRef(*key) for key in sorted(held)
            if not placeholders[key].is_materialized and OutputRef(*key) not in outputs]


def _placeholder_edges(placeholders: dict):
    """(references to each placeholder from others' attributes, key -> keys it references)."""
    keys = {id(ph): key for key, ph in placeholders.items()}
    inner, edges = {}, {}
    for key, ph in placeholders.items():
        for v in _attribute_values(ph):
            k = keys.get(id(v))
            if k is not None and v is placeholders[k]:
                inner[k] = inner.get(k, 0) + 1
                edges.setdefault(key, []).append(k)
    return inner, edges


def _attribute_values(obj):
    """Values of `obj`'s instance attributes, and of tuples/lists among them (one level)."""
    for v in getattr(obj, "__dict__", {}).values():
        if isinstance(v, (tuple, list)):
            yield from v
        else:
            yield v


def _with_location(error, it, index, late=False):
    """`error` (an OpError) re-made with the recorded op and source line that raised it; `late`:
    it belongs to an iteration the program has already left."""
    rec = it.path.trace.records[index] if index is not None else None
    if rec is None:
        return error
    extra = (f"terra: raised by op #{index} {rec.function or rec.op_type} recorded at "
             f"{rec.location.describe()} in iteration {it.number} at {it.site.label}")
    if late:
        extra += "; it ran after that iteration's last sync point, so it surfaces here"
    return extended_error(error, extra, index)


def _liveouts(recorder) -> set:
    """Refs of recorded tensors the program still holds at the end of the iteration."""
    d = {0: (object(), None)}
    base = None
    for t, _ in d.values():
        base = sys.getrefcount(t)
    out = set()
    for t, ref in recorder._produced.values():
        if sys.getrefcount(t) > base:
            out.add(ref)
    return out


# ------------------------------------------------------------------------------------ session
class Session:
    """Process-wide state (one user thread is co-executed at a time)."""

    def __init__(self):
        self.sites: dict = {}
        self.iteration: Iteration | None = None
        self.events: list = []
        self.traces = 0
        self.fallbacks = 0
        self.graph_builds = 0
        self.switches = 0
        self.case_switches = 0
        self.pure_tails = 0
        self.overlapped = 0
        self.static_reads = 0
        self.python_exec_s = 0.0
        self.python_stall_s = 0.0
        self.iterations = 0
        self._installed = False
        self._graphs: list = []
        self.runner = _Runner(error_context=self._error_context)
        self._warned: set = set()
        self._depth = 0
        self._layer_depth = 0
        self.pending: list = []          # finished iterations whose runs are not collected yet
        self.owner: int | None = None    # the thread whose tapes Terra runs (threading ident)
        self._foreign_warned: set = set()
        self.deferred_error = None       # an earlier iteration's error, raised at a sync point
        self._tape_functions: dict = {}   # forward function name -> TapeRecordedFunction
        self._function_ops: dict = {}     # function name -> op types in its body

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def internal(self):
        """Run Terra's own TF calls without interception; afterwards route ops to whatever the
        current iteration needs (it may have changed inside)."""
        self._depth += 1
        _set_active(None)
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                _set_active(self._interceptor())

    def _interceptor(self):
        it = self.iteration
        if it is None:
            return None
        if it.mode == "skip":
            return it.runner
        if it.mode == "tracing" and it.recorder is not None and it.recorder.recording:
            return it.recorder
        return None

    def _error_context(self, index):
        it = self.iteration
        if it is not None and it.site_run is not None:  # site-graph ops are named by node id
            index = it.site_run.plan.first_record.get(index)
            if index is None:
                return None
        if it is None or it.path is None or index >= len(it.path.trace.records):
            return None
        rec = it.path.trace.records[index]
        return (f"terra: raised by op #{index} {rec.function or rec.op_type} recorded at "
                f"{rec.location.describe()}")

    def foreign(self) -> bool:
        """Is the calling thread not the one Terra co-executes? One thread's iterations run at a
        time (the hook intercepts one thread; an iteration's state is not shared): the first
        thread to enter a Terra tape owns the session until it ends (`end_iteration()`,
        `reset()`, or the thread exits), and Terra tapes on other threads are plain tapes.
        An owner that has exited hands over here: its last iteration is finished first."""
        me = threading.get_ident()
        owner = self.owner
        if owner is None or owner == me:
            return False
        if any(t.ident == owner for t in threading.enumerate()):
            return True
        try:
            self.end()  # the owner's last iteration, which nothing else will finish
        except Exception as e:  # noqa: BLE001 - its thread is gone: say so, do not raise here
            warnings.warn(f"terra: the last iteration of an exited thread raised "
                          f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
        return False

    def _note_foreign(self, frame) -> None:
        me = threading.get_ident()
        if me in self._foreign_warned:
            return
        self._foreign_warned.add(me)
        name = threading.current_thread().name
        where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        self.events.append(Event("eager", where, 0, f"thread {name!r}: its Terra tapes run as "
                                 f"plain tapes (Terra co-executes one thread at a time; another "
                                 f"thread's iterations are running)", ""))
        warnings.warn(f"terra: tapes on thread {name!r} run eagerly: Terra co-executes one "
                      f"thread at a time and another thread holds it (see terra.explain())",
                      RuntimeWarning, stacklevel=4)

    def _event(self, kind, site, it_number, detail, where=""):
        e = Event(kind, site.label, it_number, detail, where or "")
        self.events.append(e)
        if CONFIG.verbose:
            print(f"terra: {e}")

    def count_fallback(self, it, d: Divergence) -> None:
        self.fallbacks += 1
        it.site.fallbacks += 1
        it.fallback_gap = it.number - it.site.last_fallback
        it.site.last_fallback = it.number
        self._event("fallback", it.site, it.number, f"{d.reason}: expected {d.expected}, "
                    f"observed {d.observed} (op #{d.position})", d.location)

    def _ensure_hook(self):
        if not self._installed:
            hook.install()
            self._installed = True
            hook.route_units(_route_unit)

    # ---------------------------------------------------------------- pipelined iterations
    def collect_pending(self, convert: bool = True) -> None:
        """Wait for the runs of finished iterations (oldest first) and keep their outputs.

        A failed run is an op error of an iteration the program has already left: the later runs
        are cancelled, every variable goes back to that iteration's start, and its ops are
        replayed eagerly, so the error is raised by the same op as in eager and leaves the
        variables exactly as eager leaves them. The error is then raised at this sync point; with
        `convert` the current iteration first falls back (its ops so far run eagerly)."""
        while self.pending:
            self._collect(self.pending[0])
        if self.deferred_error is not None and convert:
            it = self.iteration
            if it is not None and it.mode == "skip":
                it.fallback(Divergence(user_line(), "no error", "an error of an earlier "
                                       "iteration", it.runner.pos, "graph error of the "
                                       "previous iteration"))
            self.raise_deferred()

    def raise_deferred(self) -> None:
        e, self.deferred_error = self.deferred_error, None
        if e is not None:
            raise e

    def _collect(self, it) -> None:
        try:
            with self.internal():
                outs = self.runner.result(timeout=CONFIG.timeout_s, run=it.run)
        except tf.errors.OpError:
            outs = _FAILED
        finally:
            self.pending.remove(it)
            it.pending = False
        if outs is not _FAILED:
            with self.internal():
                if it.site_run is not None:
                    it.outputs = it.collect_outputs(self.runner.fetch)
                else:
                    it.outputs = dict(zip(it.path.graph.liveouts, outs))
                it.graph().drop_stale()
            it.release()
            return
        with self.internal():
            cur = self.iteration
            later = [x for x in self.pending + [cur] if x is not None and x is not it and
                     (x in self.pending or x.mode == "skip") and x.run is not None]
            self.runner.cancel(timeout=CONFIG.timeout_s, first=it.run)
            for x in reversed(later):  # newest first: back to the failed iteration's start
                if x.snap is not None:
                    x.snapshot().restore(x.snap)
                x.run, x.snap = None, None
            for x in later:
                if x in self.pending:
                    self.pending.remove(x)
                    x.pending = False
            for g in self._graphs:
                g.drain()
            if it.snap is not None:
                it.snapshot().restore(it.snap)
            rp = EagerReplay(it.path.trace, it.runner.fed)
            try:
                rp.run(len(it.path.trace.records))
                error = None
            except tf.errors.OpError as e:
                error = e
            it.outputs = {r: rp.env[(r.record, r.index)] for r in it.liveouts()
                          if (r.record, r.index) in rp.env}
        self.fallbacks += 1
        it.site.fallbacks += 1
        self._event("fallback", it.site, it.number, "the graph run failed after the iteration's "
                    "last sync point; replayed eagerly" + (f": {type(error).__name__}"
                                                           if error is not None else ""))
        if error is not None and self.deferred_error is None:
            self.deferred_error = _with_location(error, it, rp.at, late=True)

    # ---------------------------------------------------------------- tapes
    def tape_enter(self, tape, frame) -> None:
        if not CONFIG.enabled or not tf.executing_eagerly():  # in a tf.function: a plain tape
            return
        if self.foreign():
            self._note_foreign(frame)
            return
        self.owner = threading.get_ident()
        key = (frame.f_code, frame.f_lasti)
        it = self.iteration
        if it is not None and it.mode != "done":
            if key != it.site.key and it.frame_alive():
                it.add_tape(tape)
                return
            with held_interrupts(), self.internal():  # the step Python left completes first
                it.finish()
        site = self.sites.get(key)
        if site is None:
            label = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
            site = self.sites[key] = Site(key, label)
        self._begin(site, frame, tape)

    def _begin(self, site, frame, tape) -> None:
        self._ensure_hook()
        _set_active(None)
        if self.pending and (site.eager_reason is not None or self._predict(site) is None):
            with held_interrupts():  # ops of this iteration run eagerly: earlier runs end first
                self.collect_pending()
        self.iterations += 1
        it = Iteration(self, site, frame, self.iterations)
        it.add_tape(tape)
        self.iteration = it
        if site.eager_reason is not None:
            site.phase = "eager"
            it.mode = "eager"
            return
        path = self._predict(site)
        if path is not None:
            site.phase = "coexecution"
            it.mode = "skip"
            it.path = path
            it.runner = PythonRunner(it, path.view)
            sg = site.site_graph
            if sg is not None and CONFIG.site_graph:
                it.use_site_graph(sg, sg.plan_of(path))
            if CONFIG.coexecution and (it.site_run is not None or not path.early_feed):
                it.start_graph()  # else at the first feed: a feed of another signature (the
                # next batch has another shape) then switches paths without a run to cancel
            _set_active(it.runner)
            return
        site.phase = "tracing"
        it.mode = "tracing"
        rec = ContinuingRecorder(site.label, CONFIG.max_trace_ops)
        rec.start(frame)
        it.recorder = rec

    def _predict(self, site):
        """The compiled path this iteration most likely takes: the previous path's most
        frequent compiled successor (a read every tenth step, an epoch's end, a rare branch are
        followed by the common path again), else the last compiled path run."""
        by_id = None
        for i in site.likely_next():
            if by_id is None:
                by_id = {q.id: q for q in site.paths.values()}
            q = by_id.get(i)
            if q is not None and q.graph is not None and not q.stale:
                return q
        p = site.last_path
        if p is not None and p.graph is not None and not p.stale:
            return p
        for p in reversed(list(site.paths.values())):
            if p.graph is not None and not p.stale:
                return p
        return None

    def tape_exit(self, tape, exc_type) -> None:
        it = self.iteration
        if it is None or self.foreign():
            return
        if tape in it.tapes:
            it.tape_exited(tape)
        if exc_type is None or it.mode != "skip":
            return
        it.fallback(Divergence(user_line(), "no exception", exc_type.__name__, it.runner.pos,
                               "exception in the iteration"))

    # ---------------------------------------------------------------- gradient unit
    def guard_ref(self, it, x):
        if x is None:
            return None
        if it.mode == "skip":
            r = placeholder_ref(x, it.runner)
            if r is not None:
                return r
            if isinstance(x, Placeholder):
                x = x._terra_materialize()
            v = _var_ref(x)
            if v is not None:
                return v
            for slot, oid in it.runner.fed_ids.items():
                if oid == id(x):
                    return FeedRef(slot)
            return ("external", id(x))
        rec = it.recorder
        r = rec.ref_of(x)
        if r is not None:
            return r
        v = _var_ref(x)
        if v is not None:
            return v
        if isinstance(x, Placeholder):
            x = x._terra_materialize()
        e = rec._feeds.get(id(x))
        if e is not None and e[0] is x:
            return e[1]
        return ("external", id(x))

    def gradient(self, tape, target, sources, output_gradients, unconnected_gradients):
        base = tfp.PlainGradientTape.gradient
        it = self.iteration
        if it is None or it.mode not in ("skip", "tracing") or tape not in it.tapes or \
                self.foreign():
            return base(tape, real_values(target), real_values(sources), real_values(output_gradients),
                        unconnected_gradients)
        flat_args = (tf.nest.flatten(target) + ["|"] + tf.nest.flatten(sources) + ["|"] +
                     tf.nest.flatten(output_gradients) + ["|"] + list(tape._terra_watched))
        if it.mode == "skip":
            guard = tuple(a if isinstance(a, str) else self.guard_ref(it, a) for a in flat_args) + \
                (str(unconnected_gradients), tape._watch_accessed_variables)
            try:
                with self.internal():
                    flat = it.runner.gradient_unit(guard)
                    unit = it.runner.last_unit
                if unit.structure is not None:
                    return tf.nest.pack_sequence_as(unit.structure, flat, expand_composites=True)
                return tf.nest.pack_sequence_as(sources, flat)
            except Diverged as d:
                it.fallback(d.divergence)
        rec = it.recorder
        target, sources, output_gradients = (real_values(target), real_values(sources),
                                             real_values(output_gradients))
        guard = tuple(a if isinstance(a, str) else self.guard_ref(it, a) for a in flat_args) + \
            (str(unconnected_gradients), tape._watch_accessed_variables)
        start = len(rec.trace.records)
        with _unit_python(rec, tf_constants=True) as reads:
            result = base(tape, target, sources, output_gradients, unconnected_gradients)
        end = len(rec.trace.records)
        with _terra_reads(it):
            flat = tf.nest.flatten(result, expand_composites=True)
            composite = len(flat) != len(tf.nest.flatten(result))
            structure = _shape_of(result) if composite else None
        refs = []
        usable = not any(isinstance(g, tuple) for g in guard[:-2] if g is not None)
        for g in flat:
            if g is None:
                refs.append(None)
                continue
            r = rec.ref_of(g) if isinstance(g, tfp.EagerTensorBase) else None
            if r is None:
                usable = False
            refs.append(r)
        if usable and not rec.too_long:
            rec.units[start] = GradUnit(start, end, guard, tuple(refs),
                                        structure=structure, reads=tuple(reads))
        return result

    def apply_gradients(self, opt, original, grads_and_vars):
        """`optimizer.apply_gradients` as one coarse unit (guarded on the optimizer object, its
        plain Python settings, the gradients' producers and the variables)."""
        it = self.iteration
        pairs = list(grads_and_vars)
        if it is None or it.mode not in ("skip", "tracing") or not getattr(opt, "built", False):
            return original(opt, pairs)
        settings = tuple((k, v) for k, v in vars(opt).items()
                         if isinstance(v, (bool, int, float, str, type(None))))
        with _terra_reads(it):
            flat = tf.nest.flatten([g for g, _ in pairs], expand_composites=True) + \
                ["|"] + [v for _, v in pairs]
        if it.mode == "skip":
            guard = (id(opt), settings) + tuple(
                x if isinstance(x, str) else self.guard_ref(it, x) for x in flat)
            try:
                with self.internal():
                    it.runner.gradient_unit(guard)
                return opt.iterations
            except Diverged as d:
                it.fallback(d.divergence)
        rec = it.recorder
        with _terra_reads(it):
            pairs = [(real_values(g), v) for g, v in pairs]
            flat = [x._terra_materialize() if isinstance(x, Placeholder) else x for x in flat]
        guard = (id(opt), settings) + tuple(
            x if isinstance(x, str) else self.guard_ref(it, x) for x in flat)
        start = len(rec.trace.records)
        with _unit_python(rec, tf_constants=True) as reads:
            result = original(opt, pairs)
        usable = not any(isinstance(g, tuple) for g in guard[2:] if g is not None)
        if usable and not rec.too_long:
            rec.units[start] = GradUnit(start, len(rec.trace.records), guard, (),
                                        reads=tuple(reads))
        return result

    def layer_call(self, layer, original, args, kwargs):
        """A built-in Keras layer call as one coarse unit (guarded on the layer object, its plain
        Python settings, the inputs' producers and plain arguments). User-defined layers and
        models run op by op: their Python may do anything."""
        it = self.iteration
        if it is None or it.mode not in ("skip", "tracing") or self._layer_depth or \
                not getattr(layer, "built", False) or \
                not type(layer).__module__.startswith(tfp.KERAS_BUILTIN_LAYER_MODULES):
            return original(layer, *args, **kwargs)
        settings = tuple((k, v) for k, v in vars(layer).items()
                         if isinstance(v, (bool, int, float, str, type(None))))
        flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True)

        def guard_of(x):
            if isinstance(x, (bool, int, float, str, type(None))):
                return ("value", x)
            return self.guard_ref(it, x)

        if it.mode == "skip":
            unit = it.runner.view.units.get(it.runner.pos)
            guard = (id(layer), settings) + tuple(guard_of(x) for x in flat)
            if unit is not None and unit.guard == guard:
                try:
                    with self.internal():
                        out = it.runner.gradient_unit(guard)
                    return tf.nest.pack_sequence_as(unit.structure, out, expand_composites=True)
                except Diverged:  # a value the layer's Python read differs: its ops decide
                    pass
            self._layer_depth += 1  # no unit here: match the layer's ops one by one
            try:
                return original(layer, *args, **kwargs)
            finally:
                self._layer_depth -= 1
        rec = it.recorder
        guard = (id(layer), settings) + tuple(
            guard_of(x._terra_materialize() if isinstance(x, Placeholder) else x) for x in flat)
        start = len(rec.trace.records)
        self._layer_depth += 1
        try:
            with _unit_python(rec) as reads:
                result = original(layer, *args, **kwargs)
        finally:
            self._layer_depth -= 1
        with _terra_reads(it):
            outs = tf.nest.flatten(result, expand_composites=True)
            structure = _shape_of(result)
        refs = [rec.ref_of(t) if isinstance(t, tfp.EagerTensorBase) else None for t in outs]
        usable = (not any(isinstance(g, tuple) and g[0] == "external" for g in guard[2:])
                  and all(r is not None for r in refs)
                  and not any(hasattr(t, "_keras_mask") for t in outs)
                  and not rec.too_long and len(rec.trace.records) > start)
        if usable:
            rec.units[start] = GradUnit(start, len(rec.trace.records), guard, tuple(refs),
                                        structure=structure, reads=tuple(reads))
        return result

    def function_call(self, fn, original, args, kwargs):
        """A `tf.function` call as one coarse unit, guarded on the function object, its plain
        Python arguments by value, its tensor arguments by producer (or feed slot), and whether a
        tape may record. Skip mode returns placeholders for the recorded outputs without calling
        TF (which would materialize placeholder arguments, and under a tape call `__forward_f`
        where the path may say otherwise); another guard diverges cleanly before the call."""
        it = self.iteration
        if it is None or self._depth or hook.active() is None or not tf.executing_eagerly() \
                or tfp.function_runs_eagerly(fn):  # Terra's own calls, graphs, eager debugging
            return original(fn, *args, **kwargs)
        flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True)
        if it.mode == "skip" and it.runner.skipping:
            runner = it.runner
            mark = len(runner.fed_order)
            try:
                with self.internal():
                    guard = self._function_guard(it, fn, flat)
                    name = getattr(fn, "__name__", "?")
                    out = runner.gradient_unit(guard, f"call of tf.function {name}")
                    unit = runner.last_unit
                return tf.nest.pack_sequence_as(unit.structure, out, expand_composites=True)
            except Diverged as d:
                runner._rollback(mark)
                if runner.pos >= runner.view.n and not it.extended_elsewhere():  # the loop is over
                    with self.internal():
                        it.finish_past_end(_with_reason(d.divergence, PAST_END))
                    return original(fn, *real_values(args), **real_values(kwargs))
                it.fallback(d.divergence)
        if it.mode != "tracing" or it.recorder is None or not it.recorder.recording or \
                it.recorder.in_unit:
            return original(fn, *args, **kwargs)
        rec = it.recorder
        if any(isinstance(x, Placeholder) for x in flat):  # bound after a fallback: tapes
            args, kwargs = real_values(args), real_values(kwargs)      # watch their values, not them
            flat = tf.nest.flatten((args, sorted(kwargs.items())), expand_composites=True)
        start = len(rec.trace.records)
        result = original(fn, *args, **kwargs)
        end = len(rec.trace.records)
        guard = self._function_guard(it, fn, flat)  # after the call: data arguments are feeds now
        with _terra_reads(it):
            outs = tf.nest.flatten(result, expand_composites=True)
            structure = _shape_of(result)
        refs = [rec.ref_of(t) if isinstance(t, tfp.EagerTensorBase) else None for t in outs]
        usable = (end > start and not rec.too_long
                  and not any(isinstance(g, tuple) and g[0] == "external" for g in guard[2:])
                  and all(r is not None or t is None for r, t in zip(refs, outs)))
        for r in rec.trace.records[start:end]:
            if r.route == "function":
                self._check_function_body(rec.trace, r)
            if r.route == "function" and r.function.startswith("__forward_"):
                wrapped = self._tape_functions.get(r.function)
                if wrapped is None:
                    functions = tfp.tape_functions_of(fn, r.function)
                    if functions is None:
                        usable = False  # a fallback's replay could not record its gradient
                        continue
                    wrapped = self._tape_functions[r.function] = tfp.TapeRecordedFunction(
                        rec.trace.functions[r.function], functions)
                for ref in r.inputs:
                    var = rec.trace.variables.get(ref.key) if isinstance(ref, VariableRef) \
                        else None
                    if isinstance(var, tfp.BaseResourceVariable):
                        wrapped.add_variable(var)
                rec.trace.functions[r.function] = wrapped
        if usable:
            rec.units[start] = GradUnit(start, end, guard, tuple(refs), structure=structure)
        return result

    def _check_function_body(self, trace, r) -> None:
        """What the function record `r` hides: a stateful random op (a replayed graph instantiates
        its kernels anew and draws another sequence than eager) or, with an output whose shape
        is not static, an op whose output shape depends on data (placeholders would report the
        traced shape)."""
        atomic = trace.functions.get(r.function)
        atomic = getattr(atomic, "atomic", atomic)
        if atomic is None:
            return
        body = self._function_ops.get(r.function)
        if body is None:
            body = self._function_ops[r.function] = (tfp.function_op_types(atomic),
                                                     tfp.function_outputs_static(atomic))
        types, static = body
        if types & UNSEEDED_RANDOM_OPS:
            trace.unseeded_random.append(r.index)
        if types & DATA_DEPENDENT_SHAPE_OPS and not static:
            trace.unsupported.append(f"{r.function}: ops with data-dependent output shapes")

    def _function_guard(self, it, fn, flat) -> tuple:
        """(fn, tape may record, one entry per flat argument). In skip mode a tensor argument
        that the unit at the runner's position first feeds is fed here (data passed straight to
        the function)."""
        unit = it.runner.view.units.get(it.runner.pos) if it.mode == "skip" else None
        want = unit.guard if unit is not None and len(unit.guard) == len(flat) + 2 and \
            unit.guard[0] is fn else None
        out = [fn, tfp.could_possibly_record()]
        for i, x in enumerate(flat):
            if want is not None and isinstance(x, Placeholder) and \
                    placeholder_ref(x, it.runner) is None:
                x = x._terra_materialize()  # an earlier iteration's value: external data now
            if isinstance(x, (bool, int, float, str, bytes, type(None))):
                out.append(("value", type(x).__name__, x))
                continue
            if not isinstance(x, (tfp.Tensor, tfp.BaseResourceVariable)) and \
                    _var_ref(x) is None:
                out.append(("external", type(x).__name__))
                continue
            g = self.guard_ref(it, x)
            if isinstance(g, tuple) and want is not None and isinstance(want[i + 2], FeedRef) \
                    and isinstance(x, tfp.EagerTensorBase) and want[i + 2].slot not in \
                    it.runner.fed:
                it.runner._feed(want[i + 2].slot, x, x)
                g = want[i + 2]
            out.append(g)
        return tuple(out)

    def force_eager(self, what: str) -> None:
        """Something Terra does not compile (e.g. tape.jacobian): run it eagerly, untraced."""
        it = self.iteration
        if it is None or self.foreign():
            return
        if it.mode == "skip":
            it.fallback(Divergence(user_line(), "a compiled op", what, it.runner.pos,
                                   f"{what} runs eagerly"))
        if it.mode == "tracing":
            it.recorder.trace.unsupported.append(f"{what} is not compiled")

    # ---------------------------------------------------------------- traces
    def finish_trace(self, it) -> None:
        rec = it.recorder
        trace = rec.stop()
        live = _liveouts(rec)
        self.traces += 1
        site = it.site
        if not trace.records:
            # no TF op ran (the program raised, or skipped the step, before its first op): no
            # evidence about the site's paths, so nothing is filed and nothing counts against it
            self._event("trace", site, it.number, "empty iteration (no TF op ran): not filed")
            return
        site.traces += 1
        units = _units_for(trace, rec.units)
        why = _uncompilable(trace, units)
        sig = path_signature(trace, units)
        path = site.paths.get(sig)
        if path is None and why is None and not _reads_feed_values(units):
            for other in list(site.paths.values()):
                if other.signature[2] != sig[2] or _uncompilable(other.trace, other.units) or \
                        _reads_feed_values(other.units):
                    continue
                g = generalize(other.trace, trace, [(u.start, u.end) for u in (
                    *units.values(), *other.units.values()) if u.reads])
                if g is not None:
                    trace = g
                    units = _units_for(g, rec.units)
                    sig = path_signature(g, units)
                    path = site.paths.get(sig)
                    if path is None:
                        path = Path(sig, trace, units, id=len(site.paths), count=other.count,
                                    liveouts=set(other.liveouts),
                                    fetch_points=dict(other.fetch_points),
                                    outside_reads=set(other.outside_reads))
                        site.paths[sig] = path
                        self._event("trace", site, it.number, f"path p{other.id} generalized "
                                    f"to p{path.id}: changing Python values become feeds")
                    break
        new = path is None
        if new:
            path = Path(sig, trace, units, id=len(site.paths))
            site.paths[sig] = path
        path.absorb(trace, live, trace.fetches, site.seen_objects)
        for v in trace.feed_values:  # tensors seen as feeds: a unit may rely on TF's cached ones
            if isinstance(v, tfp.EagerTensorBase) and v.shape.num_elements() <= 64:
                site.seen_objects[id(v)] = v
        detail = (f"new path p{path.id} ({len(trace.records)} ops, {len(trace.feeds)} feeds)"
                  if new else f"path p{path.id} seen {path.count} times")
        if why:
            detail += f"; not compilable: {why}"
        if not new and it.fallback_gap is not None and it.fallback_gap >= _KNOWN_FALLBACK_GAP:
            # a path seen before, reached after a run of compiled iterations (an epoch's end):
            # a known, bounded cost per occurrence, so it does not count towards max_fallbacks
            site.known_fallbacks += 1
            detail += "; a known path after compiled iterations: not held against max_fallbacks"
        self._event("trace", site, it.number, detail, "")
        compiled_before = any(p.graph is not None for p in site.paths.values())
        if why is None and (path.count >= 2 or compiled_before) and path.stale:
            self._build(site, path, it.number)
        elif path.view is None and path.graph is not None:
            path.view = PathView(path.trace, path.usable_units())
        for other in list(site.paths.values()):
            # a compiled path that learned a fetch in this iteration (Iteration.get: a value
            # Python read where the path's graph did not fetch it) is rebuilt now: a stale path
            # is never predicted, and might never be traced again to be rebuilt
            if other is not path and other.graph is not None and other.stale:
                self._build(site, other, it.number)
        if path.graph is not None:
            site.last_path = path
        site.note_path(path)
        if why is not None and path.count >= 2 and site.eager_reason is None and \
                self._predict(site) is None:
            self._go_eager(site, it.number, f"a repeating path cannot be compiled: {why}")
        if site.eager_reason is None and self._predict(site) is None and \
                site.traces >= CONFIG.max_traces:
            self._go_eager(site, it.number, f"{site.traces} traces without a compilable repeat"
                           + (f" (last: {why})" if why else ""))
        if site.fallbacks - site.known_fallbacks >= CONFIG.max_fallbacks and \
                site.eager_reason is None:
            self._go_eager(site, it.number, f"{site.fallbacks - site.known_fallbacks} fallbacks")

    def _go_eager(self, site, number, reason):
        site.eager_reason = reason
        self._event("eager", site, number, f"site stays eager: {reason}")
        if site.key not in self._warned:
            self._warned.add(site.key)
            warnings.warn(f"terra: {site.label} runs eagerly from now on: {reason} "
                          f"(see terra.explain())", RuntimeWarning, stacklevel=4)

    def _build(self, site, path, number):
        t = time.perf_counter()
        with self.internal():
            if path.view is None:
                path.view = PathView(path.trace, path.usable_units())
            if path.snapshot is None:
                path.snapshot = Snapshot(written_variables(path.trace))
            path.graph = PathGraph(path)
            path.built_for = path.build_key()
            self._graphs.append(path.graph)
        self.graph_builds += 1
        self._event("graph_build", site, number,
                    f"graph for path p{path.id}: {len(path.trace.records)} ops, "
                    f"{len(path.graph.feed_channels)} feeds, {len(path.graph.fetch_channels)} "
                    f"fetches, {len(path.graph.liveouts)} outputs, "
                    + (f"XLA scopes over {path.graph.xla_spans} compute spans, "
                       if path.graph.xla_spans else "")
                    + f"{time.perf_counter() - t:.2f} s")
        self._build_site_graph(site, number)

    def _build_site_graph(self, site, number) -> None:
        """(Re)build the site's SiteGraph over its compiled paths when there are two or more
        (one path keeps its cheaper PathGraph). A lowering that fails leaves the site on
        PathGraphs (said in explain())."""
        if not CONFIG.site_graph:
            return
        paths = [p for p in site.paths.values() if p.graph is not None and not p.stale and
                 p.view is not None]
        if len(paths) < 2:
            return
        key = SiteGraph.key_of(paths)
        if site.site_graph is not None and site.site_graph.built_for == key or \
                site.site_graph_failed == key:
            return
        try:
            with self.internal():
                sg = SiteGraph(paths)
        except Exception as e:  # noqa: BLE001 - the PathGraphs still run every path
            site.site_graph_failed = key
            self._event("graph_build", site, number, f"no site graph for {len(paths)} paths: "
                        f"{type(e).__name__}: {str(e)[:200]}; paths switch by restarting")
            return
        site.site_graph = sg
        self._graphs.append(sg)
        self.graph_builds += 1
        self._event("graph_build", site, number, f"site graph (switch_case / while_loop) for "
                    f"{sg.describe()}, {sg.build_seconds:.2f} s; branches switch without a "
                    f"restart")

    # ---------------------------------------------------------------- public
    def end(self) -> None:
        """Finish the open iteration (if any) and stop intercepting."""
        it = self.iteration
        try:
            with held_interrupts():
                if it is not None and it.mode != "done":
                    with self.internal():
                        it.finish()
                self.collect_pending()
        finally:
            self.iteration = None
            self.owner = None
            _set_active(None)

    def stats(self) -> dict:
        it = self.iteration
        phase = "idle"
        if it is not None:
            phase = {"skip": "coexecution", "tracing": "tracing", "eager": "eager",
                     "done": it.site.phase}[it.mode]
        with self.internal():
            stall = sum(g.stall_seconds for g in self._graphs)
        return {"traces": self.traces, "fallbacks": self.fallbacks,
                "graph_builds": self.graph_builds, "phase": phase, "path_switches": self.switches,
                "case_switches": self.case_switches, "pure_tails": self.pure_tails,
                "overlapped_iterations": self.overlapped, "static_reads": self.static_reads,
                "iterations": self.iterations,
                "python_exec_s": self.python_exec_s, "python_stall_s": self.python_stall_s,
                "graph_exec_s": self.runner.exec_seconds, "graph_stall_s": stall}

    def explain(self) -> str:
        lines = [str(e) for e in self.events]
        for site in self.sites.values():
            state = f"eager ({site.eager_reason})" if site.eager_reason else site.phase
            lines.append(f"site {site.label}: {site.traces} traces, {len(site.paths)} paths, "
                         f"{site.fallbacks} fallbacks, {state}" +
                         (f", site graph over {len(site.site_graph.paths)} paths"
                          if site.site_graph is not None and CONFIG.site_graph else ""))
        return "\n".join(lines) if lines else "terra: nothing has run yet"

    def summary(self, max_sites: int = 8) -> str:
        """One screen: totals, time in Python and in the graph, each site's state, what stayed
        eager and why, fallbacks grouped by reason."""
        s = self.stats()
        lines = [f"terra: {s['iterations']} iterations at {len(self.sites)} site(s): "
                 f"{s['traces']} traces, {s['graph_builds']} graph builds, {s['fallbacks']} "
                 f"fallbacks, {s['path_switches']} path switches",
                 f"  time: Python {s['python_exec_s']:.2f} s (of it waiting for the graph "
                 f"{s['python_stall_s']:.2f} s), graph {s['graph_exec_s']:.2f} s (of it waiting "
                 f"for Python {s['graph_stall_s']:.2f} s)"]
        sites = list(self.sites.values())
        for site in sites[:max_sites]:
            state = "eager" if site.eager_reason else site.phase
            lines.append(f"  site {site.label}: {state}; {site.traces} traces, "
                         f"{len(site.paths)} paths, {site.fallbacks} fallbacks")
        if len(sites) > max_sites:
            lines.append(f"  ... and {len(sites) - max_sites} more sites")
        eager = [site for site in sites if site.eager_reason]
        if eager:
            lines.append("  stayed eager:")
            lines += [f"    {site.label}: {site.eager_reason}" for site in eager[:max_sites]]
        reasons: dict = {}
        for e in self.events:
            if e.kind == "fallback":
                key = e.detail.split(" (op #")[0]
                reasons[key] = reasons.get(key, 0) + 1
        if reasons:
            lines.append("  fallbacks by reason:")
            lines += [f"    {n} x {why}" for why, n in
                      sorted(reasons.items(), key=lambda kv: -kv[1])[:max_sites]]
        lines.append("  (terra.explain() lists every trace, build and fallback with its line)")
        return "\n".join(lines)

    def reset(self) -> None:
        """Forget everything (an error still pending from the last iteration is dropped)."""
        try:
            self.end()
        except Exception:  # noqa: BLE001 - a reset discards the session's state
            pass
        with self.internal():
            self.runner.cancel(timeout=CONFIG.timeout_s)
        if self._installed:
            hook.uninstall()
            self._installed = False
        self.__init__()
        gc.collect()  # destroy dropped graphs' queues and variables now, not inside later code


def _route_unit(kind, original, obj, args, kwargs):
    """The hook's unit router (terra/tracing/hook.py, `route_units`): a coarse unit's call goes
    to its rule while an iteration runs on the session's thread; otherwise it runs unchanged."""
    if SESSION.foreign() or SESSION.iteration is None or not CONFIG.enabled:
        return original(obj, *args, **kwargs)
    return _UNIT_RULES[kind](obj, original, args, kwargs)


def _apply_gradients_unit(opt, original, args, kwargs):
    return SESSION.apply_gradients(opt, original, *args, **kwargs)


def _layer_unit(layer, original, args, kwargs):
    if not CONFIG.layer_units:
        return original(layer, *args, **kwargs)
    return SESSION.layer_call(layer, original, args, kwargs)


def _function_unit(fn, original, args, kwargs):
    return SESSION.function_call(fn, original, args, kwargs)


# kind (terra/tracing/hook.py's unit patches) -> the Session method that guards, records or
# skips the call as one unit
_UNIT_RULES = {"apply_gradients": _apply_gradients_unit, "layer": _layer_unit,
               "function": _function_unit}


def _with_reason(d: Divergence, reason: str) -> Divergence:
    return Divergence(d.location, d.expected, d.observed, d.position, reason)


@contextlib.contextmanager
def _unit_python(rec, tf_constants=False):
    """While the Python of a coarse unit runs under `rec` (tracing): its reads are marked
    `Fetch.in_unit`; with `tf_constants` (tape.gradient, apply_gradients), NumPy values it
    makes are TF's own constants (`ContinuingRecorder._ref`). Yields the list of (ref, value)
    the unit's Python reads (`GradUnit.reads`)."""
    rec.unit_depth += 1
    if tf_constants:
        rec.in_unit = True
    outer, reads = rec.unit_reads, []
    rec.unit_reads = reads
    try:
        yield reads
    finally:
        rec.unit_depth -= 1
        rec.unit_reads = outer
        if outer is not None:
            outer.extend(reads)  # an enclosing unit depends on them too
        if tf_constants:
            rec.in_unit = False


@contextlib.contextmanager
def _terra_reads(it):
    """Values Terra reads while tracing are not the program's fetches (a composite's type spec,
    for one, reads its dense shape)."""
    rec = it.recorder if it.mode == "tracing" else None
    if rec is None:
        yield
        return
    rec.muted += 1
    try:
        yield
    finally:
        rec.muted -= 1


def _shape_of(result):
    """`result` with every tensor (composites too) replaced by its TypeSpec: what a unit needs
    to pack placeholders back into the result's structure (`tf.nest.pack_sequence_as(...,
    expand_composites=True)`) without holding the traced tensors, which would pass for values
    the program keeps (`_liveouts`) and be fetched, unread, every iteration."""
    return tf.nest.map_structure(
        lambda x: tf.type_spec_from_value(x)
        if isinstance(x, (tf.Tensor, tf.__internal__.CompositeTensor)) else x, result)


def real_values(structure):
    """`structure` with placeholders replaced by their values (the tape knows only those)."""
    if structure is None:
        return None
    return tf.nest.map_structure(
        lambda x: x._terra_materialize() if isinstance(x, Placeholder) else x, structure,
        expand_composites=True)


def _var_ref(x):
    if isinstance(x, tfp.EagerTensorBase) or x is None:
        return None
    h = getattr(x, "handle", None)
    if isinstance(h, tfp.EagerTensorBase):
        return VariableRef(id(h))
    return None


def _units_for(trace, units) -> dict:
    """Copies of the recorded units with the feeds first used inside each (for this trace);
    units that read a non-tensor feed first inside, or hold a host op, are dropped."""
    out = {}
    for start, u in units.items():
        if any(r.op_type in HOST_OPS for r in trace.records[u.start:u.end]):
            continue  # skipping the unit whole would skip a host op Python must run
        feeds = _unit_feeds(trace, u)
        if feeds is not None:
            out[start] = GradUnit(u.start, u.end, u.guard, u.result, feeds, u.structure, u.reads)
    return out


def _reads_feed_values(units) -> bool:
    """A unit's Python read a feed's value: the path holds for that value only (it stays a
    feed, checked before the unit), so the trace is not generalized (generalizing renumbers
    feed slots and frees constants that were this value)."""
    return any(isinstance(r, FeedRef) for u in units.values() for r, _ in u.reads)


def _unit_feeds(trace, unit):
    """Slots first used inside `unit` (skip mode puts their recorded objects), or None if one of
    them is not an EagerTensor (whose identity, hence value, is stable: TF's cached constants)."""
    # tensors the guard names as feeds (a tf.function's data arguments): the caller feeds them
    seen = {g.slot for g in unit.guard if isinstance(g, FeedRef)}
    for rec in trace.records[:unit.start]:
        seen.update(r.slot for r in rec.input_refs() if isinstance(r, FeedRef))
    inside = []
    for rec in trace.records[unit.start:unit.end]:
        for r in rec.input_refs():
            if isinstance(r, FeedRef) and r.slot not in seen:
                if not isinstance(trace.feed_values[r.slot], tfp.EagerTensorBase):
                    return None
                seen.add(r.slot)
                inside.append(r.slot)
    return tuple(inside)


# Ops whose output shape depends on input values: a placeholder would report the traced shape
# and Python code reading `.shape` could decide differently than eager. Not compiled (yet).
DATA_DEPENDENT_SHAPE_OPS = frozenset({
    "Where", "Unique", "UniqueV2", "UniqueWithCounts", "UniqueWithCountsV2", "DynamicPartition",
    "ListDiff", "NonMaxSuppressionV3", "NonMaxSuppressionV4", "NonMaxSuppressionV5",
    "RaggedRange", "StringSplitV2", "SparseFillEmptyRows"})


def _uncompilable(trace, units=None) -> str | None:
    bad = sorted({r.op_type for r in trace.records if r.op_type in DATA_DEPENDENT_SHAPE_OPS})
    if bad:
        return f"ops with data-dependent output shapes ({', '.join(bad)})"
    if trace.unsupported:
        return "; ".join(sorted(set(trace.unsupported))[:3])
    if trace.unseeded_random:
        return "stateful random op without a Generator"
    spans = [(u.start, u.end) for u in (units or {}).values()]
    if any(r.route == "function" and not any(a <= r.index < b for a, b in spans)
           for r in trace.records):
        # only a coarse unit keeps TF from materializing a tf.function's placeholder arguments
        # and from calling another variant (__forward_ under a tape) than the path recorded
        return "a tf.function call outside a coarse unit (arguments Terra cannot guard)"
    if any(f.spec.dtype in ("variant", "resource", "string") for f in trace.feeds):
        return "a feed of a type channels cannot carry"
    return unsnapshotable(trace)


SESSION = Session()
