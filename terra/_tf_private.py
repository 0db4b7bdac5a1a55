"""Every private TensorFlow API Terra touches, in one place (checked by tests that fail loudly)."""

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


def new_tensor_uid():
    """A fresh id from the counter that also numbers EagerTensors (`Tensor._id`)."""
    return _ops.uid()


def concrete_function_of(fn, args):
    """The ConcreteFunction behind a tf.function (traced for `args`) or the function itself."""
    get = getattr(fn, "get_concrete_function", None)
    if get is not None and not hasattr(fn, "_inference_function"):
        return get(*args)
    if hasattr(fn, "_inference_function") and hasattr(fn, "captured_inputs"):
        return fn
    raise TypeError(f"expected a tf.function or ConcreteFunction, got {fn!r}")


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
