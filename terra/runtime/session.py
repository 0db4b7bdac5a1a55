"""The session: the table of sites, tape enter/exit routing, and `stats` / `explain` /
`reset`.

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

The rooms it uses: sites.py (Site and Path data, signatures, what cannot be compiled, the
path an iteration is predicted to take), filing.py (a finished trace filed under its path,
built or not, and whether the site gives up), generalize.py (changed constants become feeds),
policy.py (when a path is built and when a site gives up), inflight.py (iterations whose runs
are still going, late errors), mode.py (an iteration's modes), builds.py (building and installing the graphs of paths, on this thread or the
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

from terra.config import CONFIG
from terra.runtime.mode import Mode
from terra.runtime import units as unit_rules
from terra.runtime import explain
from terra.runtime.builds import Builds
from terra.runtime.explain import Counters, Event, EventKind
from terra.runtime.fallback import Snapshot
from terra.runtime.filing import Filing
from terra.runtime.inflight import InFlight
from terra.runtime.interrupts import held_interrupts
from terra.runtime.iteration import Iteration
from terra.runtime.path_graph import ConfiguredRunner
from terra.runtime.divergence import Divergence, user_line
from terra.runtime.python_runner import PythonRunner
from terra.runtime.roles import VariableRoles
from terra.runtime.executable import PathRun
from terra.runtime.site_graph import SiteRun
from terra.runtime.sites import Site
from terra.runtime.tiers import Tiers
from terra.tracing import gc_window, hook
from terra.tracing.recorder import ContinuingRecorder
from terra.tracing.locations import caller_step_try

# Co-executed iterations hold the garbage collector's young window open from one to the next
# (`coexec_gc_threshold`); every COLLECT_EVERY of them the young generation is collected between
# two, so the program's cyclic garbage (a batch caught in a reference cycle, say) waits at most
# that many steps, not until the window's allocations add up (7 net a step on the coexec CNN).
COLLECT_EVERY = 16


# ------------------------------------------------------------------------------------ session
class Session:
    """Process-wide state (one user thread is co-executed at a time)."""

    def __init__(self):
        self.sites: dict = {}
        self.iteration: Iteration | None = None
        self.events: list = []
        self.counters = Counters()
        self.coexec_window = 0   # co-executed iterations that handed the gc window on
        self._installed = False
        self._graphs: list = []
        self.runner = ConfiguredRunner(error_context=self._error_context)
        self._warned: set = set()
        self.internal_depth = 0
        self.layer_depth = 0
        self.variable_guards: dict = {}  # units.variable_guards' cache
        self.owner: int | None = None    # the thread whose tapes Terra runs (threading ident)
        self._foreign_warned: set = set()
        self.tape_functions: dict = {}   # forward function name -> TapeRecordedFunction
        self.function_ops: dict = {}     # function name -> op types in its body
        self.roles = VariableRoles()      # where each variable was made (roles.py)
        self.builds = Builds(sites=self.sites, counters=self.counters, graphs=self._graphs,
                             event=self.event, internal=self.internal, go_eager=self._go_eager,
                             warm=self.runner.warm,
                             tiers=Tiers(self.runner, self.runner.warm))
        self.filing = Filing(builds=self.builds, counters=self.counters, event=self.event,
                             go_eager=self._go_eager)
        self.inflight = InFlight(runner=self.runner, graphs=self._graphs, internal=self.internal,
                                 counters=self.counters, event=self.event,
                                 current=lambda: self.iteration)

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def internal(self):
        """Run Terra's own TF calls without interception; afterwards route ops to whatever the
        current iteration needs (it may have changed inside)."""
        self.internal_depth += 1
        hook.set_active(None)
        try:
            yield
        finally:
            self.internal_depth -= 1
            if not self.internal_depth:
                hook.set_active(self._interceptor())

    def _interceptor(self):
        it = self.iteration
        if it is None:
            return None
        if it.mode == Mode.SKIP:
            return it.runner
        if it.mode == Mode.TRACING and it.recorder is not None and it.recorder.recording:
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

    def event(self, kind, site, it_number, detail, where="", reason=""):
        e = Event(EventKind(kind), site.label, it_number, detail, where or "", reason)
        self.events.append(e)
        if CONFIG.verbose:
            print(f"terra: {e}")

    def count_fallback(self, it, d: Divergence) -> None:
        self.counters.fallbacks += 1
        it.site.fallbacks += 1
        it.fallback_gap = it.number - it.site.last_fallback
        it.site.last_fallback = it.number
        self.event("fallback", it.site, it.number, f"{d.reason}: expected {d.expected}, "
                    f"observed {d.observed} (op #{d.position})", d.location, d.reason)

    def _ensure_hook(self):
        if not self._installed:
            hook.install()
            self._installed = True
            hook.route_units(unit_rules.router(self))
            hook.on_variable(self.roles.created)

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
        if it is not None and it.mode != Mode.DONE:
            if key != it.site.key and it.frame_alive():
                it.add_tape(tape)
                return
            if it.young_gc:
                # from one co-executed iteration to the next the window stays open: closed in
                # between, the young objects the last one still holds would be collected (and
                # promoted) at once by the program's threshold
                with gc_window.widened(CONFIG.coexec_gc_threshold):
                    with held_interrupts(), self.internal():  # the step Python left completes first
                        it.finish()
                    self.coexec_window += 1
                    if self.coexec_window % COLLECT_EVERY == 0 and gc_window.collect_young():
                        self.counters.young_collections += 1
                    self._enter_site(key, frame, tape)
                return
            with held_interrupts(), self.internal():  # the step Python left completes first
                it.finish()
        self._enter_site(key, frame, tape)

    def _enter_site(self, key, frame, tape) -> None:
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
        if site.deferred:  # (Filing.file, `last`): what the last iteration's end left to do
            todo, site.deferred = site.deferred, []
            number = self.counters.iterations + 1  # (the iteration begun below)
            with held_interrupts(), self.internal():
                for step in todo:
                    step(number)
        if self.inflight.pending and (site.eager_reason is not None or
                                      site.predict() is None):
            with held_interrupts():  # ops of this iteration run eagerly: earlier runs end first
                self.inflight.collect()
        prev = self.iteration
        if prev is not None and prev.predicted:
            held = prev.site.holds_runs()
            prev.site.misses.append(prev.missed)
            if prev.site.holds_runs() != held:
                self.event("hold", prev.site, prev.number, (
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
            it.mode = Mode.EAGER
            return
        path = site.predict()
        if path is not None:
            path = self.builds.by_role(site, path, it.number, self.roles)
            site.phase = "coexecution"
            it.mode = Mode.SKIP
            it.widen_gc(CONFIG.coexec_gc_threshold)
            it.path = path
            it.runner = PythonRunner(it, path.view)
            sg = site.site_graph
            plan = sg.plan_of(path) if sg is not None and CONFIG.site_graph else None
            it.use(SiteRun(sg, plan, it.runner, path) if plan is not None else PathRun(path))
            it.predicted = True
            it.hold_for(path)
            if CONFIG.coexecution and it.exe.starts_early():
                it.start_graph(early=True)
            hook.set_active(it.runner)
            return
        site.phase = "tracing"
        it.mode = Mode.TRACING
        rec = ContinuingRecorder(site.label, CONFIG.max_trace_ops,
                                 young_gc=CONFIG.tracing_gc_threshold)
        rec.start(frame)
        it.recorder = rec

    def tape_exit(self, tape, exc_type) -> None:
        it = self.iteration
        if it is None or self.foreign():
            return
        if tape in it.tapes:
            it.tape_exited(tape)
        if exc_type is None or it.mode != Mode.SKIP:
            return
        it.fallback(Divergence(user_line(), "no exception", exc_type.__name__, it.runner.pos,
                               "exception in the iteration"))

    def _go_eager(self, site, number, reason):
        site.eager_reason = reason
        self.event("eager", site, number, f"site stays eager: {reason}")
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
                if it is not None and it.mode != Mode.DONE:
                    with self.internal():
                        it.finish(last=True)
                self.inflight.collect()
                with self.internal():  # no run is left: take what runs left unread
                    for g in self._graphs:
                        g.drop_stale(now=True)
        finally:
            self.iteration = None
            self.owner = None
            hook.set_active(None)

    def stats(self) -> dict:
        it = self.iteration
        phase = "idle"
        if it is not None:
            phase = {Mode.SKIP: "coexecution", Mode.TRACING: "tracing", Mode.EAGER: "eager",
                     Mode.DONE: it.site.phase}[it.mode]
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
        self.builds.tiers.shutdown()
        Snapshot.forget_templates()
        if self._installed:
            hook.on_variable(None)
            hook.uninstall()
            self._installed = False
        self.__init__()
        gc.collect()  # destroy dropped graphs' queues and variables now, not inside later code


SESSION = Session()
