"""Every private TensorFlow API Terra touches, in one place.

TF gives no stability promise for any of these names. Keeping them here means a TF upgrade breaks
one module, and `tests/test_tf_private.py` says exactly which name moved. Each entry says what it
is and why Terra needs it. Other parts of the project append their own clearly named sections.
"""
from __future__ import annotations

import contextlib as _contextlib

from tensorflow.core.protobuf import config_pb2 as _config_pb2

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import core as _core
from tensorflow.python.eager import execute as execute_module
from tensorflow.python.eager.polymorphic_function import atomic_function as _atomic_function
from tensorflow.python.framework import constant_op as constant_op_module
from tensorflow.python.framework import op_def_library as _op_def_library
from tensorflow.python.framework import op_def_registry as _op_def_registry
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import tensor_util as tensor_util_module
from tensorflow.python.ops import gen_resource_variable_ops as _gen_rv
from tensorflow.python.ops import resource_variable_ops as _rv

# ------------------------------------------------------------------------------ tracing / hook
# The module holding the C fast path; `gen_*_ops` wrappers look `TFE_Py_FastPathExecute` up on it
# at call time, so replacing the attribute intercepts every fast-path op before input conversion.
pywrap_tfe_module = pywrap_tfe
FAST_PATH_ATTR = "TFE_Py_FastPathExecute"

# `execute.quick_execute` / `execute.execute` (an alias bound at import, so both are patched) /
# `execute.execute_with_cancellation`: the slow path every fallback and function call takes.
EXECUTE_ATTRS = ("quick_execute", "execute", "execute_with_cancellation")

# Raised by the fast path when it cannot handle an input (keras.Variable, some ops always); the
# gen wrapper then retries through `execute.execute` with converted inputs and full attrs.
FallbackException = _core._FallbackException  # pylint: disable=protected-access

# Concrete functions execute as `AtomicFunction.call_flat` -> `Context.call_function` ->
# `execute.execute(name, ...)`; patching `call_flat` maps the function name to its object.
AtomicFunction = _atomic_function.AtomicFunction

# Base class of every eager tensor (a Python class, so its methods can be patched): where Python
# materializes values (`numpy`, `__bool__`, `__float__`, ...), i.e. the fetch points.
EagerTensorBase = _ops._EagerTensorBase  # pylint: disable=protected-access
EagerTensor = _ops.EagerTensor

# Converts Python / NumPy values to eager tensors without executing an op (invisible to the op
# hooks); looked up as a module global by `constant_op._constant_eager_impl`, hence patchable.
CONVERT_ATTR = "convert_to_eager_tensor"

# `tensor_util.constant_value` pulls a value into Python (eager `tf.cond` uses it): a fetch point.
CONSTANT_VALUE_ATTR = "constant_value"

# Resource variables: `handle` is the property every read/assign passes to the gen ops; patching
# it lets the recorder map a handle tensor back to its variable object.
BaseResourceVariable = _rv.BaseResourceVariable

# Op definitions by name (None for functions), for argument layout and attr inference.
get_op_def = _op_def_registry.get


def context():
    """The eager context (`ctx` argument of the execute functions)."""
    return _context.context()


# ------------------------------------------------------------------------------ compiler / replay
# Builds one op of a given type from inputs and non-inferred attrs in the current graph; returns
# `(output_structure, is_stateful, op, outputs)`.
apply_op_helper = _op_def_library._apply_op_helper  # pylint: disable=protected-access

# The read that C++ inserts when a raw variable feeds a non-resource input; replay makes it explicit.
read_variable_op = _gen_rv.read_variable_op


def atomic_function_name(fn) -> str:
    """Name under which `execute` sees a call of AtomicFunction `fn` (its `name` is bytes)."""
    name = fn.name
    return name.decode() if isinstance(name, bytes) else str(name)


# Per-thread options of eager function calls; the serialized ConfigProto they carry (Grappler's
# RewriterConfig included) is what a function is instantiated with. Replay swaps it to run a graph
# without Grappler rewrites, whose reassociations change float results by an ulp.
FunctionCallOptions = _context.FunctionCallOptions


@_contextlib.contextmanager
def function_call_config(mutate):
    """Within the block, functions called eagerly on this thread use the current ConfigProto
    changed by `mutate(config)`."""
    ctx = context()
    old = ctx.function_call_options
    config = _config_pb2.ConfigProto()
    serialized = old.config_proto_serialized
    if serialized:
        config.ParseFromString(serialized)
    mutate(config)
    ctx.function_call_options = FunctionCallOptions(executor_type=old.executor_type,
                                                    config_proto=config)
    try:
        yield
    finally:
        ctx.function_call_options = old


def disable_grappler(config) -> None:
    config.graph_options.rewrite_options.disable_meta_optimizer = True
