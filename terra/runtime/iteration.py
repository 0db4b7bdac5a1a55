"""One iteration of one site: tracing, co-execution along a compiled path (skip mode), switches
between paths, the fallback to eager tracing, and the iteration's end."""
from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from terra.config import CONFIG
from terra.runtime.mode import Mode
from terra.errors import TerraRuntimeError
from terra.ir.records import FeedRef, OutputRef
from terra.runtime import policy
from terra.runtime.fallback import EagerReplay, Snapshot, bind_placeholders
from terra.runtime.executable import Executable, PathRun
from terra.runtime.graph_runner import extended_error
from terra.runtime.user_traceback import at_recorded_line
from terra.runtime.iteration_end import IterationEnd
from terra.runtime.placeholders import Placeholder
from terra.runtime.divergence import GRAPH_ERROR, Divergence, DivergenceKind, user_line
from terra.runtime.python_runner import UNSET, PythonRunner, placeholder_ref
from terra.runtime.shape_groups import current_record
from terra.runtime.site_graph import site_paths
from terra.tracing import gc_window, hook
from terra.tracing.recorder import ContinuingRecorder


if TYPE_CHECKING:
    from terra.runtime.sites import Path


# ------------------------------------------------------------------------------------ iteration
class Iteration(IterationEnd):
    """One iteration of one site; `mode` is tracing, skip (co-execution), eager or done."""

    def __init__(self, session, site, frame, number):
        self.session = session
        self.site = site
        self.frame = frame
        self.frame_lasti = frame.f_lasti if frame is not None else None  # (see Locator)
        self.number = number
        self.mode = Mode.EAGER
        self.recorder: ContinuingRecorder | None = None
        self.runner: PythonRunner | None = None
        self.path: Path | None = None
        self.run = None
        self.snap = None
        self.committed = False  # the run may write (`Executable.commits`; see `commit`)
        self.fallback_gap: int | None = None   # iterations since the site's previous fallback
        self.fetched: set = set()
        self.fetch_wait = 0.0  # seconds Python waited for fetches from the current run
        self.site_graph_due = False  # restarts asked for the site's site graph (`switch`)
        self.outputs: dict = {}
        self.tapes: list = []
        self.tape_spans: list = []   # [tape, first op, end op or None]
        self.t0 = time.perf_counter()
        self.stall = 0.0
        self.replayed: dict = {}
        self.pending = False   # finished, its graph run not yet collected (pipelined)
        self.exe: Executable | None = None   # the run of the compiled graph, in skip mode
        self.predicted = False  # started in skip mode on a predicted path
        self.missed = False     # ... and had to leave it (a restart or a fallback)
        self.hold: int | None = None  # the run waits until Python has matched this many ops
        self.held = False       # the run was held at some point (counted once)
        self.young_gc = False   # it holds a gc_window open (co-executed), closed by `finish`

    def widen_gc(self, young: int) -> None:
        """Hold the garbage collector's young generation at `young` allocations until `finish`
        (the iteration co-executes; see `coexec_gc_threshold`)."""
        if not self.young_gc:
            self.young_gc = True
            gc_window.widen(young)

    def close_gc(self) -> None:
        if self.young_gc:
            self.young_gc = False
            gc_window.restore()

    def release(self) -> None:
        """Drop what a finished, collected iteration no longer needs; its values resolve from
        `outputs` and `replayed`. Its runner, run and snapshot closure refer back to it, so
        without this every iteration whose placeholders the program dropped would be cyclic
        garbage, freed only by a full collection, which CPython runs rarely in a process holding
        TF's many long-lived objects: memory grew by every run's outputs and variable snapshot
        (0.4 GB per ResNet-50 step)."""
        self.run = self.snap = self.runner = self.exe = None

    # ---------------------------------------------------------------- graph of the iteration
    def graph(self):
        """The graph this iteration runs (its path's, or the site's)."""
        return self.exe.graph

    def snapshot(self) -> Snapshot:
        return self.exe.snapshot

    def liveouts(self):
        return self.exe.liveouts

    def use(self, exe: Executable) -> None:
        """Run on `exe` from now on (terra/runtime/executable.py)."""
        self.exe = exe
        self.runner.advance = exe.advance

    # ---------------------------------------------------------------- co-execution
    def position(self) -> int:
        if self.mode == Mode.SKIP:
            return self.runner.pos
        if self.mode == Mode.TRACING and self.recorder is not None:
            return len(self.recorder.trace.records)
        return 0

    def add_tape(self, tape) -> None:
        self.tapes.append(tape)
        self.tape_spans.append([tape, self.position(), None])

    def tape_exited(self, tape) -> None:
        for span in self.tape_spans:
            if span[0] is tape and span[2] is None:
                span[2] = self.position()

    def tape_open(self) -> bool:
        """Whether a tape this iteration entered before the current op is still open: ops of
        its block were skipped (the graph computes them), so the program is inside its step and
        an op past the path's end is not the loop being over; run eagerly, it would miss the
        tape's record of the skipped ones. (A tape entered right here, at the path's end, has
        skipped nothing: its block may run eagerly, recorded as eager's, like a GAN's
        generator step after a critic step's path.)"""
        pos = self.position()
        return any(span[2] is None and span[1] < pos for span in self.tape_spans)

    def frame_alive(self) -> bool:
        f = sys._getframe(1)
        target = self.frame
        while f is not None:
            if f is target:
                return True
            f = f.f_back
        return False

    def put_feed(self, slot, value) -> None:
        if self.hold is not None:  # put when the run is released (`runner.fed` keeps it)
            return
        if self.exe.put_feed(slot, value) and CONFIG.coexecution:
            self.start_graph(early=True)  # (a no-op once started) after the put

    def open_gate(self, start: int) -> None:
        """The coarse unit at record `start` may run: Python has checked its guard."""
        self.runner.passed.append(start)
        if self.hold is None and self.exe.open_gate(start) and CONFIG.coexecution:
            self.start_graph(early=True)

    # ---------------------------------------------------------------- held runs
    def hold_for(self, path) -> None:
        """Hold this iteration's run (no start, no puts) until Python has told `path` apart
        from the site's other compiled paths, where the site's predictions keep missing
        (`Site.holds_runs`): a switch before then costs no cancel, wait or restore."""
        self.hold = None
        if not (CONFIG.coexecution and self.exe.holds and self.site.holds_runs()):
            return
        h = self.site.hold_point(path)
        if h > self.runner.pos:
            self.hold = h
            self.runner.advance = self._advance_held
            if not self.held:
                self.held = True
                self.session.counters.held_iterations += 1

    def _advance_held(self, pos: int) -> None:
        if self.hold is not None and pos >= self.hold:
            self.start_graph()

    def _release(self) -> None:
        """Put what Python has put so far and let the run start."""
        self.hold = None
        runner = self.runner
        runner.advance = self.exe.advance
        self.exe.replay_puts(runner, runner.pos, lambda slot, v: self.exe.put_feed(slot, v))

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
        if self.hold is not None and self.run is None:  # held: nothing was put or run
            self.hold = None
            self.runner.advance = self.exe.advance
            if eager_next:
                s.inflight.collect(convert=False)
            return
        if eager_next or self.run is not None or self.runner is not None and \
                self.exe.queued(self.runner):  # (before a drain: earlier runs take theirs first)
            s.inflight.collect(convert=False)
        if self.run is None:
            if self.mode == Mode.SKIP and self.runner is not None and \
                    self.exe.queued(self.runner):
                # lazy mode: nothing ran, but what Python put is queued
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
        if self.snap is not None:  # None: the run never started (or never committed: its
            self.snapshot().restore(self.snap)  # writes waited), so it wrote nothing
        self.run = None
        self.snap = None
        self.committed = False

    def start_graph(self, early: bool = False) -> None:
        """Queue this iteration's run; right before it starts (after every earlier run ended)
        the worker snapshots the variables it may write, for a fallback to restore. `early`:
        a start for overlap only, which a held run declines (a sync point releases it)."""
        if self.run is None:
            if self.hold is not None:
                if early and self.runner.pos < self.hold:
                    return
                self._release()
            graph, snap = self.graph(), self.snapshot()
            self.snap = None
            self.committed = False

            def snapshot():
                self.snap = snap.take()
            self.exe.before_start()
            self.run = self.session.runner.start(
                self.exe.function, before=None if self.exe.commits else snapshot,
                config=graph.run_config)

    def commit(self, final: bool) -> None:
        """Let a run whose writes wait for Python's word (`Executable.commits`) write. `final`:
        the iteration ended on its path, nothing can make it leave it, so nothing needs
        restoring (and a cancel lets the run finish: `GraphRun.committed`). Otherwise Python
        needs a value that depends on a write before then: the variables are snapshotted first,
        once earlier runs have ended (the writes of this run still wait), as a run without a
        commit channel does before it starts."""
        if self.committed or not self.exe.commits:
            return
        s = self.session
        with s.internal():
            self.start_graph()
            if not final:
                if s.inflight.pending:
                    s.inflight.collect()  # the snapshot must see their writes; may fall back
                    if self.mode != Mode.SKIP:
                        return
                self.snap = self.snapshot().take()
                s.counters.commit_snapshots += 1
            self.exe.put_commit()
        self.committed = True
        if final:
            self.run.committed = True

    def wait_run(self) -> None:
        """Wait for this iteration's run to end, at its path's last op, where that op runs
        inside a `try` of the program entered every step (`PathView.end_sync`): a failed run
        falls back here, and the eager replay raises the op's error inside that `try`."""
        s = self.session
        if s.inflight.pending:
            s.inflight.collect()  # runs in order: an earlier one first (may fall back)
            if self.mode != Mode.SKIP:
                return
        if not self.exe.waits_at_end:
            return
        self.commit(final=False)
        if self.mode != Mode.SKIP:
            return
        with s.internal():
            self.start_graph()
            t = time.perf_counter()
            try:
                s.runner.wait(self.run, CONFIG.timeout_s)
            finally:
                dt = time.perf_counter() - t
                self.stall += dt
                s.counters.python_stall_s += dt
        if self.run_failed():
            self.fallback(Divergence(user_line(), "a value", "a graph error", self.runner.pos,
                                     GRAPH_ERROR, DivergenceKind.GRAPH_ERROR))

    def resolve(self, ref: OutputRef):
        """Value of a placeholder of this iteration (a Python sync point)."""
        s = self.session
        with s.internal():
            if self.mode == Mode.SKIP:
                # a shape the path fixes: no need to wait (unless this iteration's shapes differ
                # from the path's there: PythonRunner.shape_from)
                v = self.path.static.get(ref) if self.runner.shape_from is None or \
                    ref.record < self.runner.shape_from else self.runner.static_now().get(ref)
                if v is not None:
                    self.runner.log_fetch(ref)
                    s.counters.static_reads += 1
                    return v
            if self.mode == Mode.SKIP and s.inflight.pending:
                s.inflight.collect()  # our run comes after theirs anyway; may fall back
            if self.mode == Mode.SKIP:
                exe = self.exe
                if exe.fetchable(ref) and ref not in self.fetched:
                    if exe.needs_commit(ref) and not self.committed:
                        self.commit(final=False)
                        if self.mode != Mode.SKIP:
                            return self.resolve(ref)
                    self.start_graph()
                    t = time.perf_counter()
                    try:
                        v = exe.fetch(s.runner.fetch, ref, CONFIG.timeout_s)
                    except tf.errors.OpError:
                        v = None
                    finally:
                        dt = time.perf_counter() - t
                        self.stall += dt
                        self.fetch_wait += dt
                        s.counters.python_stall_s += dt
                    if v is not None:
                        self.fetched.add(ref)
                        self.runner.log_fetch(ref)
                        return v
                    self.fallback(Divergence(user_line(), "a value", "a graph error",
                                             self.runner.pos, GRAPH_ERROR, DivergenceKind.GRAPH_ERROR))
                else:
                    self.runner.log_fetch(ref)  # the next graph fetches it
                    if exe.learns_fetches and ref.record < len(self.path.trace.records):
                        # this path's next build fetches it too: a value Python read once
                        # (every tenth step, say) is read again, and then needs no fallback
                        self.path.absorb_fetch(ref, self.runner.pos)
                        if self.path.view is not None and ref.record in self.path.view.twins:
                            self.path.twin_misses.add(ref)
                    self.fallback(Divergence(user_line(), "no fetch", f"fetch of %{ref.record}",
                                             self.runner.pos, "value needed by Python that the "
                                             "graph does not fetch"))
                return self.replayed[(ref.record, ref.index)]
            if self.pending:
                v = self._early_liveout(ref)
                if v is not None:
                    return v
                s.inflight.collect()
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
        v = self.path.static.get(ref, runner.shapes_checked) if runner.shape_from is None or \
            ref.record < runner.shape_from else runner.static_now().get(ref)
        if v is not None:
            return np.asarray(v)
        if not self.exe.fetchable(ref) or ref in self.fetched:
            return None
        return runner.placeholder(self.path.trace.records[ref.record], ref.index).numpy()

    def _early_liveout(self, ref):
        """A value this finished iteration left to the program, read from its fetch channel
        while its run may still be going (None: not there any more; wait for the run)."""
        s = self.session
        t = time.perf_counter()
        try:
            v = self.exe.early_liveout(ref, self.fetched, self.outputs, s.runner.fetch,
                                       CONFIG.timeout_s)
        except tf.errors.OpError:
            return None  # its run failed: collecting it reports the error
        finally:
            s.counters.python_stall_s += time.perf_counter() - t
        if v is not None:
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
        if not runner.skipping:  # it fell back already (a read waited for a failed run)
            return False
        if runner.shape_from is not None:  # its placeholders hold shapes no path was traced with
            return False
        prefix = cur.switch_signature()[:pos]
        fed_specs = [cur.trace.feeds[sl].spec for sl in sorted(runner.fed)]
        tried = set() if tried is None else tried
        tried.add(id(cur))
        candidates = []
        for q in self.site.paths.values():
            if id(q) in tried or q.graph is None or q.stale or q.view is None:
                continue
            if at_end and q.view.n != pos or not at_end and q.view.n <= pos:
                continue
            if q.switch_signature()[:pos] != prefix:
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
        for q in candidates:
            if self.exe.seamless_switch(q, pos):
                tried.add(id(q))
                self.path = q
                runner.view = q.view
                s = self.session
                s.counters.case_switches += 1
                s.event("case_switch", self.site, self.number, f"p{cur.id} -> p{q.id} at "
                         f"op #{pos} in the site graph: {d.reason}", d.location)
                return True
        for q in candidates:
            tried.add(id(q))
            s = self.session
            if self.hold is not None and self.run is None:
                s.counters.held_switches += 1
            read, cancelled = bool(self.fetched), self.run
            with s.internal():
                self.abandon_run(eager_next=False)
                if s.inflight.error is not None:  # an earlier iteration failed: fall back
                    return False
                self.run = None
                self.path = q
                runner.view = q.view
                self.use(self.exe.on_path(q, runner))
                self.hold_for(q)
                self.exe.replay_puts(runner, pos, self.put_feed)
                if read:  # Python waited for values of the run cancelled here: the restart
                    self._read_restart(cancelled, cur, q)  # runs the graph up to them again
                self.fetched = set()
                self.fetch_wait = 0.0
                if CONFIG.coexecution and (self.exe.starts_early() or runner.fed_order):
                    self.start_graph(early=True)
            s.counters.path_switches += 1
            self.missed = True
            s.event("switch", self.site, self.number, f"p{cur.id} -> p{q.id} at op #{pos}: "
                     f"{d.reason}", d.location)
            return True
        return False

    def _read_restart(self, cancelled, left, taken) -> None:
        """Count a restart from path `left` to `taken` that throws away graph work Python
        waited for (the cancelled run's time, at least Python's waits for it); with
        `site_graph="auto"`, take a site graph once that costs more than building it
        (`policy.takes_site_graph`), or rebuild the one in place over the paths outside it
        (`policy.rebuilds_site_graph`), built as this iteration ends."""
        site = self.site
        site.read_restarts += 1
        ran = cancelled.exec_seconds if cancelled is not None and cancelled.done else 0.0
        wasted = max(self.fetch_wait, ran)
        site.read_restart_s += wasted
        if CONFIG.site_graph != "auto":
            return
        sg = site.site_graph
        if site.wants_site_graph:
            if sg is not None and (sg.plan_of(left) is None or sg.plan_of(taken) is None):
                site.outside_restarts += 1
                site.outside_restart_s += wasted
                if policy.rebuilds_site_graph(site.outside_restarts, site.outside_restart_s,
                                              sg.build_seconds):
                    self.site_graph_due = True
            return
        builds = sum(p.graph.build_seconds for p in site_paths(site))
        if policy.takes_site_graph(site.read_restarts, site.read_restart_s, builds):
            site.wants_site_graph = True
            self.site_graph_due = True

    def fallback(self, d: Divergence):
        """Leave skip mode (see terra/runtime/fallback.py); returns the recorder now active.

        Once per iteration: a read that waited for a failed run may have fallen back already
        (inside a unit's check, say), and its caller then falls back for its own reason; the
        prefix was replayed then, and replaying it again would repeat its writes."""
        s = self.session
        runner = self.runner
        if self.mode == Mode.TRACING and not runner.skipping and self.missed:
            return self.recorder
        runner.skipping = False
        self.missed = True
        s.count_fallback(self, d)
        with s.internal():
            self.abandon_run()
            self.use(PathRun(self.path))
            self.mode = Mode.DONE  # until the replay succeeded
            watches: dict = {}
            pre_watch: dict = {}
            for tape in self.tapes:
                now, later = tape._terra_rewatch(
                    lambda ph: (lambda r: None if r is None else (r.record, r.index))(
                        placeholder_ref(ph, runner)))
                pre_watch[tape] = now
                for key in later:
                    watches.setdefault(key, []).append(tape)
            group = self.path.group
            # the shape constants the group's graph computes are computed anew from the shapes
            # replayed (the member's are its traced length's): past a feed of a new shape, and
            # anywhere a length set by the data (`tf.where`) differs from the member's
            rewrite = None if group is None else \
                lambda rec, shape_of: current_record(group, rec, shape_of) or rec
            replay = EagerReplay(self.path.trace, runner.fed, self.tape_spans, watches, pre_watch,
                                 rewrite)
            upto, error = runner.pos, None
            try:
                env = replay.run(upto)
            except tf.errors.OpError as e:  # the op raises as in eager; say which one it is
                # the program may catch it (its `try` around the op) and go on with the values
                # made before it: the iteration goes on, traced, from the op that failed
                env, upto, error = replay.env, replay.at, with_location(e, self, replay.at)
                if upto is None:
                    raise error from None
            self.replayed = env
            bind_placeholders(runner.placeholders, env)
            rec = ContinuingRecorder(self.site.label, CONFIG.max_trace_ops,
                                     young_gc=CONFIG.tracing_gc_threshold)
            rec.seed(replay.as_run(), upto, runner.fed, env, runner.placeholders,
                     self.path.units, [f for f in runner.fetch_log if f.ref.record < upto],
                     replay, runner.born)
            runner.placeholders = {}
            for handle, variable in runner.handles.values():
                rec.variable_handle(variable, handle)
            hook.set_active(None)
            rec.start(self.frame, self.path.trace.records[upto - 1].location if upto else None,
                      self.frame_lasti)
            hook.set_active(None)  # internal() hands ops to the recorder when Terra's work is done
            rec.release_seed()
            self.recorder = rec
            self.mode = Mode.TRACING
        if error is not None:
            raise error from None
        s.inflight.raise_error()
        return rec


def with_location(error, it, index, late=False):
    """`error` (an OpError) re-made with the recorded op and source line that raised it; `late`:
    it belongs to an iteration the program has already left."""
    rec = it.path.trace.records[index] if index is not None else None
    if rec is None:
        return error
    extra = (f"terra: raised by op #{index} {rec.function or rec.op_type} recorded at "
             f"{rec.location.describe()} in iteration {it.number} at {it.site.label}")
    if late:
        extra += "; it ran after that iteration's last sync point, so it surfaces here"
    return at_recorded_line(extended_error(error, extra, index), rec.location)
