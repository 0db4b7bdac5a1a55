"""What an iteration needs from the compiled graph it runs on, whichever graph that is.

An `Executable` is one iteration's run of one graph: the graph to start, the variables it may
write, the values it hands back, how Python puts a feed and takes a fetch, how the run is moved
to another path after a divergence, and how its end is collected. Two implementations:

- `PathRun`: the path's own straight-line graph (terra/runtime/path_graph.py). Python puts every
  feed on its channel; a fetch channel per read value; values Python did not read are left for
  the next reader.
- `SiteRun` (terra/runtime/site_graph.py): the site's lowered graph, driven along the path's plan
  (Case-Select and Loop-Cond puts); a divergence to a path whose plan agrees so far is taken
  without touching the run.

The iteration (terra/runtime/iteration.py) holds one and never asks which it is.
"""
from __future__ import annotations

import tensorflow as tf

from terra.runtime.placeholders import Placeholder


class Executable:
    """The protocol (see the module docstring); `SiteRun` and `PathRun` implement it."""

    graph = None            # what the GraphRunner runs: `.concrete`, `.run_config`, `.drain()`
    advance = None          # runner.advance: puts Python knows once records [0, pos) matched
    learns_fetches = False  # a value read where this graph does not fetch it: fetch next build
    allows_pure_tail = False  # may end before its path's end when the ops left are pure
    waits_at_end = False    # its run can end once the path's last op matched (no puts left)
    holds = False           # its start (and Python's puts) may wait until the path is certain
    commits = False         # its writes wait for `put_commit` (no snapshot before the run)
    # a shape group's member may run with shapes no member was traced with: the group's graph
    # computes the shape constants it derives (shape_groups.derive) from the shapes it holds
    takes_other_shapes = False

    @property
    def function(self):
        """What the GraphRunner calls for this run."""
        return self.graph.concrete

    @property
    def snapshot(self):
        """The variables the graph may write (a fallback restores them)."""
        raise NotImplementedError

    @property
    def liveouts(self):
        """Refs the run hands back when it ends."""
        raise NotImplementedError

    def put_feed(self, slot, value) -> bool:
        """Put feed `slot`; False if the plan's own events put it (`advance`)."""
        raise NotImplementedError

    def queued(self, runner) -> bool:
        """Whether Python has put anything for this run (a lazy run to drain when abandoned)."""
        raise NotImplementedError

    def open_gate(self, start: int) -> bool:
        """Let the run take the coarse unit at record `start`, whose guard Python has checked
        (`LoweredPath.gates`); False if the graph has no gate there."""
        return False

    def gated(self, start: int) -> bool:
        """Whether the graph's ops of the coarse unit at record `start` wait for its gate."""
        return False

    def put_commit(self) -> None:
        """Let the run write (`commits`): Python will not leave the path, or has snapshotted."""

    def needs_commit(self, ref) -> bool:
        """Whether the fetched value of `ref` waits for the commit (it depends on a write)."""
        return False

    def starts_early(self) -> bool:
        """Whether the run starts with the iteration (else at the first feed put)."""
        raise NotImplementedError

    def fetchable(self, ref) -> bool:
        raise NotImplementedError

    def before_start(self) -> None:
        """Called right before the run is queued: put what the runtime itself feeds."""

    def static_shape(self, ref):
        """The shape of `ref` that holds for every value of the feeds (TF's inference in the
        graph), which a placeholder may claim without a fetch; None: the recorded shape."""
        return None

    def unknown_shapes(self) -> frozenset:
        """Refs whose `static_shape` is not fully defined."""
        return frozenset()

    def fetch(self, fetch, ref, timeout):
        """This iteration's value of `ref`; `fetch(channel, timeout)` takes one element."""
        raise NotImplementedError

    def early_liveout(self, ref, fetched: set, outputs: dict, fetch, timeout):
        """A live-out of this finished iteration read while its run may still go on (None: wait
        for the run). May raise the run's OpError."""
        raise NotImplementedError

    def seamless_switch(self, path, pos: int) -> bool:
        """Take `path` from op `pos` on without touching the run, if this graph can."""
        return False

    def on_path(self, path, runner) -> "Executable":
        """The executable of a restart on `path` (the run was abandoned)."""
        raise NotImplementedError

    def replay_puts(self, runner, pos: int, put_feed) -> None:
        """After a restart: put what Python had put so far."""
        raise NotImplementedError

    def finish(self) -> bool:
        """The puts known only at the iteration's end; False if some could not be made."""
        return True

    def leave_unread(self, fetched: set) -> None:
        """The iteration ended with its run in flight: account for the values not read."""

    def outputs(self, result, fetch) -> dict:
        """Live-out values of the finished run (`result`: what the run returned)."""
        raise NotImplementedError

    def drain_finished(self, fetched: set) -> None:
        """Empty the channels after a run collected in line."""
        self.graph.drain()

    def record_of(self, index: int):
        """The record an op error's node index names (None: not one of the path's records)."""
        return index


_TOKEN = []


def token():
    """The gate and commit token, one eager tensor made once (not a conversion per put)."""
    if not _TOKEN:
        _TOKEN.append(tf.constant(True))
    return _TOKEN[0]


def materialized(value):
    return value._terra_materialize() if isinstance(value, Placeholder) else value


class PathRun(Executable):
    """A run of the path's own graph (see the module docstring)."""

    learns_fetches = True
    allows_pure_tail = True
    takes_other_shapes = True
    waits_at_end = True
    holds = True

    def __init__(self, path):
        self.path = path
        self.graph = path.graph
        # a shape group's member puts its own shape constants (shape_groups.py), once per run,
        # as one element of the graph's bundle channel
        self.constants = path.group_tensors if path.group is not None else None
        # whether this run put anything into the graph's feed channels: `runner.fed` forgets a
        # feed of an op that diverged half-way (`_rollback`), but the channel holds it
        self.put_any = False

    def _put_constants(self) -> None:
        constants, self.constants = self.constants, None
        self.put_any = True
        self.graph.feed_channels[self.graph.bundled[0]].put(constants)

    def before_start(self) -> None:
        if self.constants:
            self._put_constants()

    @property
    def function(self):
        # a path that shares another path's graph over its own variables (PathGraph.bind)
        return self.graph.function_for(self.path)

    @property
    def snapshot(self):
        return self.path.snapshot

    @property
    def liveouts(self):
        return self.graph.liveouts

    def put_feed(self, slot, value) -> bool:
        if self.constants:
            self._put_constants()
        self.put_any = True
        self.graph.feed_channels[slot].put(materialized(value))
        return True

    def queued(self, runner) -> bool:
        return self.put_any or bool(runner.fed) or \
            any(s in self.graph.gate_channels for s in runner.passed)

    def open_gate(self, start: int) -> bool:
        ch = self.graph.gate_channels.get(start)
        if ch is None:
            return False
        ch.put(token())
        return True

    def gated(self, start: int) -> bool:
        return start in self.graph.gate_channels

    @property
    def commits(self) -> bool:
        return self.graph.commit_channel is not None

    def put_commit(self) -> None:
        self.put_any = True
        self.graph.commit_channel.put(token())

    def needs_commit(self, ref) -> bool:
        return ref in self.graph.commit_dependent

    def starts_early(self) -> bool:
        # else at the first feed: a feed of another signature (the next batch has another
        # shape) then switches paths without a run to cancel
        return not self.path.early_feed

    def fetchable(self, ref) -> bool:
        return self.graph.fetch_channels.get(ref) is not None

    def static_shape(self, ref):
        group = self.path.group
        if group is not None:
            return group.static_shape(self.path, ref)
        return self.graph.shapes.get(ref)

    def unknown_shapes(self) -> frozenset:
        return self.graph.unknown_shapes

    def fetch(self, fetch, ref, timeout):
        ch = self.graph.fetch_channels[ref]
        for _ in range(self.graph.stale.pop(ref, 0)):  # earlier runs' unread elements
            fetch(ch, timeout=timeout)
        return fetch(ch, timeout=timeout)

    def early_liveout(self, ref, fetched, outputs, fetch, timeout):
        graph = self.graph
        ch = graph.fetch_channels.get(ref)
        v = outputs.get(ref)
        if v is not None or ch is None or ref in fetched or not graph.stale.get(ref):
            return v
        for _ in range(graph.stale[ref] - 1):  # older iterations' unread values
            fetch(ch, timeout=timeout)
        v = fetch(ch, timeout=timeout)
        graph.stale[ref] = 0
        fetched.add(ref)
        return v

    def on_path(self, path, runner) -> Executable:
        return PathRun(path)

    def replay_puts(self, runner, pos, put_feed) -> None:
        for slot in runner.fed_order:
            put_feed(slot, runner.fed[slot])
        for start in runner.passed:  # units Python checked before the switch
            self.open_gate(start)

    def leave_unread(self, fetched) -> None:
        self.graph.leave_unread(fetched)

    def outputs(self, result, fetch) -> dict:
        return dict(zip(self.graph.liveouts, result))

    def drain_finished(self, fetched) -> None:
        self.graph.drain(fetched)
