"""Every private TensorFlow API Terra touches, in one place.

TF gives no stability promise for any of these names. Keeping them here means a TF upgrade breaks
one module, and `tests/test_tf_private.py` says exactly which name moved. Each entry says what it
is and why Terra needs it. Other parts of the project append their own clearly named sections.
"""
from __future__ import annotations

import contextlib as _contextlib
import importlib as _importlib
import threading as _threading

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
from tensorflow.python.framework import tensor_conversion_registry as _tensor_conversion_registry
from tensorflow.python.types import core as _core_types
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

# An op's eager fallback (`gen_*_ops.*_eager_fallback`, taken when an input is not an eager
# tensor) makes a list input one dtype with `execute.args_to_matching_eager`, looked up on the
# module at every call: the dtype of its first `core_types.Value` (an eager tensor), else the
# first element's own (a literal `0`: int32). A placeholder is a tensor but not a Value.
MATCHING_ATTR = "args_to_matching_eager"
CoreValue = _core_types.Value
convert_registered = _tensor_conversion_registry.convert

# TF's registered gradient functions (`ops.RegisterGradient`), looked up by op type at every
# backward step of an eager tape (`backprop._gradient_function`). `GradientEntry(op_type)` shows
# one entry as the attribute `fn`, so the hook's patch table can replace and restore it.
_GRADIENT_REGISTRY = _ops._gradient_registry._registry  # pylint: disable=protected-access
_GRADIENT_FN_TAG = "type"


class GradientEntry:
    """The registered gradient function of `op_type`, as the attribute `fn`."""
    __slots__ = ("op_type",)

    def __init__(self, op_type: str):
        object.__setattr__(self, "op_type", op_type)

    def __getattr__(self, name):
        if name != "fn":
            raise AttributeError(name)
        return _GRADIENT_REGISTRY[self.op_type][_GRADIENT_FN_TAG]

    def __setattr__(self, name, value):
        if name != "fn":
            raise AttributeError(name)
        _GRADIENT_REGISTRY[self.op_type][_GRADIENT_FN_TAG] = value

    def __repr__(self) -> str:
        return f"GradientEntry({self.op_type!r})"


def strided_slice_gradient(orig):
    """TF's StridedSlice gradient (`array_grad._StridedSliceGrad`), except that in eager it hands
    the backward op the forward op's own `begin` / `end` / `strides` tensors where TF hands it
    NumPy copies (`constant_value`): the same values, so the same result, but a copy is a new
    constant to the recorder and taking it is a read of a value, while the tensors are the
    forward slice's constants (one feed when the program changes them: `probs[0, action]` with
    a sampled action). Building a graph, TF's own runs (its copies give static shapes)."""
    from tensorflow.python.ops import array_ops

    def strided_slice_grad(op, grad):
        begin, end, strides = op.inputs[1], op.inputs[2], op.inputs[3]
        if not (isinstance(begin, EagerTensorBase) and isinstance(end, EagerTensorBase) and
                isinstance(strides, EagerTensorBase)):
            return orig(op, grad)
        x = array_ops.shape(op.inputs[0], out_type=begin.dtype)
        x_static = tensor_util_module.constant_value(x)
        x = x_static if x_static is not None else x
        return (array_ops.strided_slice_grad(
            x, begin, end, strides, grad, begin_mask=op.get_attr("begin_mask"),
            end_mask=op.get_attr("end_mask"), ellipsis_mask=op.get_attr("ellipsis_mask"),
            new_axis_mask=op.get_attr("new_axis_mask"),
            shrink_axis_mask=op.get_attr("shrink_axis_mask")), None, None, None)
    strided_slice_grad.__wrapped__ = orig
    return strided_slice_grad


# Resource variables: `handle` is the property every read/assign passes to the gen ops; patching
# it lets the recorder map a handle tensor back to its variable object.
BaseResourceVariable = _rv.BaseResourceVariable
# `tf.Variable(...)` in eager builds its state here (the hook notes each new variable's role)
ResourceVariable = _rv.ResourceVariable
VARIABLE_INIT_ATTR = "_init_from_args"

# Op definitions by name (None for functions), for argument layout and attr inference.
get_op_def = _op_def_registry.get


def context():
    """The eager context (`ctx` argument of the execute functions)."""
    return _context.context()


# ------------------------------------------------------------------------------ compiler / replay
# Builds one op of a given type from inputs and non-inferred attrs in the current graph; returns
# `(output_structure, is_stateful, op, outputs)`.
apply_op_helper = _op_def_library._apply_op_helper  # pylint: disable=protected-access



def attr_protos(op_type: str, op_def, values: dict):
    """`{name: AttrValue}` for every attr of `op_def` from Python `values` (dtypes, shapes,
    lists, as `_apply_op_helper` holds them after inference), checked as TF checks them; None
    if one is missing."""
    if any(a.name not in values for a in op_def.attr):
        return None
    protos: dict = {}
    _op_def_library._ExtractAttrProto(op_type, op_def, values, protos)  # pylint: disable=protected-access
    return protos


def create_op(op_type: str, flat_inputs, protos: dict, op_def):
    """The op `op_type` in the current graph from its flat inputs and every attr as a proto
    (no input conversion or attr inference: what `_apply_op_helper` does when both are known),
    named as `_apply_op_helper` names it; returns its outputs."""
    g = _ops.get_default_graph()
    op = g._create_op_internal(op_type, flat_inputs, dtypes=None, name=op_type,  # pylint: disable=protected-access
                               attrs=protos, op_def=op_def)
    return op.outputs


def control_inputs_pending() -> bool:
    """Whether an op created now in the default graph gets control inputs from an enclosing
    `tf.control_dependencies` block."""
    return bool(_ops.get_default_graph()._current_control_dependencies())  # pylint: disable=protected-access


def attr_scope_active() -> bool:
    """Whether an op created now in the default graph gets attrs from an enclosing attr scope
    (an XLA `jit_scope` marks its ops so)."""
    return bool(_ops.get_default_graph()._attr_scope_map)  # pylint: disable=protected-access


def add_control_input(op, control) -> None:
    """Make graph op `op`, already created, wait for op `control` (what TF's automatic control
    dependencies do after the fact; terra/compiler/commit.py gates writes this way)."""
    op._add_control_input(control)  # pylint: disable=protected-access


# A function graph outside any `tf.function`: eager variables' handles are captured into it (with
# their shape data), so TF infers the shapes of a whole trace without tracing a function
# (`compiler.shapes.unknown_shapes`).
from tensorflow.python.framework import func_graph as _func_graph  # noqa: E402
FuncGraph = _func_graph.FuncGraph


# The read that C++ inserts when a raw variable feeds a non-resource input; replay makes it explicit.
read_variable_op = _gen_rv.read_variable_op
assign_variable_op = _gen_rv.assign_variable_op


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


# ---- runtime: placeholders, feed/fetch channels, graph runner ----------------------------------
# Used by terra/runtime/*; checked by tests/test_tf_private_runtime.py.
import itertools as _itertools

from tensorflow.python.eager import cancellation as _cancellation
from tensorflow.python.eager import context as _context
from tensorflow.python.eager import execute as _execute
from tensorflow.python.framework import ops as _ops
from tensorflow.python.framework import tensor as _tensor_lib

#: The base class of every tf.Tensor (graph and eager); placeholders subclass it.
Tensor = _tensor_lib.Tensor
#: The concrete class of eager tensors (what a resolver must return).
EagerTensor = _ops.EagerTensor
#: A blocking-op canceller; `start_cancel()` ends ops registered with it (e.g. a QueueDequeueV2).
CancellationManager = _cancellation.CancellationManager


def eager_tensor_of_array(array, dtype):
    """An EagerTensor holding a copy of NumPy `array` (of `dtype`'s NumPy dtype) on the
    context's device: `constant_op.convert_to_eager_tensor`'s own construction, without the
    conversion registry's dispatch (a feed channel's put of the batch every step)."""
    ctx = _context.context()
    ctx.ensure_initialized()
    return EagerTensor(array.copy(), ctx.device_name, dtype.as_datatype_enum)


def new_tensor_uid():
    """A fresh id from the counter that also numbers EagerTensors (`Tensor._id`)."""
    return _ops.uid()


def trace_once(fn, name: str = "terra_graph"):
    """The ConcreteFunction of `fn` (no arguments), from one trace: the first
    `tf.function(fn).get_concrete_function()` traced a lowered site graph twice (the second
    trace's cache lookup saw the captures the first had made), the whole lowering's cost again."""
    from tensorflow.python.eager.polymorphic_function import tracing_compilation as _tc
    return _tc.trace_function((), {}, _tc.TracingOptions(python_function=fn, name=name,
                                                         autograph=False))


def concrete_function_of(fn, args):
    """The ConcreteFunction behind a tf.function (traced for `args`) or the function itself."""
    get = getattr(fn, "get_concrete_function", None)
    if get is not None and not hasattr(fn, "_inference_function"):
        return get(*args)
    if hasattr(fn, "_inference_function") and hasattr(fn, "captured_inputs"):
        return fn
    raise TypeError(f"expected a tf.function or ConcreteFunction, got {fn!r}")


class ReboundFunction:
    """A ConcreteFunction called with other captured inputs of the same types (another
    variable's handle where it captured one): one traced and optimized graph serves the same
    program over new variable objects. Callable where `call_concrete_cancellable` takes a
    ConcreteFunction."""

    def __init__(self, concrete_fn, captured_inputs):
        captured_inputs = tuple(captured_inputs)
        if len(captured_inputs) != len(concrete_fn.captured_inputs):
            raise ValueError(f"{concrete_fn.name} captures {len(concrete_fn.captured_inputs)} "
                             f"inputs, got {len(captured_inputs)}")
        self.concrete = concrete_fn
        self._inference_function = concrete_fn._inference_function
        self.captured_inputs = captured_inputs
        self.name = concrete_fn.name


def call_concrete_cancellable(concrete_fn, flat_args, cancellation_manager):
    """Run a ConcreteFunction's inference function under `cancellation_manager`.

    Unlike `CancellationManager.get_cancelable_function`, this does not set the module-global
    cancellation context (which any other thread's function call would pick up): it calls
    `execute_with_cancellation` directly with this manager, so it is safe on a background thread.
    Returns the function's structured outputs.
    """
    atomic = concrete_fn._inference_function
    args = list(flat_args) + list(concrete_fn.captured_inputs)
    expected = len(atomic.cached_definition.signature.input_arg)
    if len(args) != expected:
        raise ValueError(f"{concrete_fn.name} takes {expected - len(concrete_fn.captured_inputs)} "
                         f"tensor arguments, got {len(flat_args)}")
    ctx = _context.context()
    attrs = tuple(_itertools.chain(*ctx.function_call_options.as_attrs().items()))
    outputs = _execute.execute_with_cancellation(
        atomic.name.decode("utf-8"),
        num_outputs=len(atomic.function_type.flat_outputs),
        inputs=args, attrs=attrs, ctx=ctx,
        cancellation_manager=cancellation_manager)
    return atomic.function_type.pack_output(outputs or [])


def global_cancellation_context():
    """The module-global cancellation manager TF's `Context.call_function` would pick up."""
    return _cancellation.context()


_call_guard_installed = False


def install_function_call_guard(placeholder_cls, materialize):
    """Make eager tf.function calls materialize placeholder arguments.

    `TensorSpec.cast` passes any `tf.Tensor` subclass through unconverted, so a placeholder would
    reach `TFE_Py_Execute` (which assumes EagerTensors and crashes). `Context.call_function` is the
    one place every eager function call passes (plain and cancellable); wrapping it replaces
    instances of exactly `placeholder_cls` by `materialize(p)`. The check is one C-level pass over
    the input types (a few microseconds for hundreds of captured variables). Idempotent; the
    dispatch hook may later intercept function calls before they get here.
    """
    global _call_guard_installed
    if _call_guard_installed:
        return
    original = _context.Context.call_function

    def call_function(self, name, tensor_inputs, num_outputs):
        if placeholder_cls in set(map(type, tensor_inputs)):
            tensor_inputs = [materialize(x) if type(x) is placeholder_cls else x
                             for x in tensor_inputs]
        return original(self, name, tensor_inputs, num_outputs)

    call_function.__wrapped__ = original
    _context.Context.call_function = call_function
    _call_guard_installed = True



_tensor_array_guard_installed = False
# eager TensorArray methods whose first argument is an index (or indices) they read with `.numpy()`
# when it is an EagerTensor, and compare with `<` / `>=` (ops, then `bool`) otherwise
TENSOR_ARRAY_INDEX_METHODS = ("read", "_write", "gather", "scatter")


def install_tensor_array_index_guard(placeholder_cls):
    """Make eager TensorArrays read a placeholder index the way they read an EagerTensor's.

    `_EagerTensorArray.read` (and `_write`, `gather`, `scatter`) take `index.numpy()` only for an
    `ops.EagerTensor`; any other tensor is bounds-checked with `index < 0` and `index >= size`,
    two ops eager never ran. A Keras RNN's step reads its inputs at a tensor time index, so on a
    compiled path the program issued ops the trace did not have and fell back every step until
    each loop step had been re-traced. The wrapper takes `.numpy()` of a `placeholder_cls` instance
    (a fetch, as eager's is a read). Idempotent."""
    global _tensor_array_guard_installed
    if _tensor_array_guard_installed:
        return
    from tensorflow.python.ops import tensor_array_ops
    cls = tensor_array_ops._EagerTensorArray  # pylint: disable=protected-access

    def guard(original):
        def method(self, index, *args, **kwargs):
            if isinstance(index, placeholder_cls):
                index = index.numpy()
            return original(self, index, *args, **kwargs)
        method.__wrapped__ = original
        method.__name__ = original.__name__
        return method

    for name in TENSOR_ARRAY_INDEX_METHODS:
        setattr(cls, name, guard(getattr(cls, name)))
    _tensor_array_guard_installed = True

# ---- pipeline: stage-owned saved tensors (forward/backward function pair) ----------------------
# `tf.function` builds, under a tape, a forward function that also returns the tensors its
# backward function needs ("side outputs") and a backward function that takes them as captured
# inputs. The tape keeps those tensors alive inside a closure; the pipeline needs to own them
# (to evict a micro-batch's saved activations to another device and load them back), so it builds
# the same pair itself and calls both halves directly.
from dataclasses import dataclass as _dataclass

from tensorflow.python.eager import backprop_util as _backprop_util
from tensorflow.python.eager.polymorphic_function import concrete_function as _concrete_function
from tensorflow.python.framework import ops as _ops
from tensorflow.python.util import nest as _nest


@_dataclass(frozen=True)
class ForwardBackwardPair:
    """The first-order forward/backward pair of a concrete function.

    forward(*flat_args) returns ``num_outputs`` real outputs followed by the side outputs.
    backward(output_grads, captures) returns one gradient per forward-graph input (None where the
    input gets none; IndexedSlices stay IndexedSlices).
    ``capture_sources[j]`` says where backward capture j comes from: ``("side", k)`` is forward
    output k, ``("external", tensor)`` is an eager tensor captured as is.
    ``grad_outputs``: the real outputs the backward takes a gradient for, in its argument order
    (TF's `IsTrainable` outputs: float, complex, resource, variant; an integer mask takes none).
    """
    forward_graph: object
    num_outputs: int
    num_output_grads: int
    capture_sources: tuple
    _forward: object
    _backward: object
    grad_outputs: tuple = ()

    def forward(self, *flat_args):
        return self._forward.call_flat(*flat_args)

    def backward(self, output_grads, captures):
        out = self._backward._call_flat(list(output_grads), list(captures))  # pylint: disable=protected-access
        # `_call_flat` already packs composites (an IndexedSlices gradient comes back as one
        # object, not its values/indices/dense_shape): flatten both sides the same way.
        flat = [] if out is None else _nest.flatten(out, expand_composites=True)
        return _nest.pack_sequence_as(self._backward.structured_outputs, flat, expand_composites=True)


# TF's rule for which function outputs get a gradient argument in the backward function.
_is_trainable = _backprop_util.IsTrainable


def forward_backward_pair(concrete_fn) -> ForwardBackwardPair:
    """Build the tape-style forward/backward pair of ``concrete_fn`` (first order, no JVPs)."""
    functions = _concrete_function._FirstOrderTapeGradientFunctions(  # pylint: disable=protected-access
        concrete_fn._func_graph, concrete_fn._attrs, concrete_fn._garbage_collector,  # pylint: disable=protected-access
        forwardprop_input_indices=(),
        delayed_rewrite_functions=concrete_fn._delayed_rewrite_functions,  # pylint: disable=protected-access
        need_gradients_for_jvps=False)
    forward = functions.forward([], [])
    graph = functions._forward_graph  # pylint: disable=protected-access
    backward = functions._backward  # pylint: disable=protected-access
    out_index = {_ops.tensor_id(t): i for i, t in enumerate(graph.outputs)}
    sources = []
    for capture in backward.captured_inputs:
        if isinstance(capture, _ops.EagerTensor):
            sources.append(("external", capture))
        elif _ops.tensor_id(capture) in out_index:
            sources.append(("side", out_index[_ops.tensor_id(capture)]))
        else:
            raise RuntimeError(f"backward capture {capture} is neither a forward output nor eager")
    num_outputs = functions._num_inference_outputs  # pylint: disable=protected-access
    num_output_grads = len(backward.inputs) - len(backward.captured_inputs)
    grad_outputs = tuple(i for i, t in enumerate(graph.outputs[:num_outputs]) if _is_trainable(t))
    if len(grad_outputs) != num_output_grads:
        raise RuntimeError(f"backward takes {num_output_grads} output gradients, but "
                           f"{len(grad_outputs)} outputs are trainable")
    return ForwardBackwardPair(graph, num_outputs, num_output_grads, tuple(sources),
                               forward, backward, grad_outputs)



@_dataclass(frozen=True)
class SplitBackward:
    """A backward function cut in two, for zero-bubble schedules: ``input_grads`` computes the
    gradients of the forward inputs (what the previous stage waits for) and returns the
    intermediate gradients ``weight_grads`` needs; ``weight_grads`` computes the gradients of
    the requested captures (the weights) from those, the output gradients and the captures.
    Nothing is computed twice: the second half starts where the first stopped.

    ``recomputed`` counts input-gradient ops (placeholders and constants aside) reachable from the
    weight half's outputs; 0 means the cut is clean (a control edge into the first half would
    pull its ops in again)."""
    num_saved: int
    recomputed: int
    saved_bytes: int     # what ``input_grads`` hands ``weight_grads``, per call (static shapes)
    _input: object
    _weight: object
    _input_outputs: tuple
    _weight_outputs: tuple

    def input_grads(self, output_grads, captures):
        """(input gradients, one per requested position (None where there is none), saved)."""
        out = self._input._call_flat(list(output_grads) + list(captures), [])  # pylint: disable=protected-access
        out = [] if out is None else list(out) if isinstance(out, (list, tuple)) else [out]
        cut = len(out) - self.num_saved
        return _fill(self._input_outputs, out[:cut]), out[cut:]

    def weight_grads(self, saved, output_grads, captures):
        out = self._weight._call_flat(list(saved) + list(output_grads) + list(captures), [])  # pylint: disable=protected-access
        out = [] if out is None else list(out) if isinstance(out, (list, tuple)) else [out]
        return _fill(self._weight_outputs, out)


def _fill(structure, values) -> list:
    """``structure`` (graph tensors, composites, None) with its tensors replaced by ``values``."""
    flat = _nest.flatten(list(structure), expand_composites=True)
    values = iter(values)
    return _nest.pack_sequence_as(list(structure), [None if t is None else next(values) for t in flat],
                                  expand_composites=True)


def _ancestor_ops(tensors) -> set:
    seen, stack = set(), [t.op for t in tensors]
    while stack:
        op = stack.pop()
        if op not in seen:
            seen.add(op)
            stack.extend(t.op for t in op.inputs)
            stack.extend(op.control_inputs)
    return seen


def split_backward(pair: ForwardBackwardPair, input_positions, weight_positions) -> SplitBackward:
    """Cut ``pair``'s backward into an input half and a weight half (see `SplitBackward`).

    Ops the input gradients need form the first half; the rest of what the weight gradients
    need forms the second; tensors crossing the cut (intermediate gradients such as each
    layer's output gradient) are returned by the first half and fed to the second. Both halves
    are pruned copies of the backward graph (`WrappedFunction.prune`)."""
    from tensorflow.python.eager import wrap_function as _wrap_function
    backward = pair._backward  # pylint: disable=protected-access
    graph = backward.graph
    outputs = backward.structured_outputs
    inputs_out = tuple(outputs[i] for i in input_positions)
    weights_out = tuple(outputs[i] for i in weight_positions)
    input_flat = [t for t in _nest.flatten(list(inputs_out), expand_composites=True) if t is not None]
    weight_flat = [t for t in _nest.flatten(list(weights_out), expand_composites=True) if t is not None]
    placeholders = {t.op for t in graph.inputs}
    first = _ancestor_ops(input_flat)
    second = _ancestor_ops(weight_flat) - first
    saved, seen = [], set()
    for op in sorted(second, key=lambda o: o.name):
        for t in op.inputs:
            if (t.op in first and t.op not in placeholders and t.op.type != "Const"
                    and _ops.tensor_id(t) not in seen):
                seen.add(_ops.tensor_id(t))
                saved.append(t)
    wrapped = _wrap_function.WrappedFunction(graph, variable_holder=_wrap_function.VariableHolder())
    feeds = list(graph.inputs)
    input_fn = wrapped.prune(feeds=feeds, fetches=input_flat + saved)
    weight_fn = wrapped.prune(feeds=saved + feeds, fetches=weight_flat)
    names = {op.name for op in first if op not in placeholders and op.type != "Const"}
    reached = _ancestor_ops(weight_fn.graph.outputs)
    recomputed = sum(1 for op in reached if op.name in names and op.type not in ("Placeholder", "Const"))
    saved_bytes = sum(int(t.shape.num_elements() or 0) * t.dtype.size for t in saved)
    return SplitBackward(len(saved), recomputed, saved_bytes, input_fn, weight_fn, inputs_out, weights_out)


# ---- zero-line adoption: `terra.enable()` (terra/tracing/hook.py) ------------------------------
# Checked by tests/test_tf_private_runtime.py::test_gradient_tape_exports.
# TF's own class, whatever `tf.GradientTape` names now: while `terra.enable()` is in force the
# public name is Terra's subclass, and Terra's code must still reach the base class's methods.
from tensorflow.python.eager import backprop as _backprop  # noqa: E402

PlainGradientTape = _backprop.GradientTape


def gradient_tape_exports() -> list:
    """(module, "GradientTape") of every public TF API module that exports the plain tape now:
    `tf`, `tf.autodiff`, `tf.compat.v1`/`v2` and their nested aliases, all generated modules under
    `tensorflow._api.v2`. TF's internal modules (`backprop`, `gradients`, ...) are left alone: TF
    opens tapes of its own there, and those must stay plain."""
    import sys as _sys
    found = []
    for name, module in list(_sys.modules.items()):
        if module is None or not (name == "tensorflow" or name.startswith("tensorflow._api.")):
            continue
        if getattr(module, "__dict__", {}).get("GradientTape") is PlainGradientTape:
            found.append((module, "GradientTape"))
    return found


# Keras 3's TensorFlow trainer (`keras.src` is Keras' private tree): `fit`, `evaluate` and
# `predict` are where a Keras program's training iterations begin and end. With
# `run_eagerly=True`, `fit` opens `tf.GradientTape()` in `train_step` once per batch; `evaluate`
# and `predict` open none. None when Keras is not installed or runs another backend.
# Keras' built-in layers live under this private package; only their calls are units (a user's
# layer subclass may branch on values in Python, so its ops are matched one by one).
KERAS_BUILTIN_LAYER_MODULES = ("keras.src.layers.",)
# What Keras' fit / evaluate / predict loops set on a model (keras/src/backend/tensorflow/
# trainer.py; `_jit_compile` is resolved there on a model never compiled, for those loops' own
# functions): state that the model's `call` never reads, so not part of a unit's guard (a
# `model.predict` between steps would otherwise keep the model's call from being skipped whole)
KERAS_LOOP_STATE = frozenset({"stop_training", "stop_evaluating", "stop_predicting",
                              "train_function", "test_function", "predict_function",
                              "_eval_epoch_iterator", "_jit_compile"})
# A plain `keras.Sequential` or functional `keras.Model` (these exact classes: `keras.Model(inputs,
# outputs)` makes a `Functional`) whose every layer is built in issues the same ops for the same
# inputs and layer settings, as one built-in layer does: its call is one unit too.
KERAS_BUILTIN_MODEL_MODULES = ("keras.src.models.sequential", "keras.src.models.functional")


def keras_builtin_model_layers(model):
    """Every layer of `model` (nested models' too) and `keras.ops` operation of its graph if it
    is a plain Sequential or functional model made of built-in ones only; else None."""
    if type(model).__module__ not in KERAS_BUILTIN_MODEL_MODULES:
        return None
    layers = list(model._flatten_layers(include_self=False, recursive=True))
    seen = {id(x) for x in layers}
    ops = [op for op in getattr(model, "_operations", ()) if id(op) not in seen]
    for op in layers + ops:  # a functional model's graph may hold `keras.ops` operations
        module = type(op).__module__
        if not (module.startswith(KERAS_BUILTIN_LAYER_MODULES + ("keras.src.ops.",)) or
                module in KERAS_BUILTIN_MODEL_MODULES):
            return None
    return layers + ops


# Composite functions of TF's public API that a program's call makes one coarse unit of
# (terra/runtime/units.py `api_call`): (API module path, name). Each is TF Python issuing a
# handful of ops (shape checks, reshapes, the kernel, its masking), pure given its arguments.
API_UNIT_FUNCTIONS = (
    ("nn", "sigmoid_cross_entropy_with_logits"),
    ("nn", "sparse_softmax_cross_entropy_with_logits"),
    ("nn", "softmax_cross_entropy_with_logits"),
)


# Methods of TF's tensor class that are such composites: indexing (`x[:, 1:]`, `x[..., 4]`:
# the slice's begin, end and strides packed, then `StridedSlice`).
API_UNIT_METHODS = ("__getitem__",)


def api_unit_methods() -> list:
    """(class, method name) of each of `API_UNIT_METHODS` on TF's `Tensor` (eager tensors and
    Terra's placeholders inherit them)."""
    from tensorflow.python.framework import tensor as tensor_lib
    return [(tensor_lib.Tensor, name) for name in API_UNIT_METHODS
            if name in tensor_lib.Tensor.__dict__]


def plain_operator_dtypes() -> bool:
    """Whether TF's tensor operators convert their operands as TF always has (no auto dtype
    conversion, no NumPy-style promotion): then `x * 2.0` on a float tensor `x` is the op
    `Mul(x, 2.0)` and nothing else (runtime/python_runner.py `SkipPlaceholder` operators)."""
    return not _ops.is_auto_dtype_conversion_enabled() and \
        not _ops.is_numpy_style_type_promotion()


def api_unit_functions() -> list:
    """(module object, attribute name) of each of `API_UNIT_FUNCTIONS` the installed TF has:
    the public module (`tf.nn`) a program's call resolves through, so a patch there reaches the
    program's calls (and Keras', which look it up at call time) and no TF-internal one."""
    import tensorflow as tf
    out = []
    for module, name in API_UNIT_FUNCTIONS:
        owner = getattr(tf, module, None)
        if owner is not None and callable(getattr(owner, name, None)):
            out.append((owner, name))
    return out


def keras_unit_classes() -> dict:
    """The Keras classes whose methods are coarse units (terra/tracing/hook.py's unit patches):
    "apply_gradients" -> `BaseOptimizer`, "layer" -> `Layer` (absent ones left out: another
    Keras layout keeps op-by-op matching)."""
    out = {}
    try:
        from keras.src.optimizers.base_optimizer import BaseOptimizer
        out["apply_gradients"] = BaseOptimizer
    except ImportError:
        pass
    try:
        from keras.src.layers.layer import Layer
        out["layer"] = Layer
    except ImportError:
        pass
    try:
        from keras.src.losses.loss import Loss
        out["loss"] = Loss
    except ImportError:
        pass
    return out


# Keras' built-in losses (a `Loss` object's call: the loss function of its `fn` with its
# `_fn_kwargs`, reduced as its `reduction` says) are units as built-in layers are.
KERAS_BUILTIN_LOSS_MODULES = ("keras.src.losses.",)


def keras_loss_settings(loss) -> tuple | None:
    """What a built-in Keras loss object's call depends on besides its inputs: its plain
    attributes, its function and that function's keyword arguments; None if it is not a
    built-in loss or a keyword argument is not a plain value."""
    if not type(loss).__module__.startswith(KERAS_BUILTIN_LOSS_MODULES):
        return None
    kwargs = getattr(loss, "_fn_kwargs", {})
    plain = (bool, int, float, str, type(None))
    if not all(isinstance(v, plain) for v in kwargs.values()):
        return None
    return (tuple((k, v) for k, v in vars(loss).items() if isinstance(v, plain)),
            id(getattr(loss, "fn", None)), tuple(sorted(kwargs.items())),
            str(getattr(loss, "dtype", None)))


# Keras' built-in averaging metrics whose `update_state` is a unit as a built-in loss's call is
# (module, classes defining the method): their Python only computes, and their state lives in
# their variables. Other metrics (confusion matrices, IoU, AUC) keep op-by-op matching.
KERAS_METRIC_UNIT_CLASSES = ("keras.src.metrics.reduction_metrics", ("Mean", "Sum",
                                                                    "MeanMetricWrapper"))
KERAS_BUILTIN_METRIC_MODULES = ("keras.src.metrics.",)


def keras_metric_unit_methods() -> list:
    """`(class, "update_state")` of each class of `KERAS_METRIC_UNIT_CLASSES` (none where this
    Keras lays its metrics out otherwise: they keep op-by-op matching)."""
    module, names = KERAS_METRIC_UNIT_CLASSES
    try:
        mod = _importlib.import_module(module)
    except ImportError:
        return []
    return [(getattr(mod, n), "update_state") for n in names
            if "update_state" in getattr(mod, n, object).__dict__]


def keras_metric_settings(metric) -> tuple | None:
    """What a built-in Keras metric's `update_state` depends on besides its inputs and its
    variables: its plain attributes but its name, its function and that function's keyword
    arguments; None
    if it is not a built-in metric or a keyword argument is not a plain value."""
    if not type(metric).__module__.startswith(KERAS_BUILTIN_METRIC_MODULES):
        return None
    kwargs = getattr(metric, "_fn_kwargs", {})
    plain = (bool, int, float, str, type(None))
    if not all(isinstance(v, plain) for v in kwargs.values()):
        return None
    # (its name, unique per object, names its variables only: the unit is guarded on those)
    return (tuple((k, v) for k, v in vars(metric).items() if isinstance(v, plain) and
                  k != "name"),
            id(getattr(metric, "_fn", None)), tuple(sorted(kwargs.items())))


KERAS_TRAINER_BOUNDARIES = ("fit", "evaluate", "predict")
KERAS_TRAINER_MODULE = "keras.src.backend.tensorflow.trainer"


def keras_trainer_class(import_it: bool = True):
    """The class, or None (Keras absent, another backend, or not imported yet and not
    `import_it`)."""
    import sys as _sys
    module = _sys.modules.get(KERAS_TRAINER_MODULE)
    if module is None and import_it:
        try:
            from keras.src.backend.tensorflow import trainer as module
        except ImportError:
            return None
    return getattr(module, "TensorFlowTrainer", None)


# ---- co-execution: session, fallback (terra/runtime/session.py, fallback.py) -------------------
# Checked by tests/runtime/test_fallback.py::test_private_tape_api.
def tape_is_recording(gradient_tape) -> bool:
    """Whether a tf.GradientTape is on the tape stack now."""
    return bool(gradient_tape._recording)


def gradient_taken(gradient_tape) -> bool:
    """What `tf.GradientTape.gradient` does to a non-persistent tape besides computing, for a
    gradient the graph computed: the tape leaves the tape stack (a gradient taken inside its
    `with` stops its recording) and drops its state (it computes no second gradient). True if
    it left the stack."""
    if gradient_tape._persistent or gradient_tape._tape is None:
        return False
    popped = bool(gradient_tape._recording)
    if popped:
        gradient_tape._pop_tape()
    gradient_tape._watched_variables = gradient_tape._tape.watched_variables()
    gradient_tape._tape = None
    return popped


def tape_has_state(gradient_tape) -> bool:
    """Whether a tf.GradientTape still holds its recorded tape (False after a non-persistent
    tape's `gradient`)."""
    return gradient_tape._tape is not None


def resume_tape(gradient_tape) -> None:
    """Put an exited tf.GradientTape back on the tape stack, so ops replayed after a fallback are
    recorded on it as they were (in eager) while it was open."""
    gradient_tape._push_tape()


def pause_tape(gradient_tape) -> None:
    """Take a resumed tf.GradientTape off the tape stack again."""
    gradient_tape._pop_tape()


def tapes_recording() -> bool:
    """Whether an op run now is recorded by a gradient tape (none is inside
    `tape.stop_recording()` or `tf.stop_gradient`, which stop every tape of the thread)."""
    return execute_module.must_record_gradient()


def stop_recording():
    """Context in which no tape of this thread records (what `tape.stop_recording()` does for
    every tape): a replayed op eager ran unrecorded runs in it."""
    from tensorflow.python.eager import record
    return record.stop_recording()


@_contextlib.contextmanager
def resume_recording():
    """Context in which this thread's tapes record even where a `stop_recording()` stopped them
    (`record.stop_recording`'s own calls, undone and redone): `ops.init_scope` stops them while
    a variable is made, so a fallback at a `tf.Variable(...)` inside a tape replays the ops
    eager recorded before it in there."""
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        yield
    finally:
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()


# ---- co-execution: tf.function calls as coarse units (terra/runtime/units.py) ------------------
# Checked by tests/test_tf_private_function_units.py.
# A `tf.function` call is skipped as a whole in co-execution (TF never sees placeholder
# arguments, and whether TF calls `__inference_f` or, under a tape, `__forward_f` stops mattering).
# Its recorded `__forward_f` record is replayed eagerly after a fallback; `AtomicFunction.call_flat`
# alone would not tell the tapes about it, so the replay also records it the way
# `ConcreteFunction._call_flat` does, with the forward/backward pair TF cached for that call.
import weakref as _weakref

from tensorflow.python.eager import record as _record
from tensorflow.python.eager.polymorphic_function import polymorphic_function as _polymorphic

#: The class of what `tf.function` returns; its `__call__` is routed through the session.
PolymorphicFunction = _polymorphic.Function


def function_runs_eagerly(fn) -> bool:
    """Whether `tf.config.run_functions_eagerly(True)` makes `fn` run its Python op by op."""
    return bool(fn._run_functions_eagerly)


def could_possibly_record() -> bool:
    """Whether a gradient tape is active on this thread (TF then may call `__forward_` variants)."""
    return _record.could_possibly_record()


def tape_functions_of(fn, forward_name: str):
    """The cached forward/backward pair (`_TapeGradientFunctions`) of tf.function `fn` whose
    forward function is named `forward_name`, or None."""
    for concrete in list(fn._list_all_concrete_functions()):
        for cache in (concrete._first_order_tape_functions,
                      concrete._higher_order_tape_functions):
            for functions in list(cache.values()):
                forward = functions._forward
                if forward is not None and atomic_function_name(forward) == forward_name:
                    return functions
    return None


class TapeRecordedFunction:
    """A `__forward_f` AtomicFunction that, called eagerly while a tape may record, marks the
    variables it reads as accessed and records itself on the tapes with its backward function
    (as `ConcreteFunction._call_flat` does), so `tape.gradient` after a replay reaches through
    it. In a graph being built it is a plain call."""

    __slots__ = ("atomic", "functions", "variables")

    def __init__(self, atomic, functions):
        self.atomic = atomic
        self.functions = functions
        # variables passed as arguments, by id of their handle (the replay passes handles)
        self.variables = _weakref.WeakValueDictionary()

    def add_variable(self, variable) -> None:
        self.variables[id(variable.handle)] = variable

    @property
    def name(self):
        return self.atomic.name

    def call_flat(self, *args):
        recording = _context.executing_eagerly() and _record.could_possibly_record()
        if recording:  # tapes watch the trainable variables the function reads, as TF does
            for v in self.functions._func_graph.variables:
                _rv.variable_accessed(v)
            for a in args:
                v = self.variables.get(id(a))
                if v is not None and v.handle is a:
                    _rv.variable_accessed(v)
        outs = self.atomic.call_flat(*args)
        if outs and recording:
            self.functions.record(list(outs), list(args), [])
        return outs


def function_op_types(atomic) -> frozenset:
    """Op types in AtomicFunction `atomic`'s body and every function it calls (control-flow
    branches and nested tf.functions are its `children`), to see the stateful random ops a
    function record hides."""
    types, todo, seen = set(), [atomic], set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        types.update(n.op for n in fn.cached_definition.node_def)
        todo.extend(fn.children)
    return frozenset(types)

# ---- XLA: what TF's executor ran (terra/compiler/xla.py; tests/test_tf_private_xla.py) ----------
# A cluster of ops marked with `tf.xla.experimental.jit_scope` runs as one `_XlaRun` op; the ops it
# compiled no longer appear among the executor's ops. TF's profiler records both, in an XSpace
# proto whose module lives under tensorflow.tsl (no public path).
import collections as _collections
import glob as _glob
import os as _os
import re as _re
import tempfile as _tempfile

from tensorflow.tsl.profiler.protobuf import xplane_pb2 as _xplane_pb2

# Executor op events are named "node_name:OpType"; XLA's own (HLO) events have no such suffix.
_EXECUTOR_OP_EVENT = _re.compile(r"^[^\s:]+:([A-Za-z_][A-Za-z0-9_]*)$")


def executed_op_types(fn) -> "_collections.Counter":
    """Run `fn()` under TF's profiler; return how often TF's executor ran each op type, on any
    thread (`_XlaRun` per compiled cluster run; `MatMul`, `_MklMatMul`, ... for ops it ran
    itself). Raises if no profile was written (e.g. another profiler session is active)."""
    import tensorflow as _tf
    with _tempfile.TemporaryDirectory() as logdir:
        _tf.profiler.experimental.start(logdir)
        try:
            fn()
        finally:
            _tf.profiler.experimental.stop()
        files = _glob.glob(_os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError("executed_op_types: TF's profiler wrote no XSpace")
        counts = _collections.Counter()
        for path in files:
            space = _xplane_pb2.XSpace()
            with open(path, "rb") as f:
                space.ParseFromString(f.read())
            for plane in space.planes:
                for line in plane.lines:
                    for event in line.events:
                        m = _EXECUTOR_OP_EVENT.match(plane.event_metadata[event.metadata_id].name)
                        if m:
                            counts[m.group(1)] += 1
    return counts


# --- Keras model graphs for terra.pipeline.keras_graph -----------------------------------------
def is_keras_functional(model) -> bool:
    """Whether ``model`` runs its functional graph when called (a functional model, or a subclass
    of one that keeps the functional ``call``)."""
    from keras.src.models.functional import Functional as _Functional
    return isinstance(model, _Functional) and type(model).call is _Functional.call


def keras_functional_nodes(model) -> list:
    """The call nodes of a functional model's graph (input nodes left out), in an order where
    every node follows the nodes producing its inputs: Keras' own ``_nodes_by_depth``, deepest
    first, the order `Functional._run_through_graph` runs them in."""
    by_depth = model._nodes_by_depth  # pylint: disable=protected-access
    return [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]
            if node.operation is not None and not node.is_input]


def keras_node_call(node, values: dict, training):
    """Run one functional-graph node on ``values`` ({id(KerasTensor): tensor}) the way the
    functional model does (``training`` reaches operations whose call takes it); returns the
    node's outputs as a flat list."""
    from keras.src.models import functional as _functional
    from keras.src import tree as _tree
    args, kwargs = node.arguments.fill_in(values)
    outputs = _functional.operation_fn(node.operation, training=training)(*args, **kwargs)
    return _tree.flatten(outputs)


def move_keras_variable(variable, device: str) -> None:
    """Re-create a Keras variable's backing ``tf.Variable`` on ``device`` with its current value,
    keeping the Keras object (and so every layer, optimizer and checkpoint reference to it).
    Keras has no public way to move a built variable; its TF backend keeps the ``tf.Variable`` in
    ``_value``."""
    import tensorflow as _tf
    old = variable._value  # pylint: disable=protected-access
    if not isinstance(old, _tf.Variable):
        raise TypeError(f"{variable.path}: expected a tf.Variable behind the Keras variable, got {type(old)}")
    with _tf.device(device):
        new = _tf.Variable(old.read_value(), trainable=old.trainable, name=variable.name,
                           aggregation=old.aggregation, synchronization=old.synchronization)
    variable._value = new  # pylint: disable=protected-access


def wait_for_devices() -> None:
    """Block until every op dispatched so far has run, on GPUs and on remote workers too (remote
    function calls return when dispatched): what a timing must wait for."""
    _context.context().sync_executors()


def place_updates_with_variables(optimizer) -> None:
    """Make ``optimizer`` (the innermost one of a wrapper such as ``LossScaleOptimizer``) run each
    variable's update on that variable's device. Keras' TF backend applies every update inside
    the caller's device scope, so one optimizer over variables on several devices would copy every
    gradient to one device and do all the arithmetic there. Patches the instance's
    ``update_step``, the per-variable hook Keras calls, and outside a distribution strategy skips
    ``_all_reduce_sum_gradients`` (an identity per gradient there, placed under the caller's
    scope: it copied every gradient to the first worker, 3.8 MB on the cluster's Keras GPT)."""
    import tensorflow as _tf
    inner = optimizer
    while hasattr(inner, "inner_optimizer"):
        inner = inner.inner_optimizer
    if getattr(inner, "_terra_placed_updates", False):
        return
    step = inner.update_step
    reduce = getattr(inner, "_all_reduce_sum_gradients", None)
    if reduce is None:
        raise RuntimeError("Keras' TF optimizer no longer has _all_reduce_sum_gradients: check "
                           "where it reduces gradients before placing updates with variables")

    def update_step(gradient, variable, learning_rate):
        with _tf.device(variable.device):
            return step(gradient, variable, learning_rate)

    def all_reduce_sum_gradients(grads_and_vars):
        # Outside a distribution strategy this is an identity per gradient, made under the
        # caller's device scope: it moved every gradient to one device before its update.
        if not _tf.distribute.has_strategy():
            return list(grads_and_vars)
        return reduce(grads_and_vars)
    inner.update_step = update_step
    inner._all_reduce_sum_gradients = all_reduce_sum_gradients
    inner._terra_placed_updates = True


# Graph ops record the Python stack that created them (`_create_c_op(..., extract_traceback)`),
# for TF's error messages. Terra's own graphs are replays of recorded ops whose errors are
# reported at the recorded user line, so the stack (Terra's replay loop) is never shown, and
# taking it is a tenth of a graph's build. `_create_c_op` is looked up at each op creation;
# wrapped once, it skips the stack on the threads inside `without_op_tracebacks()`.
_op_tracebacks = _threading.local()


def _wrap_create_c_op(orig):
    def _create_c_op(graph, node_def, inputs, control_inputs, op_def=None,
                     extract_traceback=True):
        if getattr(_op_tracebacks, "off", False):
            extract_traceback = False
        return orig(graph, node_def, inputs, control_inputs, op_def=op_def,
                    extract_traceback=extract_traceback)
    _create_c_op.terra_wrapped = orig
    return _create_c_op


@_contextlib.contextmanager
def without_op_tracebacks():
    """Graph ops created on this thread inside record no Python stack (see above)."""
    if not hasattr(_ops._create_c_op, "terra_wrapped"):
        _ops._create_c_op = _wrap_create_c_op(_ops._create_c_op)
    outer = getattr(_op_tracebacks, "off", False)
    _op_tracebacks.off = True
    try:
        yield
    finally:
        _op_tracebacks.off = outer


# ---- stateful random ops drawn as stateless ones (terra/tracing/random_streams.py) -------------
# `tf.random.normal` / `uniform` / `truncated_normal` (and `tf.nn.dropout`, through `uniform`) call
# these `gen_random_ops` wrappers by module attribute; eager runs each as a stateful kernel keyed
# by its attrs: TF's Philox generator with key `seed` and counter `seed2 << 64`, advanced by 256
# per output drawn (`GuardedPhiloxRandom::ReserveRandomOutputs(n, 256)`). `StatelessRandom*V2`
# with that key and counter (`alg` 1: Philox) draws the same numbers through the same functor.
# tests/test_tf_private.py::test_stateless_v2_draws_what_the_stateful_kernel_draws checks it.
from tensorflow.python.ops import gen_random_ops as gen_random_ops_module  # noqa: E402
from tensorflow.python.ops import gen_stateless_random_ops_v2 as _gen_stateless_v2  # noqa: E402

STATEFUL_RANDOM = {   # gen_random_ops wrapper -> (op type, its stateless twin)
    "random_standard_normal": ("RandomStandardNormal", _gen_stateless_v2.stateless_random_normal_v2),
    "random_uniform": ("RandomUniform", _gen_stateless_v2.stateless_random_uniform_v2),
    "truncated_normal": ("TruncatedNormal", _gen_stateless_v2.stateless_truncated_normal_v2),
    # (shape, minval, maxval): integers in [minval, maxval), of their dtype
    "random_uniform_int": ("RandomUniformInt", _gen_stateless_v2.stateless_random_uniform_int_v2),
}
PHILOX_ALG = 1            # `alg` of the V2 ops: Philox, the stateful kernels' generator
PHILOX_SKIP_PER_OUTPUT = 256

# `Context._set_global_seed` (`tf.random.set_seed`) clears eager's kernel cache, and so does
# `Context.clear_kernel_cache`: every stateful random kernel starts anew after either.
ContextClass = _context.Context
KERNEL_CACHE_RESETS = ("_set_global_seed", "clear_kernel_cache")


def executing_eagerly() -> bool:
    return _context.executing_eagerly()


def eager_device_name() -> str:
    """The device scope eager ops run in (part of a kernel's cache key)."""
    return _context.context().device_name or ""
