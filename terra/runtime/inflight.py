"""Pipelined iterations: finished iterations whose graph runs are still in flight, oldest first,
and the error of one that failed after the program had left it.

An iteration may end while its run goes on (the next iteration's Python overlaps it). Its
outputs are collected at the next sync point that needs them. A run that fails there is an op
error of an iteration the program has already left: the later runs are cancelled, every
variable goes back to that iteration's start, and its ops are replayed eagerly, so the error is
raised by the same op as in eager and leaves the variables exactly as eager leaves them. The
error waits in `error` until a sync point raises it (`collect(convert=True)`, `raise_error`).
"""
from __future__ import annotations

import time

import tensorflow as tf

from terra.config import CONFIG
from terra.runtime.divergence import Divergence, user_line
from terra.runtime.explain import EventKind
from terra.runtime.fallback import EagerReplay
from terra.runtime.iteration import with_location
from terra.runtime.iteration_end import FAILED
from terra.runtime.mode import Mode


class InFlight:
    """The session's iterations in flight. Collaborators are handed in: the graph runner, the
    list of graphs (drained after a cancel), `internal` (Terra's own TF calls), the counters,
    `event(kind, site, number, detail)` and `current()` (the iteration running now)."""

    def __init__(self, *, runner, graphs, internal, counters, event, current):
        self.pending: list = []   # finished iterations whose runs are not collected yet
        self.error = None         # an earlier iteration's error, raised at a sync point
        self._runner, self._graphs, self._internal = runner, graphs, internal
        self._counters, self._event, self._current = counters, event, current

    def add(self, it) -> None:
        it.pending = True
        self.pending.append(it)

    def collect(self, convert: bool = True) -> None:
        """Wait for the runs of finished iterations (oldest first) and keep their outputs. With
        `convert`, an earlier iteration's error first makes the current iteration fall back (its
        ops so far run eagerly), then is raised."""
        while self.pending:
            self._collect(self.pending[0])
        if self.error is not None and convert:
            it = self._current()
            if it is not None and it.mode == Mode.SKIP:
                it.fallback(Divergence(user_line(), "no error", "an error of an earlier "
                                       "iteration", it.runner.pos, "graph error of the "
                                       "previous iteration"))
            self.raise_error()

    def _stalled(self, dt: float) -> None:
        """The wait for an earlier iteration's run is Python waiting for the graph: it counts
        as stall, of the iteration running now (whose `python_exec_s` excludes it), not as the
        skeleton's own time."""
        self._counters.python_stall_s += dt
        cur = self._current()
        if cur is not None:
            cur.stall += dt

    def raise_error(self) -> None:
        e, self.error = self.error, None
        if e is not None:
            raise e

    def _collect(self, it) -> None:
        runner = self._runner
        t = time.perf_counter()
        try:
            with self._internal():
                outs = runner.result(timeout=CONFIG.timeout_s, run=it.run)
        except tf.errors.OpError:
            outs = FAILED
        finally:
            self.pending.remove(it)
            it.pending = False
            self._stalled(time.perf_counter() - t)
        if outs is not FAILED:
            with self._internal():
                it.outputs = it.exe.outputs(outs, runner.fetch)
                it.graph().drop_stale(outputs=it.outputs)
            it.release()
            return
        with self._internal():
            cur = self._current()
            later = [x for x in self.pending + [cur] if x is not None and x is not it and
                     (x in self.pending or x.mode == Mode.SKIP) and x.run is not None]
            runner.cancel(timeout=CONFIG.timeout_s, first=it.run)
            for x in reversed(later):  # newest first: back to the failed iteration's start
                if x.snap is not None:
                    x.snapshot().restore(x.snap)
                x.run, x.snap, x.committed = None, None, False
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
        self._counters.fallbacks += 1
        it.site.fallbacks += 1
        self._event(EventKind.FALLBACK, it.site, it.number, "the graph run failed after the "
                    "iteration's last sync point; replayed eagerly" + (
                        f": {type(error).__name__}" if error is not None else ""))
        if error is not None and self.error is None:
            self.error = with_location(error, it, rp.at, late=True)


__all__ = ["InFlight"]
