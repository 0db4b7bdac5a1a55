"""Commit-gated writes: a path or site graph whose variable writes wait for Python's word.

A fallback must find the variables as they were when its iteration began. Without this pass the
runtime snapshots every variable a run may write before the run starts: one graph call per run,
on the critical path between two runs, and one copy of each written variable (the update finds
its buffer shared with the snapshot). Here the graph itself keeps the writes back instead:

- every op that writes a resource waits for one *commit* op;
- the commit op waits for a token on the commit channel, which Python puts once the iteration
  can no longer leave its path (it ended on it), and for every op of the path that can fail on
  its data (a gather's index, a sparse label, an assert): a run that fails therefore has
  written nothing, and eager replay from the unchanged variables reproduces eager's error and
  eager's state exactly, whatever the order of the failing op and the writes in the program.

So an abandoned or failed run needs no restore. Python reading, mid-iteration, a value that
depends on a write (`tainted`) must commit early: the runtime then takes the snapshot itself,
first, and only for that iteration.

A graph is not gated (`gate_writes` returns None; the runtime snapshots as before) when an op
that can fail depends on a write: it could not both wait for the commit and precede it.

A site graph's `switch_case` and `while_loop` ops hold recorded ops in their branch and body
functions: each counts as one op that writes if an op inside writes and that can fail if one
inside can (`summarize`, given to `gate_writes` as `inner`); such an op that does both is a
failing op after a write, so that graph is not gated.

"Can fail" is decided per op, conservatively: `INFALLIBLE` op types with fully defined output
shapes (so every shape check passed when the graph was built), index-like inputs known when the
graph is built, and, for ops that fail on integer division by zero, a float type. Everything
else (unknown op types included) counts as fallible. The dependencies are those TF's executor
honours in a `tf.function`: data edges, control edges, program order on a shared resource
(automatic control dependencies) and program order among stateful ops without resource inputs.
"""
from __future__ import annotations

import tensorflow as tf

from terra import _tf_private as tfp
from terra.compiler.names import op_index_of

__all__ = ["INFALLIBLE", "gate_writes", "fallible", "record_kind", "record_types", "summarize"]

# Ops that read a resource without changing it (every other op with a resource input writes).
READ_ONLY_RESOURCE_OPS = frozenset({"ReadVariableOp", "VariableShape", "VarIsInitializedOp",
                                    "ResourceGather", "ResourceGatherNd"})

# Op types that cannot fail at run time once the graph's shapes are fully defined and their
# index-like inputs (below) are known: elementwise math, contractions, convolutions, pooling,
# reductions, shape plumbing, dense variable updates. Not here, hence fallible: gathers and
# scatters (an index out of range), sparse cross-entropy (a label out of range), segment ops
# (an id out of range), asserts and numeric checks, data-dependent shapes, function calls.
INFALLIBLE = frozenset({
    # elementwise
    "Abs", "Acos", "Acosh", "Add", "AddN", "AddV2", "Asin", "Asinh", "Atan", "Atan2", "Atanh",
    "BiasAdd", "BiasAddGrad", "Cast", "Ceil", "ClipByValue", "Cos", "Cosh", "Div", "DivNoNan",
    "Elu", "EluGrad", "Equal", "Erf", "Erfc", "Exp", "Expm1", "Floor", "FloorDiv", "FloorMod",
    "Gelu", "Greater", "GreaterEqual", "IsFinite", "IsInf", "IsNan", "LeakyRelu",
    "LeakyReluGrad", "Less", "LessEqual", "Lgamma", "Log", "Log1p", "LogicalAnd", "LogicalNot",
    "LogicalOr", "Maximum", "Minimum", "Mod", "Mul", "MulNoNan", "Neg", "NotEqual", "Pow",
    "RealDiv", "Reciprocal", "ReciprocalGrad", "Relu", "Relu6", "Relu6Grad", "ReluGrad",
    "Rint", "Round", "Rsqrt", "RsqrtGrad", "Select", "SelectV2", "Selu", "SeluGrad", "Sigmoid",
    "SigmoidGrad", "Sign", "Sin", "Sinh", "Softplus", "SoftplusGrad", "Softsign",
    "SoftsignGrad", "Sqrt", "SqrtGrad", "Square", "SquaredDifference", "Sub", "Tan", "Tanh",
    "TanhGrad", "TruncateDiv", "TruncateMod", "Xdivy", "Xlog1py", "Xlogy",
    # contractions, convolutions, pooling, normalization, softmax
    "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv2DBackpropFilter",
    "Conv2DBackpropInput", "Conv3D", "Conv3DBackpropFilterV2", "Conv3DBackpropInputV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput", "Einsum", "MatMul", "AvgPool", "AvgPoolGrad",
    "MaxPool", "MaxPoolGrad", "MaxPoolV2", "MaxPoolGradV2", "FusedBatchNorm",
    "FusedBatchNormV3", "FusedBatchNormGrad", "FusedBatchNormGradV3", "LogSoftmax", "Softmax",
    "SoftmaxCrossEntropyWithLogits", "ResizeBilinear", "ResizeBilinearGrad",
    "ResizeNearestNeighbor", "ResizeNearestNeighborGrad",
    # reductions and scans
    "All", "Any", "ArgMax", "ArgMin", "Cumprod", "Cumsum", "Max", "Mean", "Min", "Prod", "Sum",
    # shapes and plumbing
    "BroadcastArgs", "BroadcastGradientArgs", "BroadcastTo", "Concat", "ConcatV2", "Const",
    "ExpandDims", "Fill", "Identity", "IdentityN", "MirrorPad", "NoOp", "OneHot", "OnesLike",
    "Pack", "Pad", "PadV2", "Range", "Rank", "Reshape", "Reverse", "ReverseV2", "Shape",
    "ShapeN", "Size", "Slice", "Snapshot", "Split", "SplitV", "Squeeze", "StopGradient",
    "StridedSlice", "StridedSliceGrad", "Tile", "Transpose", "Unpack", "ZerosLike",
    # variables (shapes fixed when the graph is built)
    "AssignAddVariableOp", "AssignSubVariableOp", "AssignVariableOp", "ReadVariableOp",
    "ResourceApplyAdam", "ResourceApplyAdaMax", "ResourceApplyAdadelta", "ResourceApplyAdagrad",
    "ResourceApplyAdagradV2", "ResourceApplyCenteredRMSProp", "ResourceApplyFtrl",
    "ResourceApplyFtrlV2", "ResourceApplyGradientDescent", "ResourceApplyKerasMomentum",
    "ResourceApplyMomentum", "ResourceApplyRMSProp", "VarIsInitializedOp", "VariableShape",
})

# Inputs (by position) that must be known when the graph is built: where they come from data,
# the op fails on an out-of-range value although its output shape is fully defined.
_STATIC_INPUTS = {"Slice": (1, 2), "StridedSlice": (1, 2, 3), "StridedSliceGrad": (0, 1, 2, 3)}

# Fail on an integer division by zero; safe on floating point types.
_INTEGER_DIVISION = frozenset({"Div", "FloorDiv", "FloorMod", "Mod", "TruncateDiv",
                               "TruncateMod", "Pow"})


def fallible(op, shapes_known: bool = False) -> bool:
    """Whether `op` may raise at run time (see the module docstring). `shapes_known`: every
    value has the shape it was recorded with whenever the op runs (a site graph whose paths'
    own graphs infer every shape: its shapes are only relaxed where paths differ), so an
    output shape the graph leaves unknown says nothing of a failure."""
    if op.type not in INFALLIBLE:
        return True
    if not shapes_known and any(not t.shape.is_fully_defined() for t in op.outputs):
        return True
    for i in _STATIC_INPUTS.get(op.type, ()):
        if tf.get_static_value(op.inputs[i]) is None:
            return True
    if op.type in _INTEGER_DIVISION and op.outputs and not op.outputs[0].dtype.is_floating:
        return True
    return False


def record_kind(record, shapes_defined: bool = True) -> tuple:
    """(writes, can fail) of a recorded op before any graph exists, as `fallible` will judge
    its op in the graph or more conservatively: `shapes_defined` says whether the graph will
    know its output shapes; an index-like input is known where the record has a constant."""
    from terra.ir.records import ConstRef, VariableRef
    flat = [a for arg in record.inputs for a in (arg if isinstance(arg, tuple) else (arg,))]
    writes = record.op_type not in READ_ONLY_RESOURCE_OPS and \
        any(isinstance(a, VariableRef) for a in flat)
    fails = (record.route == "function" or record.op_type not in INFALLIBLE
             or not shapes_defined
             or any(i >= len(record.inputs) or not isinstance(record.inputs[i], ConstRef)
                    for i in _STATIC_INPUTS.get(record.op_type, ()))
             or (record.op_type in _INTEGER_DIVISION and not (
                 record.outputs and tf.as_dtype(record.outputs[0].dtype).is_floating)))
    return writes, fails


def record_types(records):
    """`op_type_of` for `gate_writes`: index -> op type of `records` (a list by record index or
    a dict by TraceGraph node id); None where a record calls a function (its writes and its
    failures are inside the call: such a graph is not gated)."""
    items = records.values() if isinstance(records, dict) else records
    if any(r.route == "function" for r in items):
        return None
    if isinstance(records, dict):
        types = {i: r.op_type for i, r in records.items()}
        return types.get
    n = len(records)
    return lambda i: records[i].op_type if i < n else None


def _recorded(op, op_type_of) -> bool:
    """Whether `op` is a recorded op (not one lowering added: a channel's, an explicit read):
    `op_type_of(index)` is the op type recorded under the index its name carries."""
    index = op_index_of(op.name)
    return index is not None and op_type_of(index) == op.type


def _kind(op, op_type_of, inner, shapes_known):
    """(writes, can fail) of one op: a recorded op's own, a control-flow op's `inner` summary."""
    summary = inner.get(op) if inner else None
    if summary is not None:
        return summary
    if not _recorded(op, op_type_of):
        return False, False
    write = op.type not in READ_ONLY_RESOURCE_OPS and \
        any(t.dtype == tf.resource for t in op.inputs)
    return write, fallible(op, shapes_known)


def summarize(ops, op_type_of, inner=None, shapes_known: bool = False) -> tuple:
    """(writes, can fail) of a branch or loop body whose ops are `ops`: whether any op in it
    writes a resource, whether any can fail (`inner`: the summaries of control-flow ops
    nested in it; `shapes_known` as for `fallible`)."""
    writes = fails = False
    for op in ops:
        w, f = _kind(op, op_type_of, inner, shapes_known)
        writes, fails = writes or w, fails or f
        if writes and fails:
            break
    return writes, fails


_stateful: dict = {}  # op type -> whether its OpDef is stateful


def gate_writes(ops, op_type_of, make_gate, inner=None, shapes_known: bool = False):
    """Make every write among `ops` (a function graph's ops in creation order, while it is
    traced) wait for a commit op over `make_gate()` (a dequeue of the commit channel) and every
    fallible op of the recorded ones. `op_type_of(index)`: the op type recorded under an op
    name's index (None: no such record); `inner`: {control-flow op: (writes, can fail)} of the
    ones whose functions hold recorded ops (`summarize`); `shapes_known` as for `fallible`. Returns the set of ops that depend
    on a write (Python's read of one commits early), or None where the graph cannot be gated;
    then nothing is changed. Ops lowering added itself (channels, explicit reads) are not the
    recorded ops and never fail on data (`record_types` rules out function calls)."""
    writes, failing, tainted = [], [], set()
    tainted_resources: set = set()
    unordered_tainted = False  # the chain of stateful ops without resource inputs
    for op in ops:
        inputs = op.inputs  # (each read of `inputs` and `op_def` asks the C API anew)
        op_type = op.type
        resources = [t for t in inputs if t.dtype == tf.resource]
        summary = inner.get(op) if inner else None
        if summary is not None:
            write, can_fail = summary
        else:
            recorded = _recorded(op, op_type_of)
            write = recorded and bool(resources) and op_type not in READ_ONLY_RESOURCE_OPS
            can_fail = recorded and fallible(op, shapes_known)
        hit = write or any(t.op in tainted for t in inputs) or \
            any(c in tainted for c in op.control_inputs) or \
            any(t.ref() in tainted_resources for t in resources)
        stateful = _stateful.get(op_type)
        if stateful is None:
            op_def = op.op_def
            stateful = _stateful[op_type] = op_def is not None and op_def.is_stateful
        if stateful and not resources and unordered_tainted:
            hit = True
        if can_fail:
            if hit:
                return None  # a failing op after a write: it cannot precede the commit
            failing.append(op)
        if write:
            writes.append(op)
        if hit:
            tainted.add(op)
            tainted_resources.update(t.ref() for t in resources)
            if stateful and not resources:
                unordered_tainted = True
    if not writes:
        return None
    gate = make_gate()
    with tf.control_dependencies(failing):
        commit = tf.group(gate, name="terra_commit")
    for op in writes:
        tfp.add_control_input(op, commit)
    return tainted
