"""Commit-gated writes (terra/compiler/commit.py): which ops can fail, which graphs can be gated,
and what a gated graph does: nothing written until the commit token, nothing written by a run
that fails, whatever the order of the failing op and the writes."""
import os
from types import SimpleNamespace

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.compiler import commit  # noqa: E402
from terra.compiler.channels import FeedChannel, FetchChannel  # noqa: E402
from terra.compiler.names import op_node_name  # noqa: E402
from terra.runtime.graph_runner import GraphRunner  # noqa: E402


class _Records:
    """Records as `gate_writes` reads them: an op type (and route) per index."""

    def __init__(self):
        self.records = []

    def op(self, fn, *args, **kwargs):
        """Run `fn` in the name scope of a new record whose op type is the op `fn` makes."""
        index = len(self.records)
        self.records.append(None)
        with tf.name_scope(op_node_name(index)):
            out = fn(*args, **kwargs)
        op = out if isinstance(out, tf.Operation) else out.op
        self.records[index] = SimpleNamespace(op_type=op.type, route="op")
        return out


def _gated(build, var):
    """A concrete function whose body `build(rec, var, x)` is gated; returns it, the commit
    channel, the feed channel of `x`, and what `gate_writes` returned."""
    gate = FeedChannel("bool", (), name="t_commit", timed=False)
    feed = FeedChannel("int32", (), name="t_x", timed=False)
    fetch = FetchChannel("float32", (), name="t_fetch")
    out = {}

    def body():
        rec = _Records()
        x = feed.dequeue_op()
        loss, later = build(rec, var, x)
        fetch.enqueue_op(loss)
        out["tainted"] = commit.gate_writes(tf.compat.v1.get_default_graph().get_operations(),
                                            commit.record_types(rec.records),
                                            gate.dequeue_op)
        return loss, later  # (an op nothing uses is pruned, and never fails)
    fn = tf.function(body, autograph=False).get_concrete_function()
    return fn, gate, feed, fetch, out["tainted"]


def _step(rec, var, x):
    """Loss from a gather by the fed index (fails out of range), then an update of `var`, then
    a second gather by the index after the update in program order."""
    table = tf.constant([1.0, 2.0, 3.0])
    picked = rec.op(tf.gather, table, x)
    loss = rec.op(tf.multiply, picked, var.read_value())
    rec.op(lambda: var.assign_sub(loss * 0.5, read_value=False))
    later = rec.op(tf.gather, table, x + 1)  # after the write, independent of it
    return loss, later


def test_fallible_ops():
    @tf.function(autograph=False)
    def f(i, n):
        t = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        ops = {
            "add": tf.add(t, t),
            "gather": tf.gather(t, i),
            "slice_const": t[0:1],
            "slice_data": tf.slice(t, [i, 0], [1, 2]),
            "floordiv_int": tf.math.floordiv(n, n),
            "floordiv_float": tf.math.floordiv(t, t),
            "reshape_unknown": tf.reshape(t, tf.stack([n, -1])),
            "reshape_known": tf.reshape(t, [4]),
            "check": tf.debugging.check_numerics(t, "x"),
        }
        got = {k: commit.fallible(v.op) for k, v in ops.items()}
        assert got == {"add": False, "gather": True, "slice_const": False, "slice_data": True,
                       "floordiv_int": True, "floordiv_float": False, "reshape_unknown": True,
                       "reshape_known": False, "check": True}, got
        return t
    f(tf.constant(0), tf.constant(2))


def test_writes_wait_for_the_commit_and_every_fallible_op():
    var = tf.Variable(1.0)
    fn, gate, feed, fetch, tainted = _gated(_step, var)
    assert tainted is not None
    g = fn.graph
    writes = [op for op in g.get_operations() if op.type == "AssignSubVariableOp"]
    (commit_op,) = [op for op in g.get_operations() if op.name.startswith("terra_commit")]
    assert all(commit_op in w.control_inputs for w in writes)
    gathers = [op for op in g.get_operations() if op.type == "GatherV2"]
    assert len(gathers) == 2 and all(o in commit_op.control_inputs for o in gathers)
    # what depends on the write is tainted (a Python read of it commits early); the loss is not
    assert all(w in tainted for w in writes)
    assert not any(o in tainted for o in gathers)


def test_a_run_writes_nothing_before_the_commit_and_everything_after():
    var = tf.Variable(1.0)
    fn, gate, feed, fetch, _ = _gated(_step, var)
    runner = GraphRunner(name="t-commit")
    try:
        run = runner.start(fn)
        feed.put(np.int32(1))
        assert float(fetch.get(timeout=60)) == 2.0  # the forward ran ...
        assert var.numpy() == 1.0            # ... the write waits
        runner.cancel(timeout=60)
        assert run.state == "cancelled" and var.numpy() == 1.0  # abandoned: nothing written
        feed.drain()

        run = runner.start(fn)
        feed.put(np.int32(1))
        gate.put(True)
        assert [float(v) for v in runner.result(timeout=60, run=run)] == [2.0, 3.0]
        assert var.numpy() == 0.0
    finally:
        runner.shutdown(timeout=60)


def test_a_run_that_fails_after_the_write_in_program_order_wrote_nothing():
    """Eager writes, then fails at the second gather (index 3 of 3): the graph's write waits
    for that gather, so the run leaves the variable alone and an eager replay reproduces eager
    exactly."""
    var = tf.Variable(1.0)
    fn, gate, feed, fetch, _ = _gated(_step, var)
    runner = GraphRunner(name="t-commit-fail")
    try:
        run = runner.start(fn)
        feed.put(np.int32(2))
        gate.put(True)
        with pytest.raises(tf.errors.InvalidArgumentError):
            runner.result(timeout=60, run=run)
        assert var.numpy() == 1.0
    finally:
        runner.shutdown(timeout=60)


def test_a_fallible_op_that_depends_on_a_write_leaves_the_graph_ungated():
    def build(rec, var, x):
        rec.op(lambda: var.assign_add(1.0, read_value=False))
        after = rec.op(var.read_value)
        idx = rec.op(tf.cast, after, tf.int32)
        out = rec.op(tf.gather, tf.constant([1.0, 2.0, 3.0]), idx)  # fails on the write's value
        return out, out

    var = tf.Variable(0.0)
    fn, *_, tainted = _gated(build, var)
    assert tainted is None
    assert not any(op.name.startswith("terra_commit") for op in fn.graph.get_operations())
    assert not any(op.control_inputs for op in fn.graph.get_operations()
                   if op.type == "AssignAddVariableOp")


def test_a_function_call_leaves_the_graph_ungated():
    records = [SimpleNamespace(op_type="MatMul", route="op"),
               SimpleNamespace(op_type="f", route="function")]
    assert commit.record_types(records) is None
    assert commit.record_types(records[:1])(0) == "MatMul"
    assert commit.record_types(records[:1])(1) is None
    assert commit.record_types({7: records[0]})(7) == "MatMul"
    assert commit.record_types({7: records[0], 8: records[1]}) is None


def test_record_kind_judges_a_record_before_any_graph():
    """`record_kind` says (writes, can fail) of a recorded op as `fallible` would of its graph
    op, or more conservatively (the fusion of a gated site graph's switch-cases relies on it)."""
    from terra.compiler.commit import record_kind
    from terra.ir.records import ConstRef, Location, OpRecord, OutputRef, TensorSpec, VariableRef
    loc = Location(frames=())

    def rec(op_type, inputs, dtype="float32"):
        return OpRecord(0, op_type, (), tuple(inputs), (TensorSpec(dtype, (2,)),), loc)
    x = OutputRef(0)
    assert record_kind(rec("AssignVariableOp", [VariableRef(1), x])) == (True, False)
    assert record_kind(rec("ReadVariableOp", [VariableRef(1)])) == (False, False)
    assert record_kind(rec("GatherV2", [x, x, x])) == (False, True)
    assert record_kind(rec("Mul", [x, x])) == (False, False)
    assert record_kind(rec("Mul", [x, x]), shapes_defined=False) == (False, True)
    assert record_kind(rec("FloorDiv", [x, x], "int32")) == (False, True)
    assert record_kind(rec("FloorDiv", [x, x])) == (False, False)
    c = ConstRef(value=[0], dtype="int32")
    assert record_kind(rec("StridedSlice", [x, c, c, c])) == (False, False)
    assert record_kind(rec("StridedSlice", [x, c, x, c])) == (False, True)
