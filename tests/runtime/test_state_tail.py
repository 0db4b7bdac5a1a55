"""A trace that cannot be compiled only for a `tf.data` iterator made after its step (the next
epoch's) is cut before it (terra/runtime/sites.py `state_tail`, `cut_trace`); anything else in
the tail, or a problem before it, keeps the trace whole."""
from terra.ir.records import ConstRef, Feed, Fetch, FeedRef, OpRecord, OutputRef, TensorSpec, Trace
from terra.runtime.path_view import GradUnit
from terra.runtime.sites import cut_trace, state_tail

_F = TensorSpec("float32", (2,))


def _rec(i, op, inputs=(), taped=True, outputs=(_F,)):
    return OpRecord(i, op, (), inputs, outputs, None, "fast", None, taped)


def _trace(tail_ops, taped=False, first=None):
    recs = [_rec(0, "Mul", (FeedRef(0), ConstRef(2.0, "float32"))),
            _rec(1, "AddV2", (OutputRef(0, 0), FeedRef(1)))]
    recs += [_rec(2 + i, op, (FeedRef(2),) if i == 0 else (), taped, ()) for i, op in
             enumerate(tail_ops)]
    feeds = [Feed(s, _F, "eager-tensor") for s in range(3)]
    t = Trace("s", recs, feeds, ["a", "b", "c"],
              [Fetch(OutputRef(1, 0), 2), Fetch(OutputRef(0, 0), 4)],
              unsupported=["AnonymousIteratorV3: creates state"])
    t.first_unsupported = 2 if first is None else first
    t.shape_reads = {OutputRef(1, 0): 5}
    return t


def test_an_iterator_made_after_the_step_is_cut_off_with_its_feeds():
    t = _trace(["AnonymousIteratorV3", "MakeIterator", "IteratorGetNext"])
    assert state_tail(t, {}) == 2
    c = cut_trace(t, 2)
    assert [r.op_type for r in c.records] == ["Mul", "AddV2"]
    assert [f.slot for f in c.feeds] == [0, 1] and c.feed_values == ["a", "b"]
    assert not c.unsupported and c.first_unsupported is None
    # a read after the cut is a read at the cut
    assert [(f.ref, f.after_record) for f in c.fetches] == [(OutputRef(1, 0), 2),
                                                           (OutputRef(0, 0), 2)]
    assert c.shape_reads == {OutputRef(1, 0): 2}


def test_other_tails_keep_the_trace_whole():
    assert state_tail(_trace(["VarHandleOp", "AnonymousIteratorV3"]), {}) is None  # (state
    # made first: an optimizer's slots, the step's own)
    # what follows a new iterator is the program's (Keras' validation pass, its metrics)
    assert state_tail(_trace(["AnonymousIteratorV3", "VarHandleOp"]), {}) == 2
    assert state_tail(_trace(["AnonymousIteratorV3"], taped=True), {}) is None  # in the step
    assert state_tail(_trace(["AnonymousIteratorV3"], first=0), {}) is None  # a problem before
    unit = GradUnit(1, 3, (), ())
    assert state_tail(_trace(["AnonymousIteratorV3"]), {1: unit}) is None  # inside a unit
    ok = _trace(["AnonymousIteratorV3"])
    ok.first_unsupported = None
    assert state_tail(ok, {}) is None  # nothing to cut: compilable as it is
