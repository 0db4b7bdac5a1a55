"""What skip mode asks of an op's inputs and of its op definition, answered without the
runner's state: whether an op may read a variable before it runs, whether a record names other
variables than the op takes, an op's attr types and single output (cached per op type), the
dtype a NumPy feed converts to, and the variable behind an object."""
from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf

from terra import _tf_private as tfp
from terra.ir.records import VariableRef
from terra.runtime.placeholders import Placeholder

__all__ = ["attr_types", "may_take_variable", "np_dtype_name", "single_output",
           "takes_variables", "tape_word", "variable_ref"]


def takes_variables(rec, op_type, inputs) -> bool:
    """False if record `rec` of the op `op_type` names another variable where the op's input is
    a variable handle (a path over other variable objects: switching to it would only diverge
    again)."""
    if rec.op_type != op_type or not isinstance(inputs, (list, tuple)) or \
            len(inputs) != len(rec.inputs):
        return True
    for ref, v in zip(rec.inputs, inputs):
        if isinstance(ref, VariableRef) and isinstance(v, tfp.EagerTensorBase) and \
                v.dtype == tf.resource and id(v) != ref.key:
            return False
    return True


_PLAIN = (Placeholder, np.ndarray, np.generic, int, float, complex, bool, str, bytes,
          type(None))


def may_take_variable(inputs) -> bool:
    """Whether an op on the fast route, with these unconverted inputs, may read a variable
    before it runs (an input that is neither a plain value nor a non-resource tensor)."""
    for x in tf.nest.flatten(inputs) if isinstance(inputs, (list, tuple)) else (inputs,):
        if isinstance(x, tfp.EagerTensorBase):
            if x.dtype == tf.resource:
                return True
        elif not isinstance(x, _PLAIN):
            return True
    return False


def _single_output(op_type: str) -> bool:
    op_def = tfp.get_op_def(op_type)
    if op_def is None or len(op_def.output_arg) != 1:
        return False
    a = op_def.output_arg[0]
    return not (a.number_attr or a.type_list_attr)


_single_cache: dict = {}
_attr_types: dict = {}


def attr_types(op_type) -> dict:
    """{attr name: attr type} of `op_type`'s op definition (cached)."""
    t = _attr_types.get(op_type)
    if t is None:
        op_def = tfp.get_op_def(op_type)
        t = _attr_types[op_type] = {a.name: a.type for a in op_def.attr} if op_def else {}
    return t


def single_output(op_type: str) -> bool:
    """Whether `op_type` has exactly one output (its fast-route call returns it bare; cached)."""
    single = _single_cache.get(op_type)
    if single is None:
        single = _single_cache[op_type] = _single_output(op_type)
    return single


def tape_word(taped: bool) -> str:
    """How a divergence names whether an op was recorded by the open tapes."""
    return "recorded by the tape" if taped else "not recorded (tapes stopped)"


def np_dtype_name(np_dtype, wanted) -> str:
    name = tf.as_dtype(np_dtype).name
    # a float64 array fed to a float32 slot converts the same way the recorded op converted it
    return wanted if name != wanted and tf.as_dtype(wanted).is_floating and \
        tf.as_dtype(name).is_floating else name


def variable_ref(x) -> Optional[VariableRef]:
    """The VariableRef of a variable object (by its handle), None for anything else."""
    handle = getattr(x, "handle", None) if not isinstance(x, tfp.EagerTensorBase) else None
    if handle is not None and isinstance(handle, tfp.EagerTensorBase):
        return VariableRef(id(handle))
    return None
