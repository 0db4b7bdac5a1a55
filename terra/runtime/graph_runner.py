"""GraphRunner: runs the generated graph function on a background thread, cancellably.

Each `start(fn, args)` queues one *run* on a single daemon worker thread; runs execute in order,
one at a time. A run calls the ConcreteFunction's inference function through
`execute_with_cancellation` with a CancellationManager of its own. TF's usual route
(`CancellationManager.get_cancelable_function`) sets a module-global context that any other
thread's function call would pick up, so we never set it: the manager is passed explicitly and only
the worker thread's call is registered with it.

Pipelining: feeds are buffered in FIFO queues, so Python may `put` the feeds of iteration i+1 while
run i still computes, and may `start` run i+1 right away: the worker begins it as soon as run i
ends, and its first dequeue finds the values already queued. `result()` consumes runs in order.

Errors raised inside the graph are captured on the worker and re-raised in the user's thread at the
next sync point (`result`, `check`, `fetch`) as the same exception type eager would raise
(`tf.errors.InvalidArgumentError`, ...), with the message extended by `error_context(op_index)`
(the runtime maps graph node names back to recorded ops and user source lines). Node names follow
`op_node_name(index)`; `op_index_of(node_name)` parses them back.

Instantiation: a function's first call instantiates it (Grappler, partitioning, the executor's
set-up), about as long again as a run of a fresh training graph. `warm(fn)` queues that first
call between runs, under a manager already cancelled: TF instantiates the function, then stops
before any op runs ("cancelled before it was started"), so the run that follows (a later step's)
starts on an instantiated function while the program's thread goes on meanwhile.

Timing: `exec_seconds` is the wall time of runs on the worker; graph stall (waiting on feeds) is
measured inside the graph by timed FeedChannels; Python stall is the time spent in
`FetchChannel.get`. `timing(...)` gathers all three.
"""
import atexit
import collections
import dataclasses
import re
import threading
import time
import weakref

import tensorflow as tf

from terra import _tf_private as tfp
from terra.compiler.channels import DEFAULT_TIMEOUT, wait_event
from terra.compiler.names import op_index_of, op_node_name
from terra.errors import TerraRuntimeError

__all__ = ["GraphRunner", "GraphRun", "FetchResolver", "Timing", "timing", "op_node_name",
           "op_index_of", "with_error_context", "extended_error"]

_NODE_RE = re.compile(r"\{\{node ([^}]+)\}\}")


def _failing_op_index(error, index_of):
    # Innermost node first: a nested function reports the outer call node before the inner op.
    for node in reversed(_NODE_RE.findall(error.message)):
        idx = index_of(node)
        if idx is not None:
            return idx
    return None


def with_error_context(error, error_context, index_of=op_index_of):
    """The same OpError type as `error`, its message extended by `error_context(op_index)`."""
    if not isinstance(error, tf.errors.OpError) or error_context is None:
        return error
    idx = _failing_op_index(error, index_of)
    if idx is None:
        return error
    try:
        extra = error_context(idx)
    except Exception as hook_error:  # noqa: BLE001 - never lose the graph's own error
        extra = f"(error_context({idx}) failed: {hook_error!r})"
    if not extra:
        return error
    return extended_error(error, extra, idx)


def extended_error(error, extra, op_index):
    """A new OpError of `error`'s type whose message has `extra` appended; it carries
    `terra_op_index` (the recorded op that raised it)."""
    msg = f"{error.message}\n{extra}"
    cls = type(error)
    if cls is tf.errors.OpError:
        new = cls(error.node_def, error.op, msg, error.error_code)
    else:
        new = cls(error.node_def, error.op, msg)
    new.terra_op_index = op_index
    return new


class GraphRun:
    """One queued/running/finished execution of a graph function."""

    __slots__ = ("index", "fn", "args", "manager", "outputs", "error", "state", "exec_seconds",
                 "_done", "consumed", "cancel_requested", "before", "config", "committed")

    def __init__(self, index, fn, args, before=None, config=None):
        self.index = index
        self.fn = fn
        self.args = args
        self.before = before  # called on the worker right before fn (e.g. a variable snapshot)
        self.config = config  # mutates the ConfigProto fn is called with (None: as is)
        self.manager = tfp.CancellationManager()
        self.outputs = None
        self.error = None
        self.state = "pending"  # pending -> running -> ok | error | cancelled
        self.exec_seconds = 0.0
        self._done = threading.Event()
        self.consumed = False
        self.cancel_requested = False
        # its writes may have begun with nothing to restore them from: `cancel` lets it finish
        # (it needs nothing more from Python) rather than stop it half-way
        self.committed = False

    @property
    def done(self):
        return self._done.is_set()

    def __repr__(self):
        return f"GraphRun(#{self.index}, {self.state})"


_live_runners = weakref.WeakSet()


@atexit.register
def _shut_down_live_runners():
    # A worker thread still inside a graph (or inside TF at all) while the interpreter finalizes
    # can crash TF's teardown: every run is cancelled and every worker thread ended first. The
    # bound is generous: on a loaded machine a cancelled graph takes a while to unwind.
    for runner in list(_live_runners):
        try:
            runner.shutdown(timeout=60.0)
        except Exception:  # noqa: BLE001, S110 - best effort at exit
            pass


class GraphRunner:
    """Runs graph functions on one background daemon thread; see the module docstring."""

    def __init__(self, error_context=None, op_index_of=op_index_of, name="terra-graph-runner",
                 grappler=True):
        """`grappler=False` runs every function without Grappler rewrites: its arithmetic
        optimizer and constant folding reassociate float math, so only then are results
        bit-identical to eager."""
        if not isinstance(grappler, bool):
            raise TypeError(f"GraphRunner: grappler must be a bool, got {grappler!r}")
        self.grappler = grappler
        self.error_context = error_context
        self.op_index_of = op_index_of
        self.name = name
        self.exec_seconds = 0.0
        self.runs_finished = 0
        self.warmed = 0     # functions `warm` instantiated ahead of their first run
        self._runs = collections.deque()   # started and not yet consumed by result()
        self._work = collections.deque()   # not yet picked up by the worker
        self._cv = threading.Condition()
        self._thread = None
        self._closing = False   # shutdown(): the worker ends as soon as it has no work
        self._next_index = 0
        _live_runners.add(self)

    # ---- worker ---------------------------------------------------------------------------
    def _ensure_thread(self):
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name=self.name, daemon=True)
            self._thread.start()

    def _worker(self):
        while True:
            with self._cv:
                while not self._work:
                    if self._closing:
                        self._thread = None
                        return
                    if not self._cv.wait(timeout=5.0) and not self._work:
                        self._thread = None  # idle: let the thread end; restarted on demand
                        return
                run = self._work.popleft()
                if run.index is None:  # a warm-up (`warm`), not a run anyone waits for
                    warm = run
                else:
                    warm = None
                    run.state = "running"
            if warm is not None:
                self._instantiate(warm)
                warm = run = None
                continue
            t0 = time.perf_counter()
            try:
                if run.before is not None and not run.cancel_requested:
                    run.before()
                outputs = self._call(run)
                state, error = "ok", None
            except tf.errors.CancelledError as e:
                outputs, state, error = None, "cancelled", e
            except BaseException as e:  # noqa: BLE001 - re-raised in the user's thread
                outputs, state, error = None, "error", e
            dt = time.perf_counter() - t0
            with self._cv:
                run.outputs, run.error, run.exec_seconds = outputs, error, dt
                # (TF also trips the manager itself when an op fails, so ask our own flag)
                run.state = "cancelled" if run.cancel_requested and state != "ok" else state
                self.exec_seconds += dt
                self.runs_finished += 1
                run._done.set()
                self._cv.notify_all()
            # the idle wait holds nothing: a finished run's function (its graph) is freed as soon
            # as its owner lets go of it, not when the worker next runs or ends
            run = outputs = error = None

    def _instantiate(self, warm):
        try:
            self._call(warm)
        except tf.errors.CancelledError:
            self.warmed += 1  # instantiated; no op ran
        except Exception:  # noqa: BLE001 - the real run reports whatever this raised
            pass

    def _call(self, run):
        if run.config is not None:
            with tfp.function_call_config(run.config):
                return self._call_configured(run)
        return self._call_configured(run)

    def _call_configured(self, run):
        if self.grappler:
            return tfp.call_concrete_cancellable(run.fn, run.args, run.manager)
        with tfp.function_call_config(tfp.disable_grappler):  # thread-local: the worker's calls
            return tfp.call_concrete_cancellable(run.fn, run.args, run.manager)

    def shutdown(self, timeout=None):
        """Cancel every run and end the worker thread, waiting for it (bounded): used at
        interpreter exit. A later `start` starts a worker again."""
        self.cancel(timeout=timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(DEFAULT_TIMEOUT if timeout is None else timeout)
        with self._cv:
            self._closing = False

    # ---- user API -------------------------------------------------------------------------
    def start(self, fn, args=(), before=None, config=None):
        """Queue a run of `fn` (tf.function or ConcreteFunction) on flat tensor `args`.

        Tracing (for a tf.function) happens here, in the caller's thread. `before()`, if given,
        runs on the worker right before `fn` (after every earlier run ended; not at all if the run
        is cancelled before it starts): the place for a snapshot of the variables the run may
        write. `config(proto)`, if given, changes the ConfigProto this run's functions are
        called with (e.g. one Grappler optimizer turned off). Returns the GraphRun.
        """
        args = tuple(args)
        concrete = tfp.concrete_function_of(fn, args)
        flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(args, expand_composites=True)]
        with self._cv:
            run = GraphRun(self._next_index, concrete, flat, before, config)
            self._next_index += 1
            self._runs.append(run)
            self._work.append(run)
            self._ensure_thread()
            self._cv.notify_all()
        return run

    def warm(self, fn, config=None) -> None:
        """Queue the first instantiation of ConcreteFunction `fn` (taking no arguments but its
        captures) with the run config `config` its runs will have: the worker does it after the
        runs queued before, with no op run and nothing to consume (see the module docstring).
        Harmless when `fn` is instantiated already: the call then returns at once."""
        warm = GraphRun(None, fn, (), config=config)
        warm.manager.start_cancel()
        with self._cv:
            self._work.append(warm)
            self._ensure_thread()
            self._cv.notify_all()

    def instantiate(self, fn, config=None) -> None:
        """What `warm` does, on the calling thread (another than the worker): instantiate
        ConcreteFunction `fn` with run config `config` while the worker goes on."""
        warm = GraphRun(None, fn, (), config=config)
        warm.manager.start_cancel()
        self._instantiate(warm)

    @property
    def done(self):
        """True when no started run is pending or running."""
        with self._cv:
            return all(r.done for r in self._runs)

    @property
    def current(self):
        """The oldest run not yet consumed by `result()` (None if there is none)."""
        with self._cv:
            return self._runs[0] if self._runs else None

    def check(self):
        """Raise the error of a finished, failed run now (non-blocking sync point)."""
        with self._cv:
            failed = next((r for r in self._runs if r.done and r.state == "error"), None)
        if failed is not None:
            self._consume_through(failed)
            raise self._translate(failed.error)

    def _consume_through(self, run):
        with self._cv:
            while self._runs:
                r = self._runs.popleft()
                r.consumed = True
                if r is run:
                    break

    def _translate(self, error):
        if isinstance(error, tf.errors.OpError):
            new = with_error_context(error, self.error_context, self.op_index_of)
            if new is not error:
                return new.with_traceback(None)
        return error

    def result(self, timeout=None, run=None):
        """Wait (bounded) for `run` (default: the oldest unconsumed run); return its outputs or
        raise its error. Runs started before it are consumed with it.

        A cancelled run raises tf.errors.CancelledError. KeyboardInterrupt while waiting cancels
        the graph before it propagates.
        """
        if run is None:
            run = self.current
        if run is None:
            raise TerraRuntimeError("GraphRunner.result(): no run was started")
        what = f"graph run #{run.index} of {run.fn.name}"
        try:
            wait_event(run._done, what, timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise
        self._consume_through(run)
        if run.state == "ok":
            return run.outputs
        raise self._translate(run.error)

    def wait(self, run, timeout=None) -> None:
        """Wait (bounded) for `run` to end, without consuming it (`result` does); Ctrl-C while
        waiting cancels the graph before it propagates."""
        try:
            wait_event(run._done, f"graph run #{run.index} of {run.fn.name}", timeout)
        except KeyboardInterrupt:
            self.cancel()
            raise

    def fetch(self, channel, timeout=None):
        """`channel.get` that reports a failed graph at once and cancels it on Ctrl-C.

        Also fails at once (TerraRuntimeError) when every started run has ended and the channel
        is empty, instead of waiting for the timeout.
        """
        def watch():
            self.check()
            if self.done and channel.size() == 0:  # nothing left that could still produce it
                raise TerraRuntimeError(f"no graph run is active that could fill {channel!r}")

        try:
            return channel.get(timeout=timeout, watch=watch)
        except KeyboardInterrupt:
            self.cancel()
            raise

    def cancel(self, timeout=None, first=None):
        """Cancel the running run and drop pending ones; wait (bounded) until the worker is idle.
        With `first` (a GraphRun), only that run and the ones started after it are cancelled:
        earlier runs go on.

        Returns the runs that ended cancelled. Feeds Python already put stay queued: drain the
        channels (`FeedChannel.drain`) before the next run if they belong to the cancelled one.
        A committed run (`GraphRun.committed`) is waited for instead: stopped half-way, it would
        leave some of its writes made and others not. Without `first`, warm-ups still queued
        (`warm`) are dropped too.
        """
        with self._cv:
            runs = [r for r in self._runs if not r.done and (first is None or
                                                             r.index >= first.index)]
            spared = [r for r in runs if r.committed]
            runs = [r for r in runs if not r.committed]
            for r in runs:
                r.cancel_requested = True
                r.manager.start_cancel()
                if r.state == "pending":  # never picked up by the worker: end it here
                    r.state = "cancelled"
                    r.error = tf.errors.CancelledError(
                        None, None, f"graph run #{r.index} cancelled before it started")
                    r._done.set()
            # (a cancel of everything also drops queued warm-ups: they were for the runs to come)
            self._work = collections.deque(r for r in self._work if r not in runs and
                                           (first is not None or r.index is not None))
        timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        for r in spared:  # (they run before the cancelled ones: runs go in order)
            wait_event(r._done, f"committed graph run #{r.index}", timeout)
        for r in runs:
            wait_event(r._done, f"cancellation of graph run #{r.index}", timeout)
        with self._cv:
            self._runs = collections.deque(r for r in self._runs if r not in runs)
        return [r for r in runs if r.state == "cancelled"]


class FetchResolver:
    """Placeholder resolver that fetches the value from a running graph (one `runner.fetch`)."""

    __slots__ = ("runner", "channel", "timeout")

    def __init__(self, runner, channel, timeout=None):
        self.runner, self.channel, self.timeout = runner, channel, timeout

    def resolve(self):
        return self.runner.fetch(self.channel, timeout=self.timeout)

    def __repr__(self):
        return f"FetchResolver({self.channel!r})"


@dataclasses.dataclass(frozen=True)
class Timing:
    """Cumulative seconds: graph execution, graph waiting on feeds, Python waiting on fetches."""

    graph_exec_s: float
    graph_stall_s: float
    python_stall_s: float


def timing(runner, feeds=(), fetches=()):
    """Gather the runtime's timing counters (see the module docstring for what each measures)."""
    return Timing(
        graph_exec_s=runner.exec_seconds,
        graph_stall_s=sum(f.stall_seconds for f in feeds if f.timed),
        python_stall_s=sum(f.wait_seconds for f in fetches))
