"""Constants that differ between a site's paths become feeds its plan puts
(terra/compiler/site_constants.py)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from terra.compiler.merge import merge  # noqa: E402
from terra.compiler.site_constants import feed_constants, varying_places  # noqa: E402
from terra.ir.records import (SITE_CONSTANT, ConstRef, Feed, FeedRef, Location,  # noqa: E402
                              LoopIter, OpRecord, OutputRef, TensorSpec, Trace)

F32 = (("T", "float32"),)
X = TensorSpec("float32", (2,))


def loc(line, *loops):
    return Location(("train.py:step@1", f"model.py:f@{line}"),
                    tuple(LoopIter(f"model.py:f@{l}", i) for l, i in loops))


def trace(*ops):
    """ops: (op_type, inputs, location[, attrs[, output spec]]) after a fed input `x` (slot 0,
    record 0 reads it)."""
    recs = [OpRecord(0, "Identity", F32, (FeedRef(0),), (X,), loc(0))]
    for k, op in enumerate(ops, 1):
        recs.append(OpRecord(k, op[0], op[3] if len(op) > 3 else F32, tuple(op[1]),
                             (op[4] if len(op) > 4 else X,), op[2]))
    return Trace("train.py:step@1", recs, [Feed(0, X, "numpy")], [None])


def c(v, dtype="float32", origin=None):
    return ConstRef(v, dtype, origin)


RESHAPE = (("T", "float32"), ("Tshape", "int32"))


def episode(ret, steps, shape):
    """A scaled input (the scale differs per path), a loop-index constant per step (the same
    on every path), a reshape to a shape that differs per path."""
    ops = [("Mul", [OutputRef(0), c(ret)], loc(1))]
    for k in range(steps):
        ops.append(("Add", [OutputRef(len(ops)), c(float(k))], loc(2, (5, k))))
    ops.append(("Reshape", [OutputRef(len(ops)), c(shape, "int32")], loc(3), RESHAPE,
                TensorSpec("float32", shape)))
    return trace(*ops)


def test_only_constants_that_differ_between_paths_are_fed():
    a, b = episode(0.5, 2, (1, 2)), episode(0.7, 3, (2, 1))
    places = varying_places([a, b])
    # the scale and the reshape's shape vary; the loop index agrees at every common pass
    assert {(p[0][1], p[1]) for p in places} == {("Mul", 1), ("Reshape", 1)}
    (fa, fb), (pa, pb) = feed_constants([a, b], places)
    # the reshape's output shape follows its value: it stays a constant
    assert pa == {1: c(0.5)} and pb == {1: c(0.7)}
    assert fa.records[1].inputs == (OutputRef(0), FeedRef(1))
    assert fa.feeds[1] == Feed(1, TensorSpec("float32", ()), SITE_CONSTANT)
    assert fa.feed_values[1] == 0.5
    assert fa.records[-1].inputs == a.records[-1].inputs
    assert [r.inputs for r in fa.records[2:-1]] == [r.inputs for r in a.records[2:-1]]
    assert a.records[1].inputs == (OutputRef(0), c(0.5))  # (the input trace is not changed)


def test_one_tensor_object_is_one_feed():
    """A constant used twice through one tensor object (`origin`: a forward op and its
    gradient) is one slot; two objects that hold equal values are two."""
    def t(v):
        return trace(("Mul", [OutputRef(0), c(v, origin=1)], loc(1)),
                     ("Mul", [OutputRef(1), c(v, origin=1)], loc(1)),
                     ("Mul", [OutputRef(2), c(v, origin=2)], loc(1)))
    (fa, _), (pa, _) = feed_constants([t(0.5), t(0.25)])
    assert [r.inputs[1] for r in fa.records[1:]] == [FeedRef(1), FeedRef(1), FeedRef(2)]
    assert pa == {1: c(0.5), 2: c(0.5)}


def test_same_constants_everywhere_feed_nothing():
    a, b = episode(0.5, 2, (1, 2)), episode(0.5, 3, (1, 2))
    assert varying_places([a, b]) == frozenset()
    traces, puts = feed_constants([a, b])
    assert traces == [a, b] and puts == [{}, {}]


def test_fed_constants_let_two_paths_share_the_op():
    a, b = episode(0.5, 2, (1, 2)), episode(0.7, 2, (1, 2))

    def muls(g):
        return [n for n in g.op_nodes if n.op.op_type == "Mul"]
    assert len(muls(merge(merge(None, a), b))) == 2
    (fa, fb), _ = feed_constants([a, b])
    (m,) = muls(merge(merge(None, fa), fb))
    assert set(m.seen) == {0, 1}
