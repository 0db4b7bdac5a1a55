"""Lowering of one trace: the documented special case of `lower` (terra/compiler/lower.py) for a
TraceGraph with one path and no branches, which needs no Case-Select or Loop-Cond and keeps the
recorded ops in their recorded order.

`LoweredPath(trace, fetch_points, liveouts, xla)` replays the trace (terra/compiler/replay.py)
into one concrete function: every feed slot is dequeued from its own `FeedChannel` on first use,
every fetched output is enqueued on its own `FetchChannel` at its fetch point (records are named
by `op_node_name`, so an op error maps back to its record), and the live-out values are the
function's outputs. `xla`: the compute between fetch points runs in XLA scopes (xla.py).

`shapes` holds, for every recorded output, the shape TF's shape inference gives it in that graph:
what holds for every value of the feeds (a `Range` whose limit is computed has an unknown
length). Fetch channels take those shapes, not the recorded ones.

`bundled` names feed slots that travel together as one channel element (`feed_channels[slot]` is
that one channel for each of them, dequeued once at the first use of any): a shape group's
constants, which the runtime puts all at once per run.

`derived` (`{slot: rules}`) names feed slots the graph computes itself, from the shapes of
values it holds (a shape group's constants that differ with a data-dependent length: the
multiples a gradient tiles by, a mean's count): each rule is `("const", v)` or
`("dims", ref, dims)`, the product of those dimensions of `ref`'s shape, an element each.

`gates` (`{start: end}`) holds the record spans of coarse units that may run only once Python
has checked them: their ops wait for a token on the span's gate channel (`gate_channels`),
which Python puts when the unit's guard holds (a gradient whose ops were built from a shape the
graph cannot know before it runs would otherwise run, and may fail, with another shape).

`held` names live-outs Python computes itself (the runtime's eager twins): they are the
function's outputs, but not fetched early.

`commit`: the graph's writes wait for a token on `commit_channel`, which Python puts once the
iteration has stayed on its path (terra/compiler/commit.py); `commit_dependent` names the
fetched values that wait for it too. Where the graph cannot be gated, `commit_channel` is None.
"""
from __future__ import annotations

import tensorflow as tf

from terra import _tf_private as tfp
from terra.compiler import commit, replay, xla
from terra.compiler.channels import FeedChannel, FeedFetchOrder, FetchChannel, StallTimer
from terra.compiler.names import op_node_name
from terra.ir.records import FeedRef, OutputRef

__all__ = ["LoweredPath"]


class LoweredPath:
    """One trace as one graph (see the module docstring). `fetch_points`: ref -> number of
    records after which Python reads it; `liveouts`: refs returned, in this order."""

    def __init__(self, trace, fetch_points: dict, liveouts, xla_scopes: bool = False,
                 gates=None, bundled=(), derived=None, commit=False, held=frozenset()):
        self.trace = trace
        # commit-gated writes (compiler/commit.py): the channel Python puts the commit token on
        # (None: not gated), and the fetched refs whose values wait for it
        self.commit_channel = FeedChannel("bool", (), name="terra_commit", timed=False) \
            if commit and not xla_scopes else None
        self.commit_dependent = frozenset()
        self.derived = dict(derived or {})
        self.gates = dict(gates or {})
        self.gate_channels = {start: FeedChannel("bool", (), name=f"terra_gate{start}")
                              for start in self.gates}
        self.bundled = tuple(bundled)
        bundle = FeedChannel([trace.feeds[s].spec.dtype for s in self.bundled],
                             [trace.feeds[s].spec.shape for s in self.bundled],
                             name="terra_feed_bundle") if self.bundled else None
        self.feed_channels = [bundle if f.slot in self.bundled else None if f.slot in
                              self.derived else
                              FeedChannel(f.spec.dtype, f.spec.shape, name=f"terra_feed{f.slot}")
                              for f in trace.feeds]
        self.fetch_at: dict = {}
        self.fetch_channels: dict = {}   # ref -> FetchChannel, made while the body is traced
        self.shapes: dict = {}           # OutputRef -> tf.TensorShape in the graph
        for ref, after in sorted(fetch_points.items(), key=lambda kv: kv[1]):
            self.fetch_at.setdefault(max(after, ref.record + 1), []).append(ref)
        self.liveouts = tuple(sorted(liveouts, key=lambda r: (r.record, r.index)))
        fetched = set(fetch_points)
        # Live-outs are fetched too: the next iteration often consumes one right away (inputs
        # sliced for the next step after the tape's block) and then needs not wait for the run
        # to end.
        for ref in self.liveouts:
            if ref not in fetched and ref not in held and trace.records[ref.record].outputs[
                    ref.index].dtype not in ("resource", "variant"):
                self.fetch_at.setdefault(len(trace.records), []).append(ref)
        self.xla_spans = 0
        liveouts = self.liveouts
        # the seconds the graph waits on its timed feeds, summed once per run (channels.py)
        self.stall = StallTimer("terra_path") if any(
            ch is not None and ch.timed for ch in self.feed_channels) or self.gates else None

        def body():
            order = FeedFetchOrder(self.stall)
            builder = _ChannelReplay(trace, self, order, xla_scopes)
            env = builder.run()
            if self.stall is not None:
                self.stall.close()
            self.xla_spans = builder.spans.count
            if self.commit_channel is not None:
                self._gate_writes(env)
            self.shapes = {OutputRef(i, j): t.shape for (i, j), t in env.items()}
            return [env[(r.record, r.index)] for r in liveouts]

        with tfp.without_op_tracebacks():
            self.concrete = tf.function(body, autograph=False).get_concrete_function()

    def _gate_writes(self, env) -> None:
        """Writes wait for Python's commit (compiler/commit.py), where the graph allows it."""
        types = commit.record_types(self.trace.records)
        tainted = None if types is None else commit.gate_writes(
            tf.compat.v1.get_default_graph().get_operations(), types,
            self.commit_channel.dequeue_op)
        if tainted is None:
            self.commit_channel = None
            return
        self.commit_dependent = frozenset(r for r in self.fetch_channels
                                          if env[(r.record, r.index)].op in tainted)

    def fetch_channel(self, ref, value):
        """The channel of `ref`, made (eagerly) for `value`, its tensor in the graph being
        traced: of the shape the graph guarantees."""
        ch = self.fetch_channels.get(ref)
        if ch is None:
            spec = self.trace.records[ref.record].outputs[ref.index]
            with tf.init_scope():
                ch = self.fetch_channels[ref] = FetchChannel(
                    spec.dtype, value.shape, name=f"terra_fetch{ref.record}_{ref.index}")
        return ch


class _ChannelReplay(replay.GraphReplay):
    """Replay's builder with feeds dequeued from channels and fetches enqueued at their points."""

    def __init__(self, trace, lowered, order, xla_scopes):
        self.spans = xla.Spans(xla_scopes)  # XLA scopes per compute span (no-ops without xla)
        super().__init__(trace, _LazyFeeds(lowered, order, self.spans, self))
        self.lowered = lowered
        self.order = order

    def _emit_fetches(self, at):
        refs = self.lowered.fetch_at.get(at, ())
        if refs:
            self.spans.cut()
        for ref in refs:
            with self.spans.channel():
                value = self.env[(ref.record, ref.index)]
                self.order.fetch(self.lowered.fetch_channel(ref, value), value)

    def run(self):
        gate, gate_end = [], -1
        with self.spans:
            for rec in self.trace.records:
                self._emit_fetches(rec.index)
                end = self.lowered.gates.get(rec.index)
                if end is not None:
                    with self.spans.channel():
                        gate = [self.order.feed(self.lowered.gate_channels[rec.index])]
                        gate_end = end
                control = gate if rec.index < gate_end else []
                with self.spans.compute(), tf.name_scope(op_node_name(rec.index)), \
                        tf.control_dependencies(control):
                    outs = self.emit(rec)
                self.write(rec, outs)
        self._emit_fetches(len(self.trace.records))
        return self.env


class _LazyFeeds:
    """`feeds[slot]` dequeues the slot's channel on first use (in trace order)."""

    def __init__(self, lowered, order, spans, replay):
        self.lowered, self.order, self.spans, self.values = lowered, order, spans, {}
        self.replay = replay

    def __getitem__(self, slot):
        v = self.values.get(slot)
        if v is None and slot in self.lowered.derived:
            v = self.values[slot] = self._derive(slot)
        if v is None:
            with self.spans.channel():
                v = self.order.feed(self.lowered.feed_channels[slot])
            bundled = self.lowered.bundled
            if slot in bundled:
                self.values.update(zip(bundled, v))
                v = self.values[slot]
            else:
                self.values[slot] = v
        return v

    def _derive(self, slot):
        """Slot `slot`'s value computed in the graph by its rules (`LoweredPath.derived`)."""
        spec = self.lowered.trace.feeds[slot].spec
        elements = []
        for rule in self.lowered.derived[slot]:
            if rule[0] == "const":
                elements.append(tf.constant(rule[1], tf.float64))
                continue
            _, ref, dims = rule
            value = self[ref.slot] if isinstance(ref, FeedRef) else \
                self.replay.env[(ref.record, ref.index)]
            shape = tf.shape(value, out_type=tf.int64)
            elements.append(tf.cast(tf.reduce_prod(tf.gather(shape, list(dims))), tf.float64))
        return tf.cast(tf.reshape(tf.stack(elements), spec.shape), spec.dtype)
