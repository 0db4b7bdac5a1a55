"""Feed and fetch channels between the Python side and a running graph.

Both are `tf.queue.FIFOQueue`s created eagerly and captured by the graph function:
- `FeedChannel` (Input-Feeding, Case-Select, Loop-Cond): Python `put`s eagerly, the graph dequeues
  with `dequeue_op()` and blocks (inside the graph, GIL released) until Python has fed.
- `FetchChannel` (Output-Fetching): the graph runs `enqueue_op(t)`, Python `get`s.

No Python-side wait blocks unboundedly: `get` polls the queue's size with a short spin and an
exponential sleep backoff (a blocking eager dequeue could neither time out nor be interrupted by
Ctrl-C, since the GIL-free C++ wait does not return to the interpreter), and raises
`TerraTimeoutError` naming the channel when the bound is reached. While it polls it also calls a
`watch` callable (the graph runner's `check`), so a failed or cancelled graph is reported at once
instead of after the timeout.

Stall accounting: a timed `dequeue_op` brackets the dequeue with two `tf.timestamp` ops (the first
waits for the same control inputs as the dequeue, so it fires when the dequeue becomes runnable)
and adds the difference to a float64 variable: the channel's own, or, given a `StallTimer`, the
one variable of the graph being built, updated once at the graph's end with the sum of its
dequeues' waits (a path graph with 90 feeds made 90 variables eagerly, and ran 180 ops more a
step, with one per channel). `FetchChannel.get` accumulates the Python-side wait.
"""
import collections
import time

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.errors import ChannelClosedError, TerraRuntimeError, TerraTimeoutError

__all__ = ["FeedChannel", "FetchChannel", "FeedFetchOrder", "StallTimer", "case_select_channel",
           "loop_cond_channel", "DEFAULT_TIMEOUT", "wait_until", "Unread"]

# Python's side of a channel runs TF's raw queue ops (public, no per-call name scope)
_QueueEnqueue = tf.raw_ops.QueueEnqueueV2
_QueueDequeue = tf.raw_ops.QueueDequeueV2
_QueueSize = tf.raw_ops.QueueSizeV2

#: Bound, in seconds, of every Python-side wait when the caller gives none.
DEFAULT_TIMEOUT = 60.0

_SPIN_S = 300e-6      # poll without sleeping for this long first (lowest latency)
_SLEEP_MIN_S = 50e-6  # then sleep, doubling from this ...
_SLEEP_MAX_S = 500e-6  # ... up to this (added latency and polling cost of long waits)
# A fetch first sleeps _EXPECT_SHARE of the shortest of its channel's last _RECENT_WAITS waits
# (a steady program waits about as long at the same fetch every iteration): a few polls per
# fetch instead of dozens, at a latency cost only when a value comes much earlier than ever lately
_RECENT_WAITS = 8
_EXPECT_SHARE = 0.8


def wait_until(ready, what, timeout=None, watch=None, expect=0.0):
    """Poll `ready()` until true; bounded by `timeout` (TerraTimeoutError naming `what`).

    `what` is a string, or a callable that makes one on a timeout (a channel's description is
    formatted from its dtypes and shapes: too dear for every wait).
    `watch()`, if given, is called between polls and may raise to abort the wait (e.g. the graph
    failed). `expect`, if given, is a wait the caller is confident lasts at least that long (the
    shortest of the last few of the same kind): it is slept in one piece before polling starts,
    since each poll of a channel is an eager op that takes the program's thread for tens of
    microseconds. Returns the seconds waited. KeyboardInterrupt propagates from the sleep.
    """
    if ready():
        return 0.0
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    start = time.perf_counter()
    deadline = start + timeout
    spin_until = start + _SPIN_S
    delay = _SLEEP_MIN_S
    if expect > _SPIN_S:
        time.sleep(min(expect, timeout))
        spin_until = start  # polls from here on sleep: the value is due about now
    while True:
        now = time.perf_counter()
        if ready():
            return now - start
        if watch is not None:
            watch()
        if now >= deadline:
            if ready():  # it came while the watch ran
                return time.perf_counter() - start
            raise TerraTimeoutError(what, timeout)
        if now >= spin_until:
            time.sleep(delay)
            delay = min(delay * 2, _SLEEP_MAX_S)


def wait_event(event, what, timeout=None) -> float:
    """Block on threading.Event `event` until it is set; bounded by `timeout`
    (TerraTimeoutError naming `what`). Unlike polling, it neither adds latency nor takes a
    core from the graph's threads; waits in slices so Ctrl-C is seen between them (a lock wait
    is interrupted by signals on POSIX anyway). Returns the seconds waited."""
    if event.is_set():
        return 0.0
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    start = time.perf_counter()
    deadline = start + timeout
    while not event.wait(min(0.1, max(0.0, deadline - time.perf_counter()))):
        if time.perf_counter() >= deadline:
            raise TerraTimeoutError(what, timeout)
    return time.perf_counter() - start


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


class _Channel:
    """A FIFOQueue of fixed component dtypes/shapes, created eagerly."""

    kind = "channel"

    def __init__(self, dtypes, shapes=None, name=None, capacity=None):
        if not tf.executing_eagerly():
            raise RuntimeError(
                f"create {type(self).__name__} {name!r} eagerly, outside tf.function")
        single = not isinstance(dtypes, (list, tuple))
        self.dtypes = tuple(tf.dtypes.as_dtype(d) for d in _as_list(dtypes))
        if not self.dtypes:
            raise ValueError(f"{type(self).__name__} {name!r} needs at least one dtype")
        if shapes is None:
            self.shapes = tuple(tf.TensorShape(None) for _ in self.dtypes)
        else:
            shapes = [shapes] if single else list(shapes)
            if len(shapes) != len(self.dtypes):
                raise ValueError(f"{name!r}: {len(shapes)} shapes for {len(self.dtypes)} dtypes")
            self.shapes = tuple(tf.TensorShape(s) for s in shapes)
        self.single = single
        self.name = name or f"terra_{self.kind}"
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got {capacity!r}")
        self.capacity = capacity
        known = all(s.is_fully_defined() for s in self.shapes)
        # bytes of one element (None: a shape not fixed, or a string)
        self.element_bytes = sum(s.num_elements() * d.size for d, s in
                                 zip(self.dtypes, self.shapes)) \
            if known and all(d != tf.string for d in self.dtypes) else None
        self.queue = tf.queue.FIFOQueue(
            capacity if capacity is not None else 2**31 - 1, list(self.dtypes),
            shapes=list(self.shapes) if known else None, name=self.name.replace("/", "_"))

    def __repr__(self):
        comps = ", ".join(f"{d.name}{list(s) if s.rank is not None else '[?]'}"
                          for d, s in zip(self.dtypes, self.shapes))
        return f"{type(self).__name__}({self.name!r}: {comps})"

    def size(self):
        """Number of elements in the queue now (eager)."""
        # (the raw op: `QueueBase.size` opens a name scope per call, and a fetch polls this)
        return int(_QueueSize(handle=self.queue.queue_ref))

    def _pack(self, comps):
        return comps[0] if self.single else tuple(comps)

    def _convert(self, value):
        comps = [value] if self.single else _as_list(value)
        if len(comps) != len(self.dtypes):
            raise ValueError(
                f"{self.name}: expected {len(self.dtypes)} components, got {len(comps)}")
        out = []
        for v, d, s in zip(comps, self.dtypes, self.shapes):
            # (an eager tensor of the dtype is its own conversion: TF's dispatch for it costs
            # more than the enqueue's Python; the commit token and most data come so)
            if isinstance(v, tfp.EagerTensorBase) and v.dtype == d:
                t = v
            elif type(v) is np.ndarray and v.dtype == d.as_numpy_dtype:
                t = tfp.eager_tensor_of_array(v, d)  # (what conversion does, without its
                # dispatch: a feed of the batch's array every step)
            else:
                t = tf.convert_to_tensor(v, dtype=d)
            if s.rank is not None and not s.is_compatible_with(t.shape):
                raise ValueError(f"{self.name}: value of shape {t.shape} does not fit {s}")
            out.append(t)
        return out

    def drain(self):
        """Drop every queued element (eager; e.g. leftover feeds after a cancelled run)."""
        n = self.size()
        for _ in range(n):
            self.queue.dequeue()
        return n

    def close(self):
        self.queue.close(cancel_pending_enqueues=True)

    @property
    def closed(self):
        return bool(self.queue.is_closed())


class StallTimer:
    """The graph-wide stall accumulator of one graph function: timed dequeues built with it add
    their waits to `waits`; `close()`, at the end of the function's body, adds their sum to one
    variable (one update per run, after the graph's last dequeue)."""

    def __init__(self, name):
        with tf.init_scope():
            self.variable = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                        name=name.replace("/", "_") + "_stall")
        self.waits = []

    def close(self):
        """Inside the function being built: the update of the variable (None: no timed wait)."""
        if not self.waits:
            return None
        return self.variable.assign_add(tf.add_n(self.waits))

    @property
    def seconds(self) -> float:
        return float(self.variable.numpy())

    def reset(self) -> None:
        self.variable.assign(0.0)


class FeedChannel(_Channel):
    """Python -> graph. `put` eagerly; `dequeue_op` inside the graph function."""

    kind = "feed"

    def __init__(self, dtypes, shapes=None, name=None, capacity=None, timed=True):
        super().__init__(dtypes, shapes, name, capacity)
        self.timed = timed
        self.puts = 0
        self._stall = None  # the channel's own accumulator, made by its first timed dequeue
        # built without a StallTimer

    def put(self, value, timeout=None):
        """Enqueue one element (non-blocking unless a bounded capacity is full)."""
        comps = self._convert(value)
        if self.capacity is not None:
            wait_until(lambda: self.size() < self.capacity, lambda: f"{self!r} (full)",
                       timeout)
        try:
            # the raw op: `QueueBase.enqueue` would convert and check again what `_convert`
            # made, in a name scope, on every put
            _QueueEnqueue(handle=self.queue.queue_ref, components=comps)
        except tf.errors.CancelledError as e:
            raise ChannelClosedError(f"{self!r} is closed") from e
        self.puts += 1

    def dequeue_op(self, control_inputs=(), stall: StallTimer | None = None):
        """Graph side: dequeue the next element (blocks the graph until Python has put it).

        `control_inputs` are ops that must run first (Output-Fetching ops that Python reads before
        supplying this feed, Figure 3.4). `stall`: the graph's StallTimer, which a timed dequeue
        reports its wait to (else the channel's own variable takes it). Returns a tensor, or a
        tuple for several components.
        """
        if tf.executing_eagerly():
            raise RuntimeError(f"{self!r}.dequeue_op() is for use inside a tf.function")
        control_inputs = list(control_inputs)
        if not self.timed:
            with tf.control_dependencies(control_inputs):
                comps = _as_list(self.queue.dequeue())
            return self._pack([self._restore_shape(c, s) for c, s in zip(comps, self.shapes)])
        with tf.control_dependencies(control_inputs):
            t0 = tf.timestamp()
        with tf.control_dependencies([t0]):
            comps = _as_list(self.queue.dequeue())
        with tf.control_dependencies(comps):
            t1 = tf.timestamp()
        if stall is not None:
            stall.waits.append(t1 - t0)
            return self._pack([self._restore_shape(c, s) for c, s in zip(comps, self.shapes)])
        if self._stall is None:
            with tf.init_scope():
                self._stall = tf.Variable(0.0, dtype=tf.float64, trainable=False,
                                          name=self.name.replace("/", "_") + "_stall")
        add = self._stall.assign_add(t1 - t0)
        # The value carries the timer update, so graphs without automatic control dependencies
        # (which prune unused stateful ops) keep it too.
        with tf.control_dependencies([add]):
            comps = [tf.identity(c) for c in comps]
        return self._pack([self._restore_shape(c, s) for c, s in zip(comps, self.shapes)])

    @staticmethod
    def _restore_shape(c, s):
        if s.rank is not None and not c.shape.is_fully_defined():
            c = tf.ensure_shape(c, s)
        return c

    @property
    def stall_seconds(self):
        """Cumulative seconds the graph waited on this channel's dequeues (timed channels built
        without a StallTimer: the others' waits are their graph's)."""
        return 0.0 if self._stall is None else float(self._stall.numpy())

    def reset_stats(self):
        if self._stall is not None:
            self._stall.assign(0.0)
        self.puts = 0


class FetchChannel(_Channel):
    """Graph -> Python. `enqueue_op` inside the graph function; `get` eagerly (bounded wait)."""

    kind = "fetch"

    def __init__(self, dtypes, shapes=None, name=None):
        super().__init__(dtypes, shapes, name, capacity=None)
        self.wait_seconds = 0.0
        self.gets = 0
        self._recent_waits = collections.deque(maxlen=_RECENT_WAITS)

    def enqueue_op(self, value):
        """Graph side: push `value` (a tensor, or a tuple of components). Returns the op."""
        if tf.executing_eagerly():
            raise RuntimeError(f"{self!r}.enqueue_op() is for use inside a tf.function")
        comps = [value] if self.single else _as_list(value)
        if len(comps) != len(self.dtypes):
            raise ValueError(
                f"{self.name}: expected {len(self.dtypes)} components, got {len(comps)}")
        return self.queue.enqueue(comps)

    def get(self, timeout=None, watch=None):
        """Wait (bounded) for the next element and return it as EagerTensor(s).

        Raises TerraTimeoutError naming this channel after `timeout` seconds
        (default `DEFAULT_TIMEOUT`), or whatever `watch()` raises (e.g. the graph's error).
        """
        recent = self._recent_waits
        expect = _EXPECT_SHARE * min(recent) if len(recent) == recent.maxlen else 0.0
        try:
            waited = wait_until(lambda: self.size() > 0, self.__repr__, timeout, watch, expect)
        except tf.errors.OpError as e:
            if self.closed:
                raise ChannelClosedError(f"{self!r} is closed") from e
            raise
        recent.append(waited)
        self.wait_seconds += waited
        self.gets += 1
        comps = _QueueDequeue(handle=self.queue.queue_ref, component_types=self.dtypes)
        return self._pack(comps)

    def reset_stats(self):
        self.wait_seconds = 0.0
        self.gets = 0


# Elements finished runs left unread are taken every DROP_EVERY collected runs, or as soon as they
# hold DROP_BYTES (or an element of unknown size): each take is a graph call on the program's
# thread, 0.5-3 ms beside a running graph, and wgan_gp made three per step.
DROP_EVERY = 8
DROP_BYTES = 32 << 20


class Unread(dict):
    """Fetch channel key -> elements finished runs left unread in it, oldest at the queue's head.
    The next reader of a channel skips its count first (and lowers it); the rest are taken in
    batches by `collected` (see DROP_EVERY) and by `drop`. A channel no later iteration reads
    (a value the program keeps but never reads) would otherwise grow by one element per run."""

    def __init__(self, channels: dict):
        super().__init__()
        self.channels = channels
        # key -> bytes of the latest value seen of a channel whose shape is not fixed (its
        # element's size is counted as that; an element of a size not seen is taken at once)
        self.seen_bytes = {}
        self.runs = 0          # runs collected since the last take
        self.droppers = {}    # sorted keys -> function taking a count per key

    def collected(self) -> None:
        """A run that counted here has ended: take the elements if they are due."""
        self.runs += 1
        if self.runs >= DROP_EVERY or self._bytes() >= DROP_BYTES:
            self.drop()

    def _bytes(self) -> float:
        total = 0
        for k, n in self.items():
            size = self.channels[k].element_bytes
            if size is None:
                size = self.seen_bytes.get(k)
            if n and size is None:
                return float("inf")
            total += n * (size or 0)
        return total

    def clear(self) -> None:
        super().clear()
        self.runs = 0

    def drop(self) -> None:
        """Dequeue every counted element now, in one graph call, and clear the counts. The
        elements must be there already (their runs have ended): the call raises
        TerraRuntimeError rather than block if one is missing. One function per set of
        channels, its counts an argument (a fixed-shape channel takes its count in one
        `QueueDequeueManyV2`)."""
        pattern = sorted(((k, n) for k, n in self.items() if n > 0), key=lambda kn: repr(kn[0]))
        self.clear()
        if not pattern:
            return
        keys = tuple(k for k, _ in pattern)
        fn = self.droppers.get(keys)
        if fn is None:
            fn = self.droppers[keys] = _dropper([self.channels[k] for k in keys])
        try:
            fn(tf.constant([n for _, n in pattern], tf.int32))
        except tf.errors.InvalidArgumentError:
            raise TerraRuntimeError("terra: fewer elements queued than counted as left unread "
                                    f"({', '.join(f'{k}: {n}' for k, n in pattern)})") from None


def _dropper(channels):
    """A function dequeuing `counts[i]` elements of `channels[i]` (the counts: an int32 vector)."""
    def drop(counts):
        checks = [tf.debugging.assert_greater_equal(ch.queue.size(), counts[i])
                  for i, ch in enumerate(channels)]
        with tf.control_dependencies(checks):
            for i, ch in enumerate(channels):
                if ch.element_bytes is not None:
                    ch.queue.dequeue_many(counts[i])
                else:  # (no many-dequeue without fixed shapes)
                    tf.while_loop(lambda j: j < counts[i],
                                  lambda j, q=ch.queue: _after(q.dequeue(), j + 1), [0])
    return tf.function(drop, autograph=False).get_concrete_function(
        tf.TensorSpec([len(channels)], tf.int32))


def _after(value, then):
    with tf.control_dependencies(tf.nest.flatten(value)):
        return tf.identity(then)


def case_select_channel(name="case_select"):
    """A scalar int32 FeedChannel that drives a `tf.switch_case` (Case-Select)."""
    return FeedChannel(tf.int32, [], name=name)


def loop_cond_channel(name="loop_cond"):
    """A scalar bool FeedChannel read by a `tf.while_loop` cond per iteration (Loop-Cond)."""
    return FeedChannel(tf.bool, [], name=name)


class FeedFetchOrder:
    """Emits Input-Feeding / Output-Fetching ops in trace order with the ordering that Python needs.

    Python performs feeds and fetches strictly in trace order; the graph executor does not. Call
    `feed` / `fetch` in the order the trace performs them, and each Input-Feeding op gets control
    dependencies on every Output-Fetching op before it (Figure 3.4: the fetched value may be what
    Python needs to compute the feed) and on the previous Input-Feeding op (so one queue's elements
    are matched in put order); each Output-Fetching op follows the previous fetch on its channel
    (so Python's `get`s see the values in order). Edges are added transitively: a feed depends on
    the previous feed and on the fetches since then, not on all earlier fetches one by one.

    Inside a `tf.function`, automatic control dependencies already chain ops on the same queue in
    construction order; these edges are what makes a graph built without them (or emitted out of
    trace order) safe, and they make the stall timer of a timed dequeue start when it can run.
    """

    def __init__(self, stall: StallTimer | None = None):
        self._last_feed = None
        self._fetches_since_feed = []
        self._last_fetch = {}
        self.stall = stall  # the graph's StallTimer, for the timed dequeues

    def feed(self, channel):
        control = list(self._fetches_since_feed)
        if self._last_feed is not None:
            control.append(self._last_feed)
        value = channel.dequeue_op(control_inputs=control, stall=self.stall)
        comps = list(value) if isinstance(value, tuple) else [value]
        self._last_feed = comps[0].op if len(comps) == 1 else tf.group(*comps)
        self._fetches_since_feed = []
        return value

    def fetch(self, channel, value):
        prev = self._last_fetch.get(id(channel))
        with tf.control_dependencies([prev] if prev is not None else []):
            op = channel.enqueue_op(value)
        self._last_fetch[id(channel)] = op
        self._fetches_since_feed.append(op)
        return op

    @property
    def all_ops(self):
        """Ops a graph built without automatic control dependencies must depend on to keep them."""
        ops = list(self._last_fetch.values())
        if self._last_feed is not None:
            ops.append(self._last_feed)
        return ops
