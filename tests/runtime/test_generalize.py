"""`generalize.generalize`: which constants of two traces of one path become feeds.

Constants are compared by value, and tied by the tensor object they were (`ConstRef.origin`):
two objects that hold equal values by chance get a slot each, and a constant that changed at
one pass of a Python loop is fed at every pass through the same place."""
from terra.ir.records import (ConstRef, Feed, FeedRef, Location, LoopIter, OpRecord,
                              TensorSpec, Trace)
from terra.runtime.generalize import generalize

F32 = TensorSpec("float32", (2,))


def _mul(i, const, loop_pass=None):
    loops = () if loop_pass is None else (LoopIter("prog.py:step@10", loop_pass),)
    return OpRecord(i, "Mul", (("T", "float32"),), (FeedRef(0), const), (F32,),
                    Location(("prog.py:step@20",), loops))


def _trace(consts, loops=True):
    records = [_mul(i, c, i if loops else None) for i, c in enumerate(consts)]
    return Trace("s", records, [Feed(0, F32, "numpy")], [None])


def _c(value, origin):
    return ConstRef(value, "float32", origin)


def _inputs(trace):
    return [r.inputs[1] for r in trace.records]


def test_equal_values_of_two_objects_get_two_slots():
    base = _trace([_c(1.0, 0), _c(1.0, 1)], loops=False)
    new = _trace([_c(2.0, 0), _c(2.0, 1)], loops=False)
    g = generalize(base, new)
    assert _inputs(g) == [FeedRef(1), FeedRef(2)]
    assert g.feed_values[1:] == [2.0, 2.0]


def test_one_object_used_twice_is_one_slot():
    base = _trace([_c(1.0, 0), _c(1.0, 0)], loops=False)
    new = _trace([_c(2.0, 3), _c(2.0, 3)], loops=False)
    assert _inputs(generalize(base, new)) == [FeedRef(1), FeedRef(1)]


def test_constants_of_unknown_origin_share_a_slot_by_value():
    base = _trace([_c(1.0, 0), ConstRef(1.0, "float32")], loops=False)
    new = _trace([_c(2.0, 0), ConstRef(2.0, "float32")], loops=False)
    assert _inputs(generalize(base, new)) == [FeedRef(1), FeedRef(1)]


def test_a_constant_changed_at_one_pass_is_fed_at_every_pass():
    base = _trace([_c(1.0, 0), _c(2.0, 1), _c(3.0, 2)])
    new = _trace([_c(5.0, 0), _c(2.0, 1), _c(3.0, 2)])
    g = generalize(base, new)
    assert _inputs(g) == [FeedRef(1), FeedRef(2), FeedRef(3)]
    assert g.feed_values[1:] == [5.0, 2.0, 3.0]


def test_outside_a_loop_only_changed_constants_are_fed():
    base = _trace([_c(1.0, 0), _c(2.0, 1)], loops=False)
    new = _trace([_c(5.0, 0), _c(2.0, 1)], loops=False)
    assert _inputs(generalize(base, new)) == [FeedRef(1), _c(2.0, 1)]


def test_a_trace_that_differs_only_at_fed_slots_is_an_instance_of_the_path():
    base = generalize(_trace([_c(1.0, 0), _c(2.0, 1)]), _trace([_c(5.0, 0), _c(2.0, 1)]))
    again = generalize(base, _trace([_c(7.0, 0), _c(8.0, 1)]))
    assert again is not None and _inputs(again) == _inputs(base)
    assert again.feed_values[1:] == [7.0, 8.0]


def test_identical_traces_do_not_generalize():
    t = _trace([_c(1.0, 0)])
    assert generalize(t, _trace([_c(1.0, 0)])) is None
