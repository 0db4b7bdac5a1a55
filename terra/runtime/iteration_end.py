"""How an iteration ends: at the end of its path (collect or leave the run in flight), before it
(a pure tail the graph may compute anyway, or a switch or fallback), or past it (ops after the
path's last one run eagerly). `IterationEnd` holds these transitions of `Iteration`
(terra/runtime/iteration.py), which mixes it in; they share its state."""
from __future__ import annotations

import functools
import time

import tensorflow as tf

from terra import _tf_private as tfp
from terra.config import CONFIG
from terra.runtime.mode import Mode
from terra.errors import TerraRuntimeError
from terra.runtime.held import kept_unresolved
from terra.runtime.path_view import host_tail
from terra.runtime.divergence import GRAPH_ERROR, Divergence, DivergenceKind, user_line
from terra.tracing import hook

FAILED = object()  # a run's result when it raised (a site graph's function returns None)


def _take_site_graph(s, site, number) -> None:
    """Build the site graph that restarts asked for (`Iteration.switch`)."""
    if site.site_graph is None:
        s.event("switch", site, number, f"{site.read_restarts} restarts cancelled runs Python "
                "had read values of (each runs the graph up to them again): the site takes a "
                "site graph (site_graph='auto')")
    else:
        s.event("switch", site, number, f"{site.outside_restarts} restarts after a read "
                "involved paths outside the site graph "
                f"({site.outside_restart_s:.2f} s of graph thrown away): it is rebuilt over "
                "the site's compiled paths (site_graph='auto')")
    s.builds.site_graph(site, number)


class IterationEnd:
    """The end transitions of `Iteration` (see the module docstring)."""

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
        is over; never while a tape of the iteration is open, `tape_open`): end the iteration
        here; that op and the next ones run eagerly, outside any iteration, until the next
        tape."""
        s = self.session
        where = "after the last op of the path" if d.position >= self.path.view.n else \
            "where only host ops were left of the path (path_view.host_tail)"
        s.event("end", self.site, self.number, f"iteration ended by {d.observed} {where}; "
                 f"following ops run eagerly", d.location)
        with s.internal():
            self.finish()
        s.inflight.collect()  # the next ops run eagerly

    def finish(self, last: bool = False) -> None:
        """End the iteration (the next __enter__, reset, or leaving the site). `last`: no next
        iteration is known to come (`Session.end`): builds wait for the site's next one."""
        try:
            self._finish(last)
            if self.site_graph_due:  # (`Iteration.switch`) between iterations, as builds are
                self.site_graph_due = False
                take = functools.partial(_take_site_graph, self.session, self.site)
                if last:
                    self.site.deferred.append(take)
                else:
                    take(self.number)
        finally:
            self.close_gc()

    def _finish(self, last: bool = False) -> None:
        s = self.session
        # The frame of the tape's site is needed only while the iteration runs. Once that frame
        # has returned, holding it would keep its locals (the last step's gradients, loss, tape)
        # alive: they would pass for values the program keeps (`held_refs`, `kept_unresolved`)
        # and be fetched every step. (A fallback from here records from the current frame.)
        self.frame = None
        if self.mode == Mode.SKIP:
            if self.runner.pos < self.path.view.n and not self.switch(
                    Divergence(user_line(), "", "", self.runner.pos, "iteration ended"), True):
                if host_tail(self.path.view.records, self.runner.pos):
                    self._finish_skip()  # (the graph runs none of the ops left)
                elif self._pure_tail():
                    self._finish_pure_tail()
                else:
                    self.fallback(Divergence(user_line(), f"{self.path.view.n} ops",
                                             f"{self.runner.pos} ops", self.runner.pos,
                                             "iteration ended early"))
            else:
                self._finish_skip()
        if self.mode == Mode.TRACING:
            self.replayed = {}  # bound placeholders keep what the program still holds
            s.filing.file(self, last)
        if self.mode == Mode.SKIP:
            s.counters.python_exec_s += time.perf_counter() - self.t0 - self.stall
            if not self.path.hits:
                self.path.first_hit = self.number
            self.path.hits += 1
            self.site.last_path = self.path
            self.site.note_path(self.path)
        self.mode = Mode.DONE
        hook.set_active(None)

    def _pure_tail(self) -> bool:
        """The iteration ends before the last ops of its path (typically ops that prepare the
        next step's data before the next tape, when the program or a benchmark harness ends the
        iteration between steps), and every op left is pure: no state, no randomness, no function
        call. Then the path's graph may compute them anyway: nothing the program holds comes
        from them, and they change nothing."""
        if not self.exe.allows_pure_tail or self.runner.pos == 0:
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
        s.counters.pure_tails += 1
        s.event("end", self.site, self.number, f"iteration ended {self.path.view.n - runner.pos} "
                 f"ops before the end of path p{self.path.id}; those ops are pure: the graph runs "
                 f"them on the traced feed values, unread", None)
        self._finish_skip()

    def _finish_skip(self) -> None:
        s = self.session
        if s.inflight.pending:
            s.inflight.collect()  # at most one iteration in flight; may fall back (and raise)
            if self.mode != Mode.SKIP:
                return
        with s.internal():
            ended = self.exe.finish()  # the choices known only at the end
        if not ended:
            self.fallback(Divergence(user_line(), "every feed put", "a feed never supplied",
                                     self.runner.pos, "iteration ended before a feed"))
            return
        if CONFIG.coexecution and CONFIG.overlap_iterations:
            with s.internal():
                self.start_graph()
                missing = kept_unresolved(self.runner.placeholders, set(self.liveouts()))
            if missing:
                self.fallback(Divergence(user_line(), "values kept by the graph",
                                         f"%{missing[0].record} kept by the program",
                                         self.runner.pos, "value kept past the iteration"))
                return
            self.commit(final=True)  # the iteration ended on its path
            self.exe.leave_unread(self.fetched)
            self.runner.placeholders = {}
            s.inflight.add(self)
            s.counters.overlapped_iterations += 1
            return
        self.commit(final=False)  # (a value kept past the iteration still falls back below)
        if self.mode != Mode.SKIP:
            return
        with s.internal():
            self.start_graph()
            t = time.perf_counter()
            try:
                outs = s.runner.result(timeout=CONFIG.timeout_s, run=self.run)
            except tf.errors.OpError:
                outs = FAILED
            finally:
                dt = time.perf_counter() - t
                self.stall += dt
                s.counters.python_stall_s += dt
            if outs is FAILED:
                self.fallback(Divergence(user_line(), "a value", "a graph error",
                                         self.runner.pos, GRAPH_ERROR, DivergenceKind.GRAPH_ERROR))
                return
            try:
                self.outputs = self.exe.outputs(outs, s.runner.fetch)
            except tf.errors.OpError:  # the run finished: an element missing is a bug
                raise TerraRuntimeError("terra: a finished site-graph run did not fetch "
                                        "every live-out value") from None
            self.exe.drain_finished(self.fetched)
            missing = kept_unresolved(self.runner.placeholders, self.outputs)
            if missing:
                self.fallback(Divergence(user_line(), "values kept by the graph",
                                         f"%{missing[0].record} kept by the program",
                                         self.runner.pos, "value kept past the iteration"))
                return
            self.runner.placeholders = {}
        self.release()

