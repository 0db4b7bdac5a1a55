"""Locations tell apart the cases Terra must not confuse (ARCHITECTURE §2)."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf

from terra.ir.records import Location
from terra.tracing import Recorder
from terra.tracing.locations import Locator, find_loops

X = tf.constant([1.0, 2.0])


def _record(fn, *args):
    with Recorder() as rec:
        fn(*args)
    return rec.trace


def _locs(trace, op_type):
    return [r.location for r in trace.records if r.op_type == op_type]


def _iters(loc: Location):
    return tuple(l.iteration for l in loc.loops)


def test_two_calls_of_the_same_layer_differ():
    layer = keras.layers.Dense(2)
    layer(X[None])

    def prog():
        layer(X[None])
        layer(X[None])
    a, b = _locs(_record(prog), "MatMul")
    diff = [i for i, (f, g) in enumerate(zip(a.frames, b.frames)) if f != g]
    assert len(a.frames) == len(b.frames) and len(diff) == 1
    assert "prog@" in a.frames[diff[0]]  # the user's call site, nothing else


def test_same_op_in_two_branches_differs():
    def prog(flag):
        if flag:
            return tf.add(X, 1.0)
        else:
            return tf.add(X, 1.0)
    (a,) = _locs(_record(prog, True), "AddV2")
    (b,) = _locs(_record(prog, False), "AddV2")
    assert a != b and len(a.frames) == len(b.frames)
    (a2,) = _locs(_record(prog, True), "AddV2")
    assert a2 == a  # and stable across recordings


def _recurse(x, n):
    x = tf.add(x, 1.0)
    return _recurse(x, n - 1) if n else x


def test_recursion_depths_differ():
    locs = _locs(_record(_recurse, X, 2), "AddV2")
    assert len(set(locs)) == 3
    assert [len(l.frames) for l in locs] == sorted(len(l.frames) for l in locs)


def test_loop_iterations_counted_even_when_they_skip_ops():
    def prog(n, skip):
        for i in range(n):
            if i in skip:
                continue
            tf.add(X, 1.0)

    a = _locs(_record(prog, 4, {1, 2}), "AddV2")
    b = _locs(_record(prog, 4, {0, 2}), "AddV2")
    assert [_iters(l) for l in a] == [(0,), (3,)]
    assert [_iters(l) for l in b] == [(1,), (3,)]
    assert a[1] == b[1] and a[0] != b[0] and a[0].site == b[0].site


def test_while_loops_one_line_loops_and_nesting():
    def prog():
        i = 0
        while i < 3:
            i += 1
            if i == 2:
                continue
            tf.add(X, 1.0)
        for j in range(2): tf.multiply(X, 2.0)  # noqa: E701
        for a in range(2):
            for b in range(3):
                if b == 1:
                    tf.subtract(X, 1.0)
    t = _record(prog)
    assert [_iters(l) for l in _locs(t, "AddV2")] == [(0,), (2,)]
    assert [_iters(l) for l in _locs(t, "Mul")] == [(0,), (1,)]
    assert [_iters(l) for l in _locs(t, "Sub")] == [(0, 1), (1, 1)]
    assert len({l.loops[0].loop for l in _locs(t, "Sub")}) == 1


def test_comprehensions_and_generators():
    def gen(n):
        for k in range(n):
            if k != 1:
                yield tf.add(X, float(k))

    def prog():
        [tf.multiply(X, 2.0) for _ in range(3)]
        for _ in gen(3):
            pass
    t = _record(prog)
    muls = _locs(t, "Mul")
    assert [_iters(l) for l in muls] == [(0,), (1,), (2,)]
    assert "listcomp" in muls[0].frames[-1] or any("listcomp" in f for f in muls[0].frames)
    adds = _locs(t, "AddV2")
    assert len(set(adds)) == 2
    assert [l.loops[-1].iteration for l in adds] == [0, 2]  # the generator's own loop
    assert any("gen" in f for f in adds[0].frames)


def test_sequential_layers_in_a_library_loop_differ():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2), keras.layers.Dense(2)])
    model(X[None])
    a, b = _locs(_record(lambda: model(X[None])), "MatMul")
    assert a.frames == b.frames and a != b  # told apart by Keras's loop over layers


def test_the_loop_around_the_recording_is_not_part_of_locations():
    traces = []
    for step in range(3):
        with Recorder() as rec:
            tf.add(X, 1.0)
        traces.append(rec.trace)
    locs = [t.records[0].location for t in traces]
    assert locs[0] == locs[1] == locs[2]
    assert sys.gettrace() is None  # loop tracking is off again


def test_find_loops_merges_continue_targets():
    def f():
        i = 0
        while i < 3:
            i += 1
            if i == 2:
                continue
        return i
    loops = find_loops(f.__code__)
    assert len(loops) == 1 and len(loops[0][2]) == 2


def test_locator_rejects_missing_root():
    import pytest
    with pytest.raises(ValueError):
        Locator(None)


def test_without_line_tracing_loops_are_counted_at_op_time():
    def prog(n, skip):
        for i in range(n):
            if i in skip:
                continue
            tf.add(X, 1.0)
    with Recorder(track_loops=False) as rec:
        prog(4, {1, 2})
    # Passes that issue ops are still told apart; the op-less passes 1 and 2 are not counted.
    assert [_iters(l) for l in _locs(rec.trace, "AddV2")] == [(0,), (1,)]
    assert sys.gettrace() is None


def test_loop_tracking_is_off_when_the_interpreter_exits_inside_an_iteration():
    """A program whose last step is still being recorded at exit (its end is only known at the
    next tape entry) must not leave the trace function on while modules are torn down."""
    import subprocess
    import textwrap
    script = textwrap.dedent("""
        import atexit, sys
        atexit.register(lambda: print("trace at exit:", sys.gettrace()))  # runs after Terra's
        import numpy as np, tensorflow as tf, terra
        w = tf.Variable(np.ones((3, 3), "float32"))
        for step in range(2):
            with tf.TerraGradientTape() as tape:
                total = 0.0
                for k in range(2):  # a user loop: its frame is line-traced while recording
                    total += tf.reduce_sum(w * k)
            w.assign_sub(0.1 * tape.gradient(total, w))
        print("tracing after the loop:", sys.gettrace() is not None)
    """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "tracing after the loop: True" in out.stdout, out.stdout
    assert "trace at exit: None" in out.stdout, out.stdout
    assert "Exception ignored" not in out.stderr, out.stderr[-3000:]


def _gen_ops(x, n):
    for k in range(n):  # a user generator: resumed from the loop below, pass by pass
        yield tf.sin(x * k)


def _fact(x, n):
    return x if n == 0 else tf.cos(_fact(x, n - 1))


def test_memoized_frames_give_the_locations_of_a_full_walk():
    """Locator.location takes the key of unchanged caller frames from its memo; every op must
    still get the Location a walk of every frame gives (generators, recursion, user and
    library loops, a layer called at the same offset pass after pass)."""
    from terra.tracing import locations
    seq = keras.Sequential([keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    seq(X[None])
    opt = keras.optimizers.SGD(0.1)

    def prog():
        for _ in range(3):
            y = seq(X[None])
        total = tf.reduce_sum(y)
        ts = []
        for t in _gen_ops(X, 3):  # no op between the generator's passes
            ts.append(t)
        total += tf.reduce_sum(tf.stack(ts))
        n = 0
        while n < 3:
            total += tf.reduce_sum(seq(X[None] * n))
            n += 1
        total += tf.reduce_sum(_fact(X, 4))
        total += sum(tf.reduce_sum(seq(X[None] + k)) for k in range(2))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(seq(X[None]))
        opt.apply_gradients(zip(tape.gradient(loss, seq.trainable_variables),
                                seq.trainable_variables))
        return total

    def record(memo):
        old = locations._MEMO
        locations._MEMO = memo
        try:
            with Recorder() as rec:
                prog()
            return [r.location for r in rec.trace.records], rec._locator.memo_hits
        finally:
            locations._MEMO = old

    # identical objects come from one interning table: a suite that has interned 2**18 keys
    # before this test would clear it between (or inside) the two recordings
    locations._nodes.clear()
    locations._generation += 1
    full, no_hits = record(False)
    memoized, hits = record(True)
    assert no_hits == 0 and hits > len(full) // 2
    assert len(memoized) == len(full)
    assert [i for i, (a, b) in enumerate(zip(memoized, full)) if a is not b] == []
    assert len(set(map(id, full))) > 20  # the program's ops are at many distinct locations


def test_the_no_loop_shortcut_finds_what_disassembly_finds(monkeypatch):
    """`find_loops` skips disassembly for code without a backward-jump opcode: over every
    function of a few modules (loops of every kind among them), the shortcut changes nothing."""
    import inspect
    import json.decoder
    import types
    from terra.tracing import locations

    def sample(x):
        while x > 0:
            x -= 1
        return [y for y in range(3)], x

    funcs = [sample] + [f for mod in (json.decoder, inspect, locations)
                        for f in vars(mod).values() if isinstance(f, types.FunctionType)]
    fast = [locations.find_loops(f.__code__) for f in funcs]
    monkeypatch.setattr(locations, "_BACKWARD_OPCODES", frozenset(range(256)))
    slow = [locations.find_loops(f.__code__) for f in funcs]
    assert fast == slow
    assert sum(bool(x) for x in slow) >= 10 and sum(not x for x in slow) >= 10


class _Boxed:
    """A value TF converts only through its conversion registry, which the C fast path of a
    generated op wrapper does not consult: the wrapper takes its eager fallback."""

    def __init__(self, t):
        self.t = t


tf.register_tensor_conversion_function(
    _Boxed, lambda v, dtype=None, name=None, as_ref=False: tf.convert_to_tensor(v.t, dtype))


def test_the_fast_path_and_the_eager_fallback_of_an_op_are_one_location():
    """`gen_math_ops.sub` issues its op from the C fast path, or from `sub_eager_fallback`
    when an input is not an eager tensor (in co-execution, a value the graph has not computed
    yet): one program point, one location (else two paths of a site could not share the op)."""
    from tensorflow.python.ops import gen_math_ops
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "sub_eager_fallback":
            calls.append(frame.f_code.co_name)

    def prog(a):
        return gen_math_ops.sub(a, X)
    (fast,) = _locs(_record(prog, X), "Sub")
    sys.setprofile(profile)
    try:
        (slow,) = _locs(_record(prog, _Boxed(X)), "Sub")
    finally:
        sys.setprofile(None)
    assert calls == ["sub_eager_fallback"]  # (the second really took the fallback)
    assert fast == slow and fast.frames[-1] == "gen_math_ops.py:sub@op"


def test_an_operator_and_its_raw_op_have_the_users_frame_over_the_op():
    """`x * 0.5` reaches `Mul` through TF's operator plumbing (override, traceback filter,
    dispatch, `math_ops.multiply`, weak-tensor wrapper); skip mode issues it through
    `tf.raw_ops.Mul` (runtime/python_runner.py): both locations are the user's frame over the
    op, so traces recorded each way share it. A Keras layer's op keeps its frames."""
    dense = keras.layers.Dense(2, use_bias=False)
    dense(X[None])

    def prog(a):
        a * 0.5
        tf.raw_ops.Mul(x=a, y=tf.constant(0.5))
        dense(a[None])

    mul_eager, mul_raw = _locs(_record(prog, X), "Mul")
    (matmul,) = _locs(_record(prog, X), "MatMul")
    for loc in (mul_eager, mul_raw):
        assert loc.frames[-1] == "gen_math_ops.py:mul@op"
        assert loc.frames[-2].startswith("test_locations.py:test_an_operator"), loc.frames
    assert any(f.startswith("dense.py:Dense.call@") for f in matmul.frames[:-1]), matmul.frames


def test_a_sum_of_tensors_keeps_its_location_once_the_interpreter_specializes_the_call():
    """CPython 3.11 runs a call of a C function in its PRECALL once the code is specialized
    (after a few runs), else in the CALL: `f_lasti` of the frame calling `sum` moves from one
    to the other, and with it the location of every op `sum` issues (traces of a site recorded
    before and after would not share them)."""
    def prog(xs):
        return sum(x * x for x in xs)
    def record(xs):  # (no trace function: CPython runs the specialized code, as in skip mode)
        with Recorder(track_loops=False) as rec:
            prog(xs)
        return _locs(rec.trace, "AddV2")
    xs = [X, X + 1.0]
    cold = record(xs)
    for _ in range(12):
        prog(xs)
    assert record(xs) == cold


def _library_codes():
    """Every code object (nested ones included) of the functions and methods of modules a step
    runs through, and of this package's locator."""
    import types

    from keras.src.layers import layer
    from keras.src.optimizers import base_optimizer
    from tensorflow.python.eager import backprop
    from tensorflow.python.ops import math_ops, nn_ops
    from terra.tracing import locations

    def codes(c):
        yield c
        for k in c.co_consts:
            if isinstance(k, types.CodeType):
                yield from codes(k)

    for mod in (layer, base_optimizer, backprop, math_ops, nn_ops, locations):
        for obj in vars(mod).values():
            for fn in [obj] + (list(vars(obj).values()) if isinstance(obj, type) else []):
                fn = getattr(fn, "__func__", fn)
                if isinstance(fn, types.FunctionType):
                    yield from codes(fn.__code__)


def test_precall_offsets_read_from_raw_bytecode_are_those_dis_gives():
    """`_precalls` scans the raw bytecode; `dis` is the reference (CPython 3.11 has PRECALL;
    elsewhere both are empty)."""
    import dis

    from terra.tracing import locations

    def by_dis(code):
        out, pending = {}, None
        for ins in dis.get_instructions(code):
            if pending is not None and ins.opname == "CALL":
                out[pending] = ins.offset
            pending = ins.offset if ins.opname == "PRECALL" else None
        return out

    seen = 0
    for c in _library_codes():
        assert locations._precalls(c) == by_dis(c), c.co_qualname
        seen += 1
    assert seen > 500


def test_loops_read_from_raw_bytecode_are_those_dis_gives():
    """`find_loops` reads backward jumps (EXTENDED_ARG included: a loop body of more than 255
    instructions) from the raw bytecode; the same ranges and heads as from `dis`."""
    import dis

    from terra.tracing import locations

    def by_dis(code):  # the same merging, from dis' Instructions
        if not locations._BACKWARD_OPCODES.intersection(code.co_code[::2]):
            return ()
        line_starts, jumps = set(), []
        for ins in dis.get_instructions(code):
            if ins.starts_line is not None:
                line_starts.add(ins.offset)
            if ins.opname in locations._BACKWARD_JUMPS:
                jumps.append((ins.argval, ins.offset))
        loops = []
        for start, end in sorted(jumps):
            for loop in loops:
                s, e, heads = loop
                if s <= start <= e and end > e or start == s:
                    loop[1] = max(e, end)
                    heads[start] = start in line_starts
                    break
            else:
                loops.append([start, end, {start: start in line_starts}])
        loops.sort(key=lambda l: (l[0], -l[1]))
        return tuple((s, e, dict(h)) for s, e, h in loops)

    src = "def long_loop(xs):\n    t = 0\n    for x in xs:\n" + \
        "".join(f"        t += x * {k}\n" for k in range(300)) + "    return t\n"
    ns = {}
    exec(compile(src, "<long_loop>", "exec"), ns)
    looped = 0
    for c in list(_library_codes()) + [ns["long_loop"].__code__]:
        loops = find_loops(c)
        assert loops == by_dis(c), c.co_qualname
        looped += bool(loops)
    assert looped > 50
    (start, end, _), = find_loops(ns["long_loop"].__code__)
    assert end - start > 2 * 255
