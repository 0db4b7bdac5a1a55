"""tracing/purity.py: which Python a watched call may run and still be skipped whole."""
import math
import random
import sys

import pytest
import tensorflow as tf

from terra.tracing import purity

CALLS = []
SCALE = 3.0


def pure(x, n=2):
    out = [x * k for k in range(n)]
    return max(out) + math.sqrt(len(out)) + abs(-x)


def draws(x):
    return x * random.random()


def appends(x):
    CALLS.append(x)
    return x


def reads_plain_global(x):
    return x * SCALE


def writes_item(d, x):
    d["k"] = x
    return x


def gen(x):
    yield x


def prints(x):
    print(x)
    return x


class Obj:
    def __init__(self):
        self.n = 0

    def bump(self):
        self.n += 1
        return self.n

    def read(self):
        return self.n + 1


def watched(fn, *args, forced=()):
    with purity.watch(forced) as w:
        fn(*args)
    return w


def test_impure_opcodes():
    assert purity.impure_opcode(pure.__code__) is None
    assert purity.impure_opcode(Obj.read.__code__) is None
    assert purity.impure_opcode(Obj.bump.__code__) == "STORE_ATTR"
    assert purity.impure_opcode(writes_item.__code__) == "STORE_SUBSCR"
    assert purity.impure_opcode(gen.__code__) in ("YIELD_VALUE", "RETURN_GENERATOR")


def test_a_pure_call_stays_pure_and_collects_the_attributes_it_reads():
    w = watched(pure, 3.0)
    assert w.reason is None
    w = watched(Obj().read)
    assert w.reason is None and "n" in w.attributes


@pytest.mark.parametrize("fn,args,why", [
    (draws, (1.0,), "random"),
    (appends, (1.0,), "append"),
    (reads_plain_global, (1.0,), "global 'SCALE'"),
    (writes_item, ({}, 1.0), "STORE_SUBSCR"),
    (prints, (1.0,), "print"),
    (lambda: Obj().bump(), (), "STORE_ATTR"),
])
def test_impure_calls_are_named(fn, args, why, capsys):
    w = watched(fn, *args)
    assert w.reason is not None and why in w.reason, w.reason


def test_a_closure_made_outside_the_call_is_impure_and_one_made_inside_is_not():
    k = 2.0

    def outside(x):
        return x * k
    assert "closure" in watched(outside, 1.0).reason

    def makes_inside(x):
        return [x * j for j in range(3)]  # a comprehension (its own code) reads x
    assert watched(makes_inside, 1.0).reason is None


def test_watches_nest_and_an_inner_verdict_reaches_the_outer_one():
    with purity.watch() as outer:
        pure(1.0)
        with purity.watch() as inner:
            draws(1.0)
        pure(1.0)
    assert inner.reason is not None and outer.reason == inner.reason
    with purity.watch() as outer:
        with purity.watch() as inner:
            pure(1.0)
        draws(1.0)  # the outer watch goes on after the inner one
    assert inner.reason is None and "random" in outer.reason


def test_another_profiler_means_nothing_is_watched():
    import sys

    def other(frame, event, arg):
        return None
    sys.setprofile(other)
    try:
        with purity.watch() as w:
            pure(1.0)
    finally:
        sys.setprofile(None)
    assert w.reason == "a profiler is installed"


def test_settings_freeze_containers_of_plain_values_only():
    class Holder:
        pass
    h = Holder()
    h.rate, h.cfg, h.obj, h.shape = 0.5, {"a": [1, 2]}, Obj(), (None, 4)
    got = dict(purity.settings(h))
    assert got["rate"] == 0.5 and got["shape"] == ("tuple", None, 4)
    assert got["cfg"] == ("dict", ("a", ("list", 1, 2))) and "obj" not in got
    h.cfg["a"].append(3)
    assert dict(purity.settings(h))["cfg"] != got["cfg"]
    assert purity.unguarded_attribute(h, {"obj"}, lambda v: False) is not None
    assert purity.unguarded_attribute(h, {"cfg", "rate"}, lambda v: False) is None


# ------------------------------------------------------- a watch while ops are recorded (the hook)
def _ops(x):
    return tf.reduce_sum(tf.nn.relu(x * 2.0) + 1.0)


def test_recording_ops_inside_a_watch_leaves_a_pure_call_pure_and_unwatched():
    """The hook suspends the watch while Terra records and locates an op (trusted code, whose
    every call would otherwise be an event): the call's verdict and the ops recorded are as
    before, and no event of Terra's own bookkeeping reaches the watch."""
    from terra.tracing import Recorder
    x = tf.ones((2, 2))
    events = []

    class Counting(purity.Watch):
        def __call__(self, frame, event, arg):
            if event == "call":
                events.append(frame.f_code.co_filename)
            return super().__call__(frame, event, arg)

    ctx = purity.watch()
    ctx.w = Counting()
    with Recorder() as rec:
        with ctx as w:
            _ops(x)
    assert w.reason is None
    assert [r.op_type for r in rec.trace.records][-4:] == ["Mul", "Relu", "AddV2", "Sum"]
    assert any(f.endswith("gen_nn_ops.py") for f in events)  # the op's own Python: watched
    assert not any(f.endswith(("/terra/tracing/recorder.py", "/terra/tracing/locations.py"))
                   for f in events)


def test_python_an_op_runs_is_still_watched():
    """An op's own execution stays watched inside the suspended dispatch: a `tf.py_function`
    whose Python draws a random number makes the call impure."""
    from terra.tracing import Recorder
    x = tf.ones((2,))

    def body(x):
        return tf.py_function(lambda v: v * random.random(), [x], tf.float32)

    with Recorder():
        with purity.watch() as w:
            body(x)
    assert w.reason is not None and "random" in w.reason


class _Counting(purity.Watch):
    def __init__(self):
        super().__init__()
        self.events = 0

    def __call__(self, frame, event, arg):
        self.events += 1
        return super().__call__(frame, event, arg)


def test_suspend_and_resume():
    assert purity.suspend() is None  # nothing installed: nothing to suspend
    purity.resume(None)
    assert sys.getprofile() is None
    with purity.watch() as w:
        got = purity.suspend()
        random.random()  # suspended: not seen
        while_suspended = w.reason
        purity.resume(got)
        random.random()  # watched again
    assert got is w and while_suspended is None and "random" in w.reason
    ctx = purity.watch()
    ctx.w = _Counting()
    with ctx as w:
        got = purity.suspend()
        w.reason = "decided"  # a verdict reached meanwhile: not watched again
        purity.resume(got)
        before = w.events
        len(())  # an event if watched
        after = w.events
    assert after == before
    assert sys.getprofile() is None
