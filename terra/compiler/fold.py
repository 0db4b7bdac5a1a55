"""Shape folding: while a graph is built, integer shape arithmetic whose inputs the graph
already knows becomes a constant.

Eager's gradient code computes shapes with ops (`Shape`, `BroadcastGradientArgs`, `Prod`,
`Cast`, ...) that a trace records and the graph emitter rebuilds. `tf.function` builds the same
gradients with static shapes, and Grappler's constant folding removes what is left; Terra runs
its graphs without constant folding (it also rewrites float arithmetic around constants, which
changes rounding: config.py), so every step ran these ops again: 210 of the 1770 ops of the
coexec transformer's graph, each a kernel launch on the graph's threads.

A rule here folds only what is exact:
- `Shape`, `ShapeN`, `Size`, `Rank` of tensors whose static shape is fully known (TF's own
  `tf.shape` does this in a graph; a shape-generic feed leaves its dimensions unknown, so the
  ops that read them stay);
- an op of `EVALUATED` whose inputs are all constants and whose outputs are integers or
  booleans (or a `Cast` of integers or booleans) is run eagerly, with the same kernel and
  attributes the graph would use, and its values become constants. Integer arithmetic and
  integer-to-float conversion are exact, so the graph's results stay bit-identical to eager's.
An op whose eager run fails is left in the graph (it fails there, as in eager), and so is one
whose outputs would be large constants (`MAX_ELEMENTS`).

Once shapes are constants, the reductions over no axes and reshapes to the input's own shape
that eager's gradient code issues wherever a shape could have been broadcast are the identity
(`IDENTITY_RULES`: TF's kernels forward their input then): the graph hands the input on.

`graph_constant` makes the emitter's constants: one op per value in a graph where nothing scopes
it, and a table of their values that the rules read instead of the op's proto.
"""
from __future__ import annotations


import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.compiler.graph_memo import memo

__all__ = ["FOLDABLE", "EVALUATED", "IDENTITY_RULES", "MAX_ELEMENTS", "fold", "identity_input",
           "graph_constant"]

#: Largest number of elements of all outputs of one folded op (a constant lives in the graph).
MAX_ELEMENTS = 4096

_INTEGRAL = frozenset({tf.int32, tf.int64, tf.bool, tf.int8, tf.int16, tf.uint8, tf.uint16,
                       tf.uint32, tf.uint64})


def _out_type(attrs, default=tf.int32):
    return tf.as_dtype(attrs.get("out_type", default))


def _shape(inputs, attrs):
    (x,) = inputs
    if not x.shape.is_fully_defined():
        return None
    return [np.array(x.shape.as_list(), dtype=_out_type(attrs).as_numpy_dtype)]


def _shape_n(inputs, attrs):
    if not all(x.shape.is_fully_defined() for x in inputs):
        return None
    dt = _out_type(attrs).as_numpy_dtype
    return [np.array(x.shape.as_list(), dtype=dt) for x in inputs]


def _size(inputs, attrs):
    (x,) = inputs
    if not x.shape.is_fully_defined():
        return None
    return [np.array(x.shape.num_elements(), dtype=_out_type(attrs).as_numpy_dtype)]


def _rank(inputs, attrs):
    (x,) = inputs
    if x.shape.rank is None:
        return None
    return [np.array(x.shape.rank, dtype=np.int32)]


#: Ops answered from their inputs' static shapes (the inputs' values are not needed).
STATIC_SHAPE_RULES = {"Shape": _shape, "ShapeN": _shape_n, "Size": _size, "Rank": _rank}

#: Pure, deterministic ops run eagerly when every input is a constant.
EVALUATED = frozenset({
    "Abs", "Add", "AddV2", "BroadcastArgs", "BroadcastGradientArgs", "Cast", "Concat",
    "ConcatV2", "DynamicStitch", "Equal", "ExpandDims", "Fill", "FloorDiv", "FloorMod",
    "GatherV2", "Greater", "GreaterEqual", "Identity", "InvertPermutation", "Less",
    "LessEqual", "LogicalAnd", "LogicalNot", "LogicalOr", "Max", "Maximum", "Min", "Minimum",
    "Mul", "Neg", "NotEqual", "OnesLike", "Pack", "Prod", "Range", "Reshape", "Select",
    "SelectV2", "Slice", "Squeeze", "StridedSlice", "Sub", "Sum", "Tile", "Transpose",
    "Unpack", "ZerosLike",
})

def _no_axes(inputs):
    axes = _const_value(inputs[1])
    return axes is not None and axes.size == 0


def _own_shape(inputs):
    x = inputs[0]
    shape = _const_value(inputs[1])
    return shape is not None and x.shape.is_fully_defined() and \
        [int(d) for d in np.ravel(shape)] == x.shape.as_list() and shape.ndim == 1


def _ones(inputs):
    multiples = _const_value(inputs[1])
    return multiples is not None and bool(np.all(multiples == 1))


#: Ops whose output is their first input, value for value, when the rule holds: TF's kernels
#: forward the input buffer then (a reduction over no axes, a reshape or broadcast to the
#: input's own shape, a tile by ones). Eager's gradient code issues them wherever a shape could
#: have been broadcast; the graph passes the input on instead of scheduling a kernel.
IDENTITY_RULES = {
    "Sum": _no_axes, "Mean": _no_axes, "Max": _no_axes, "Min": _no_axes, "Prod": _no_axes,
    "Reshape": _own_shape, "BroadcastTo": _own_shape, "Tile": _ones,
}

FOLDABLE = frozenset(STATIC_SHAPE_RULES) | EVALUATED | frozenset(IDENTITY_RULES)


def identity_input(op_type: str, flat_inputs) -> int | None:
    """The position of the input that op `op_type` would output unchanged (see
    `IDENTITY_RULES`), or None. Not while the graph adds control inputs to new ops (a gated
    span: the op's consumers must still wait where it would have)."""
    rule = IDENTITY_RULES.get(op_type)
    if rule is None or len(flat_inputs) < 2 or tfp.control_inputs_pending():
        return None
    return 0 if rule(flat_inputs) else None


# a graph's memo of the constants `graph_constant` made there: ({id(Const op): its value},
# {(dtype, shape, bytes): tensor}) (the graph keeps its ops alive, so their ids stay unique)
_MADE = "constants"


def _made(g):
    return memo(g, _MADE, lambda: ({}, {}))


def graph_constant(value: np.ndarray, dtype) -> tf.Tensor:
    """A constant holding `value` in the graph being built, its value remembered for the rules
    here (no read back of its proto), and one per value where nothing scopes the op (no control
    inputs, no XLA scope): eager's gradient code makes the same small shapes over and over, and
    a Const's creation costs more than the lookup."""
    g = tf.compat.v1.get_default_graph()
    dtype = tf.as_dtype(dtype)
    value = np.asarray(value, dtype=dtype.as_numpy_dtype)
    values, shared = _made(g)
    key = None
    if not tfp.control_inputs_pending() and not tfp.attr_scope_active():
        key = (dtype, value.shape, value.tobytes())
        t = shared.get(key)
        if t is not None:
            return t
    t = tf.constant(value, dtype=dtype)
    values[id(t.op)] = value
    if key is not None:
        shared[key] = t
    return t


def _const_value(t):
    """The value of graph tensor `t` if it is a constant of the graph being built, else None."""
    if not isinstance(t, tf.Tensor) or getattr(t, "op", None) is None or t.op.type != "Const":
        return None
    g = tf.compat.v1.get_default_graph()
    if t.graph is not g:
        return None
    value = _made(g)[0].get(id(t.op))
    return value if value is not None else tf.make_ndarray(t.op.get_attr("value"))


def fold(op_type: str, flat_inputs, attrs: dict, attrs_flat: tuple, out_dtypes) -> list | None:
    """The outputs of op `op_type` as NumPy values, if this pass folds it (see the module
    docstring); None to build the op. `flat_inputs` are the op's graph inputs, flat;
    `attrs` its attributes by name (dtypes as names), `attrs_flat` as eager execution takes
    them; `out_dtypes` its outputs' dtype names."""
    rule = STATIC_SHAPE_RULES.get(op_type)
    if rule is not None:
        return rule(flat_inputs, attrs)
    if op_type not in EVALUATED or not flat_inputs:
        return None
    outs = [tf.as_dtype(d) for d in out_dtypes]
    if op_type == "Cast":
        if flat_inputs[0].dtype not in _INTEGRAL:
            return None
    elif not all(d in _INTEGRAL for d in outs):
        return None
    values = []
    for t in flat_inputs:
        n = t.shape.num_elements() if isinstance(t, tf.Tensor) else None
        if n is None or n > MAX_ELEMENTS:  # (a large constant is data, not a shape)
            return None
        v = _const_value(t)
        if v is None:
            return None
        values.append((v, t.dtype))
    with tf.init_scope():
        try:
            eager_inputs = [tf.constant(v, dtype=d) for v, d in values]
            results = tfp.execute_module.execute(op_type, len(outs), eager_inputs, attrs_flat,
                                                 tfp.context())
        except (tf.errors.OpError, TypeError, ValueError):
            return None  # the graph's op fails as eager's did
        arrays = [r.numpy() for r in results]
    if sum(a.size for a in arrays) > MAX_ELEMENTS:
        return None
    return arrays
