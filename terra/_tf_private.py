"""Every private TensorFlow API Terra touches, in one place.

Each section names its user. `tests/test_tf_private*.py` check that the pieces still exist and
behave as relied on, so a TensorFlow upgrade fails loudly here rather than deep inside a run.
"""
from __future__ import annotations


# ---- pipeline: stage-owned saved tensors (forward/backward function pair) ----------------------
# `tf.function` builds, under a tape, a forward function that also returns the tensors its
# backward function needs ("side outputs") and a backward function that takes them as captured
# inputs. The tape keeps those tensors alive inside a closure; the pipeline needs to own them
# (to evict a micro-batch's saved activations to another device and load them back), so it builds
# the same pair itself and calls both halves directly.
from dataclasses import dataclass as _dataclass

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
    """
    forward_graph: object
    num_outputs: int
    num_output_grads: int
    capture_sources: tuple
    _forward: object
    _backward: object

    def forward(self, *flat_args):
        return self._forward.call_flat(*flat_args)

    def backward(self, output_grads, captures):
        out = self._backward._call_flat(list(output_grads), list(captures))  # pylint: disable=protected-access
        flat = [] if out is None else (list(out) if isinstance(out, (list, tuple)) else [out])
        return _nest.pack_sequence_as(self._backward.structured_outputs, flat, expand_composites=True)


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
    return ForwardBackwardPair(graph, num_outputs, num_output_grads, tuple(sources),
                               forward, backward)
