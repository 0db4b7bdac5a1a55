"""The session: the table of sites, tape enter/exit routing, trace filing and graph builds,
pipelined iterations, and `stats` / `explain` / `reset`.

An *iteration* runs from one `TerraGradientTape.__enter__` to the next `__enter__` at the same
program site (ARCHITECTURE.md §2); a tape entered at another site while the iteration's frame is
still running (a GAN's second tape, a nested tape) belongs to the current iteration.

Per site the session goes through phases:
- tracing: the iteration runs eagerly under a Recorder; the trace is filed under its *path
  signature* (records, feed specs, coarse units), after generalizing constants that changed
  between traces of the same path into feeds;
- co-execution: once a path is due for a build (policy.py: at its second sighting, or its first
  on a site that has compiled), its graph is generated and the next iterations run it on the
  GraphRunner while the PythonRunner skips the user's ops along the same path;
- eager: a site that needed more than `max_traces` traces or `max_fallbacks` fallbacks, or whose
  traces cannot be compiled, stays eager (one warning, reason in `explain()`).

The rooms it uses: sites.py (Site and Path data, signatures, what cannot be compiled),
generalize.py (changed constants become feeds), policy.py (when a path is built and when a site
gives up), builds.py (building and installing the graphs of paths, on this thread or the
builder's), path_graph.py (one path as one graph), site_graph.py (all compiled paths of a site as
one lowered graph), iteration.py (one iteration: skip mode, switches, fallback, end), units.py
(coarse units: gradient, apply_gradients, layer and tf.function calls), explain.py (events,
`explain()`, `summary()`).
"""
from __future__ import annotations

import contextlib
import gc
import threading
import warnings

import tensorflow as tf

from terra import _tf_private as tfp
from terra.config import CONFIG
from terra.runtime import units as unit_rules
from terra.runtime import explain
from terra.runtime.builds import Builds
from terra.runtime.explain import Counters, Event, EventKind
from terra.runtime.fallback import EagerReplay, Snapshot
from terra.runtime.held import held_refs
from terra.runtime.interrupts import held_interrupts
from terra.runtime.iteration import Iteration, with_location
from terra.runtime.iteration_end import FAILED
from terra.runtime.path_graph import ConfiguredRunner
from terra.runtime.divergence import Divergence, user_line
from terra.runtime.path_view import PathView
from terra.runtime.python_runner import PythonRunner
from terra.runtime.roles import VariableRoles
from terra.runtime.executable import PathRun
from terra.runtime import policy
from terra.runtime.site_graph import SiteRun
from terra.runtime.generalize import generalize, read_changed_spans
from terra.runtime.sites import (KNOWN_FALLBACK_GAP, KNOWN_REUSE_GAP, Path, Site,
                                 path_signature, reads_feed_values,
                                 uncompilable, units_for)
from terra.tracing import hook
from terra.tracing.recorder import ContinuingRecorder
from terra.tracing.locations import caller_step_try


# ------------------------------------------------------------------------------------ session
class Session:
    """Process-wide state (one user thread is co-executed at a time)."""

    def __init__(self):
        self.sites: dict = {}
        self.iteration: Iteration | None = None
        self.events: list = []
        self.counters = Counters()
        self._installed = False
        self._graphs: list = []
        self.runner = ConfiguredRunner(error_context=self._error_context)
        self._warned: set = set()
        self._depth = 0
        self._layer_depth = 0
        self.pending: list = []          # finished iterations whose runs are not collected yet
        self.owner: int | None = None    # the thread whose tapes Terra runs (threading ident)
        self._foreign_warned: set = set()
        self.deferred_error = None       # an earlier iteration's error, raised at a sync point
        self._tape_functions: dict = {}   # forward function name -> TapeRecordedFunction
        self._function_ops: dict = {}     # function name -> op types in its body
        self.roles = VariableRoles()      # where each variable was made (roles.py)
        self.builds = Builds(sites=self.sites, counters=self.counters, graphs=self._graphs,
                             event=self._event, internal=self.internal, go_eager=self._go_eager)

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def internal(self):
        """Run Terra's own TF calls without interception; afterwards route ops to whatever the
        current iteration needs (it may have changed inside)."""
        self._depth += 1
        hook.set_active(None)
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                hook.set_active(self._interceptor())

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
        if it is not None and it.exe is not None:
            index = it.exe.record_of(index)
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
        self.events.append(Event(EventKind.EAGER, where, 0, f"thread {name!r}: its Terra tapes "
                                 f"run as plain tapes (Terra co-executes one thread at a time; "
                                 f"another thread's iterations are running)", ""))
        warnings.warn(f"terra: tapes on thread {name!r} run eagerly: Terra co-executes one "
                      f"thread at a time and another thread holds it (see terra.explain())",
                      RuntimeWarning, stacklevel=4)

    def _event(self, kind, site, it_number, detail, where="", reason=""):
        e = Event(EventKind(kind), site.label, it_number, detail, where or "", reason)
        self.events.append(e)
        if CONFIG.verbose:
            print(f"terra: {e}")

    def count_fallback(self, it, d: Divergence) -> None:
        self.counters.fallbacks += 1
        it.site.fallbacks += 1
        it.fallback_gap = it.number - it.site.last_fallback
        it.site.last_fallback = it.number
        self._event("fallback", it.site, it.number, f"{d.reason}: expected {d.expected}, "
                    f"observed {d.observed} (op #{d.position})", d.location, d.reason)

    def _ensure_hook(self):
        if not self._installed:
            hook.install()
            self._installed = True
            hook.route_units(unit_rules.router(self))
            hook.on_variable(self.roles.created)

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
            outs = FAILED
        finally:
            self.pending.remove(it)
            it.pending = False
        if outs is not FAILED:
            with self.internal():
                it.outputs = it.exe.outputs(outs, self.runner.fetch)
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
        self.counters.fallbacks += 1
        it.site.fallbacks += 1
        self._event("fallback", it.site, it.number, "the graph run failed after the iteration's "
                    "last sync point; replayed eagerly" + (f": {type(error).__name__}"
                                                           if error is not None else ""))
        if error is not None and self.deferred_error is None:
            self.deferred_error = with_location(error, it, rp.at, late=True)

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
            site = self.sites[key] = Site(key, label, caller_step_try=caller_step_try(frame))
        self._begin(site, frame, tape)

    def _begin(self, site, frame, tape) -> None:
        self._ensure_hook()
        hook.set_active(None)
        if self.builds.builder.jobs:
            with self.internal():
                self.builds.install_finished()
        if self.pending and (site.eager_reason is not None or self._predict(site) is None):
            with held_interrupts():  # ops of this iteration run eagerly: earlier runs end first
                self.collect_pending()
        prev = self.iteration
        if prev is not None and prev.predicted:
            held = prev.site.holds_runs()
            prev.site.misses.append(prev.missed)
            if prev.site.holds_runs() != held:
                self._event("hold", prev.site, prev.number, (
                    f"{sum(prev.site.misses)} of the last {len(prev.site.misses)} compiled "
                    "iterations left the path they started on: runs wait until Python has told "
                    "their path apart from the others") if not held else (
                    "predictions hold again: runs start with the iteration"))
        self.counters.iterations += 1
        it = Iteration(self, site, frame, self.counters.iterations)
        it.add_tape(tape)
        self.iteration = it
        if site.eager_reason is not None:
            site.phase = "eager"
            it.mode = "eager"
            return
        path = self._predict(site)
        if path is not None:
            path = self.builds.by_role(site, path, it.number, self.roles)
            site.phase = "coexecution"
            it.mode = "skip"
            it.path = path
            it.runner = PythonRunner(it, path.view)
            sg = site.site_graph
            plan = sg.plan_of(path) if sg is not None and CONFIG.site_graph else None
            it.use(SiteRun(sg, plan, it.runner) if plan is not None else PathRun(path))
            it.predicted = True
            it.hold_for(path)
            if CONFIG.coexecution and it.exe.starts_early():
                it.start_graph(early=True)
            hook.set_active(it.runner)
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

    # ---------------------------------------------------------------- traces
    def finish_trace(self, it) -> None:
        rec = it.recorder
        trace = rec.stop()
        live = held_refs(rec)
        self.counters.traces += 1
        site = it.site
        if not trace.records:
            # no TF op ran (the program raised, or skipped the step, before its first op): no
            # evidence about the site's paths, so nothing is filed and nothing counts against it
            self._event("trace", site, it.number, "empty iteration (no TF op ran): not filed")
            return
        site.traces += 1
        units = units_for(trace, rec.units)
        why = uncompilable(trace, units)
        sig = path_signature(trace, units)
        path = site.paths.get(sig)
        if path is None and why is None and not reads_feed_values(units):
            # the most general path first: its generalization keeps what it already feeds
            for other in sorted(site.paths.values(), key=lambda p: -len(p.trace.feeds)):
                if other.signature[2] != sig[2] or other.why_uncompilable() or \
                        reads_feed_values(other.units):
                    continue
                g = generalize(other.trace, trace, read_changed_spans(units, other.units))
                if g is not None:
                    trace = g
                    units = units_for(g, rec.units)
                    sig = path_signature(g, units)
                    path = site.paths.get(sig)
                    if path is None:
                        path = Path(sig, trace, units, id=site.new_path_id(), count=other.count,
                                    first_seen=other.first_seen, liveouts=set(other.liveouts),
                                    fetch_points=dict(other.fetch_points),
                                    outside_reads=set(other.outside_reads))
                        site.paths[sig] = path
                        self._event("trace", site, it.number, f"path p{other.id} generalized "
                                    f"to p{path.id}: changing Python values become feeds")
                    break
        new = path is None
        if new:
            path = Path(sig, trace, units, id=site.new_path_id(), first_seen=it.number,
                        late=any(p.graph is not None for p in site.paths.values()))
            site.paths[sig] = path
        elif path.by_role:
            # predicted over new variables, now traced: its units' guards are this trace's (a
            # unit guarded on an object made anew with the variables, such as a task's optimizer)
            path.units, path.by_role, path.view = units, False, None
        path.absorb(trace, live, trace.fetches, site.seen_objects)
        path.last_seen = it.number
        for v in trace.feed_values:  # tensors seen as feeds: a unit may rely on TF's cached ones
            if isinstance(v, tfp.EagerTensorBase) and v.shape.num_elements() <= 64:
                site.seen_objects[id(v)] = v
        detail = (f"new path p{path.id} ({len(trace.records)} ops, {len(trace.feeds)} feeds)"
                  if new else f"path p{path.id} seen {path.count} times")
        if why:
            detail += f"; not compilable: {why}"
        building = self.builds.builder.building(path)
        if building and it.fallback_gap is not None:
            # its graph is being built: the fallback is the cost of not waiting for it
            site.known_fallbacks += 1
            detail += "; its graph is being built: not held against max_fallbacks"
        elif not new and it.fallback_gap is not None and it.fallback_gap >= KNOWN_FALLBACK_GAP:
            # a path seen before, reached after a run of compiled iterations (an epoch's end):
            # a known, bounded cost per occurrence, so it does not count towards max_fallbacks
            site.known_fallbacks += 1
            detail += "; a known path after compiled iterations: not held against max_fallbacks"
        self._event("trace", site, it.number, detail, "")
        if new and why is None and CONFIG.shape_groups and not CONFIG.site_graph and \
                self.builds.join_group(site, path, it.number) == "reuse" and \
                it.fallback_gap is not None:
            # a new shape on a group's graph costs this trace and no build: bounded per shape
            # (a site whose shapes never repeat gives up through the churn rule below)
            site.known_fallbacks += 1
        if why is None and path.stale and (path.count >= 2 or policy.compiled(site)):
            # a path not yet due for a build still takes another path's graph over its own
            # variables at once (no build: a task's model made anew); a compiled path that
            # learned a fetch is rebuilt at once
            due = path.graph is not None or policy.due(site, path, it.number)
            self.builds.build(site, path, it.number, reuse_only=not due)
            if new and path.rebound is not None and it.fallback_gap is not None and \
                    it.fallback_gap >= KNOWN_REUSE_GAP:
                site.known_fallbacks += 1  # a bounded cost per occurrence: see KNOWN_REUSE_GAP
        elif path.view is None and path.graph is not None:
            path.view = PathView(path.trace, path.usable_units(), site.key, site.caller_step_try)
        for other in list(site.paths.values()):
            # a compiled path that learned a fetch in this iteration (Iteration.get: a value
            # Python read where the path's graph did not fetch it) is rebuilt now: a stale path
            # is never predicted, and might never be traced again to be rebuilt
            if other is not path and other.graph is not None and other.stale:
                self.builds.build(site, other, it.number)
        if path.graph is not None:
            site.last_path = path
        site.note_path(path)
        if why is not None and path.count >= 2 and site.eager_reason is None and \
                self._predict(site) is None:
            self._go_eager(site, it.number, f"a repeating path cannot be compiled: {why}")
        if site.eager_reason is None and self._predict(site) is None and \
                site.traces >= CONFIG.max_traces and \
                id(site) not in self.builds.builder.sites_building():
            self._go_eager(site, it.number, f"{site.traces} traces without a compilable repeat"
                           + (f" (last: {why})" if why else ""))
        verdict = policy.give_up(policy.Tally.of(site, CONFIG.max_traces, CONFIG.max_fallbacks))
        if verdict is not None and site.eager_reason is None:
            self._go_eager(site, it.number, verdict[1])

    def _go_eager(self, site, number, reason):
        site.eager_reason = reason
        self._event("eager", site, number, f"site stays eager: {reason}")
        if site.key not in self._warned:
            self._warned.add(site.key)
            warnings.warn(f"terra: {site.label} runs eagerly from now on: {reason} "
                          f"(see terra.explain())", RuntimeWarning, stacklevel=4)

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
            hook.set_active(None)

    def stats(self) -> dict:
        it = self.iteration
        phase = "idle"
        if it is not None:
            phase = {"skip": "coexecution", "tracing": "tracing", "eager": "eager",
                     "done": it.site.phase}[it.mode]
        with self.internal():
            stall = sum(g.stall_seconds for g in self._graphs)
        return {**self.counters.as_dict(), "phase": phase,
                "graph_exec_s": self.runner.exec_seconds, "graph_stall_s": stall}

    def explain(self) -> str:
        return explain.render(self.events, self.sites.values(), CONFIG.site_graph)

    def summary(self, max_sites: int = 8) -> str:
        return explain.summary(self.stats(), self.sites.values(), self.events, max_sites)

    def reset(self) -> None:
        """Forget everything (an error still pending from the last iteration is dropped)."""
        try:
            self.end()
        except Exception:  # noqa: BLE001 - a reset discards the session's state
            pass
        with self.internal():
            self.runner.cancel(timeout=CONFIG.timeout_s)
        self.builds.builder.shutdown()
        Snapshot.forget_templates()
        if self._installed:
            hook.on_variable(None)
            hook.uninstall()
            self._installed = False
        self.__init__()
        gc.collect()  # destroy dropped graphs' queues and variables now, not inside later code


SESSION = Session()
