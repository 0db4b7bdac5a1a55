"""Symbolic profile of a Keras model for the pipeline planner: per call, what it costs in time and
memory at one micro-batch size, without running the model whole.

Each call of the `LayerGraph` (and the loss) is compiled alone into the same forward/backward pair
the executor runs (`StageProgram`), so its *saved tensors* are exactly what a stage holding it
keeps per micro-batch. A saved tensor that is one of the call's inputs or outputs is recorded by
value number, not by bytes: when two calls of one stage save the same value (a Dense saving the
ReLU output its predecessor saved too) the stage holds it once, and a stage's pack is the sum of
its calls' internal saved bytes plus the bytes of the distinct values they save. Parameters are
recorded by variable, so a layer called twice (tied weights) is counted once per stage.

Time: each call's forward and backward pair is run ``repeats`` times on one device and the median
kept; so is a pair doing nothing (``overhead``: launching a function, which a part pays once), the
whole model as one part (``whole``) and the model cut in two parts before its middle call
(``halves``, each part run alone, as the executor runs it). Calls run alone cost more than inside
one part (each pays for its arguments and results), so the planner scales the calls' times beyond
a noop's to add up to what each half cost: a part is costed from the half its calls lie in, which
is nearer its size than the whole model (on cluster workers the whole model's backward took half
the time of its four parts' together, two halves most of it) and keeps what is dear in one half
(an embedding's backward) in that half (`planner`). Running the model does not change it: every variable
(statistics, seed states) is restored after; forward FLOPs are counted from the graph
(matrix products and convolutions exactly, other ops as one per output element).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from terra import _tf_private
from terra.pipeline.keras_graph import LayerGraph
from terra.pipeline.stage import StageProgram


@dataclass(frozen=True)
class CallProfile:
    """One call (or the loss, ``index == len(graph)``) at one micro-batch size.

    ``params``: ((variable id, bytes), ...) of the trainable variables it reads; ``state_bytes``:
    its other variables (statistics, seed states); ``saved_bytes``: saved tensors that are neither
    its inputs nor its outputs; ``saved_values``: value numbers of inputs/outputs it saves;
    ``forward_s`` / ``backward_s``: median seconds; ``flops``: forward FLOPs."""
    index: int
    name: str
    params: tuple
    state_bytes: int
    saved_bytes: int
    saved_values: tuple
    flops: int
    forward_s: float
    backward_s: float
    temp_bytes: int = 0        # the backward's allocator peak above what was live before it

    @property
    def param_bytes(self) -> int:
        return sum(b for _, b in self.params)


@dataclass(frozen=True)
class Profile:
    """Every call's profile plus the loss's, and the bytes of every value per micro-batch."""
    graph_name: str
    microbatch_size: int
    calls: tuple
    loss: CallProfile
    value_bytes: dict = field(default_factory=dict)
    value_specs: dict = field(default_factory=dict)
    boundaries: tuple = ()     # boundaries[k]: value numbers crossing a cut before call k
    measured: bool = True      # times measured; else only FLOPs are known
    overhead: tuple = (0.0, 0.0)   # seconds of one forward / backward call doing nothing
    whole: tuple = (0.0, 0.0)      # seconds of the whole model's forward / backward (with the loss)
    halves: tuple = ()             # ((start, stop, forward s, backward s), ...): the model in two parts
    temps_measured: bool = False   # temp_bytes come from an allocator (else they are 0: unknown)

    def table(self) -> str:
        rows = [f"profile of {self.graph_name} at micro-batch size {self.microbatch_size}",
                f"{'#':>3} {'call':<24} {'params B':>10} {'saved B':>10} {'MFLOP':>9} {'F ms':>8} {'B ms':>8}"]
        for c in self.calls + (self.loss,):
            saved = c.saved_bytes + sum(self.value_bytes[v] for v in c.saved_values)
            rows.append(f"{c.index:>3} {c.name[:24]:<24} {c.param_bytes:>10} {saved:>10} "
                        f"{c.flops / 1e6:>9.2f} {c.forward_s * 1e3:>8.2f} {c.backward_s * 1e3:>8.2f}")
        return "\n".join(rows)


def _nbytes(spec) -> int:
    if not spec.shape.is_fully_defined():
        raise ValueError(f"value of shape {spec.shape} is not static at a fixed micro-batch size; "
                         f"the planner needs static shapes")
    return int(np.prod(spec.shape.as_list(), dtype=np.int64)) * spec.dtype.size


def value_specs(graph: LayerGraph, x_spec, training=True) -> dict:
    """The spec of every value of the graph for input ``x_spec`` (one trace, nothing run)."""
    specs = {}

    def fn(x):
        values = dict(zip(graph.inputs, tf.nest.flatten(x)))
        for call in graph.calls:
            call.run(values, training)
        specs.update({k: tf.TensorSpec(v.shape, v.dtype) for k, v in values.items()})
        return [values[v] for v in graph.outputs]
    tf.function(fn, autograph=False).get_concrete_function(x_spec)
    return specs


# ------------------------------------------------------------------------------------ FLOPs
def _dims(t):
    return [d if d is not None else 1 for d in t.shape.as_list()] if t.shape.rank is not None else []


def _matmul(op):
    a = _dims(op.inputs[0])
    ta = op.get_attr("transpose_a") if "transpose_a" in op.node_def.attr else op.get_attr("adj_x")
    k = a[-2] if ta else a[-1]
    return 2 * int(np.prod(_dims(op.outputs[0]))) * k


def _conv(op):
    kernel = _dims(op.inputs[1])
    return 2 * int(np.prod(_dims(op.outputs[0]))) * int(np.prod(kernel[:-1]))


def _depthwise(op):
    kernel = _dims(op.inputs[1])
    return 2 * int(np.prod(_dims(op.outputs[0]))) * int(np.prod(kernel[:-2]))


def _einsum(op):
    equation = op.get_attr("equation").decode()
    lhs = equation.split("->")[0].split(",")
    sizes = {}
    for labels, t in zip(lhs, op.inputs):
        for label, d in zip(labels.replace("...", ""), _dims(t)[-len(labels.replace("...", "")):]):
            sizes[label] = d
    return 2 * int(np.prod(list(sizes.values()) or [0]))


FLOP_RULES: dict[str, Callable] = {
    "MatMul": _matmul, "BatchMatMul": _matmul, "BatchMatMulV2": _matmul, "BatchMatMulV3": _matmul,
    "Conv2D": _conv, "Conv3D": _conv, "DepthwiseConv2dNative": _depthwise, "Einsum": _einsum,
}
FREE_OPS = frozenset({"Placeholder", "Const", "ReadVariableOp", "Identity", "Reshape", "Shape",
                      "NoOp", "StridedSlice", "Pack", "ExpandDims", "Squeeze", "VarHandleOp"})


def forward_flops(graph) -> int:
    """FLOPs of one run of a forward graph (rules for products, one per output element else)."""
    total = 0
    for op in graph.get_operations():
        rule = FLOP_RULES.get(op.type)
        if rule is not None:
            total += rule(op)
        elif op.type not in FREE_OPS and op.outputs and op.outputs[0].shape.rank is not None:
            total += int(np.prod(_dims(op.outputs[0])))
    return total


# ---------------------------------------------------------------------------------- profile
WARMUP = 3   # runs before timing: kernel caches and allocations settle over the first few


def _median_seconds(fn, repeats):
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _tf_private.wait_for_devices()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _backward_peak(program, pack, grad, probe) -> int:
    """Bytes the backward allocates at its peak above what was live before it (its results
    included: they are what the executor keeps or sends)."""
    _tf_private.wait_for_devices()
    probe.reset()
    before = probe.read()
    result = program.backward(pack, grad)
    _tf_private.wait_for_devices()
    after = probe.read()
    del result
    if not before or not after:
        raise RuntimeError("the allocator probe returned no stats: it cannot measure temporaries")
    return max(0, int(after["peak"]) - int(before["current"]))


def _profile_program(index, name, program, in_values, out_values, variables, state_bytes,
                     x, labels, measure, repeats, probe=None) -> CallProfile:
    pair = program._pair  # the same pair the executor runs
    graph = pair.forward_graph
    outs = graph.outputs
    inputs_at = {id(t): i for i, t in enumerate(graph.inputs)}
    real = {id(outs[i]): i for i in range(pair.num_outputs)}
    for i in range(pair.num_outputs):  # an output is often an Identity of the tensor saved
        t = outs[i]
        while t.op.type == "Identity" and t.op.inputs:
            t = t.op.inputs[0]
            real.setdefault(id(t), i)
    saved_values, saved_bytes = set(), 0
    for slot in program.plan.moved:
        t = outs[program.pack_sources[slot]]
        if id(t) in inputs_at and inputs_at[id(t)] < len(in_values):
            saved_values.add(in_values[inputs_at[id(t)]])
        elif id(t) in real and real[id(t)] < len(out_values):
            saved_values.add(out_values[real[id(t)]])
        else:
            saved_bytes += _nbytes(t)
    fwd_s = bwd_s = 0.0
    temp = 0
    if measure or probe is not None:
        out, pack = program.forward(x, labels)
        grad = tf.nest.map_structure(tf.ones_like, out)
    if measure:
        fwd_s = _median_seconds(lambda: program.forward(x, labels), repeats)
        bwd_s = _median_seconds(lambda: program.backward(pack, grad), repeats)
    if probe is not None:
        temp = _backward_peak(program, pack, grad, probe)
    params = tuple((id(v), int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size) for v in variables)
    return CallProfile(index, name, params, state_bytes, saved_bytes, tuple(sorted(saved_values)),
                       forward_flops(graph), fwd_s, bwd_s, temp)


def _zeros(spec):
    return tf.zeros(spec.shape, spec.dtype)


def profile(graph: LayerGraph, loss_fn: Callable, x_spec, y_spec, *, device: Optional[str] = None,
            measure: bool = True, repeats: int = 5, probe=None) -> Profile:
    """Profile every call of ``graph`` and the loss for one micro-batch of specs ``x_spec`` /
    ``y_spec`` on ``device`` (times only where ``measure``). ``probe``: an allocator probe of
    ``device`` (`memory.AllocatorProbe`; default: the device's own where TF keeps stats) to
    measure each backward's temporaries. The model's variables are as before."""
    from terra.pipeline import memory as memory_lib
    if probe is None and device is not None:
        probe = memory_lib.local_probe(device)
    every = graph.segment(0, len(graph)).variables
    saved = [v.numpy() for v in every]
    try:
        return _profile(graph, loss_fn, x_spec, y_spec, device, measure, repeats, probe)
    finally:
        for v, value in zip(every, saved):
            v.assign(value)


def _profile(graph, loss_fn, x_spec, y_spec, device, measure, repeats, probe) -> Profile:
    with tf.device(device):
        specs = value_specs(graph, x_spec)
    value_bytes = {k: _nbytes(s) for k, s in specs.items()}
    profiles = []
    for call in graph.calls:
        segment = graph.segment(call.index, call.index + 1)
        # A one-call segment takes its boundary, which may hold more than the call reads.
        takes = segment.takes if call.index > 0 else graph.inputs
        seg_in = x_spec if call.index == 0 else (
            specs[takes[0]] if len(takes) == 1 else tuple(specs[v] for v in takes))
        program = StageProgram(lambda v, s=segment: s(v, training=True), segment.trainable_variables,
                               seg_in, device=device)
        others = [v for v in segment.variables if id(v) not in {id(t) for t in segment.trainable_variables}]
        state = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in others)
        x = tf.nest.map_structure(_zeros, seg_in)
        flat_in = tuple(takes) if call.index > 0 else tuple(graph.inputs)
        outs = tuple(segment.gives)
        profiles.append(_profile_program(call.index, call.name, program, flat_in, outs,
                                         segment.trainable_variables, state, x, None, measure, repeats, probe))
    overhead = whole = (0.0, 0.0)
    halves = ()
    if measure:  # what any call costs doing nothing: a part pays it once, not once per call
        spec = tf.TensorSpec((1,), tf.float32)
        noop = StageProgram(lambda v: v * 2.0, [], spec, device=device)
        noop_prof = _profile_program(-1, "noop", noop, (), (), (), 0, _zeros(spec), None, True, max(repeats, 5))
        overhead = (noop_prof.forward_s, noop_prof.backward_s)
        whole, halves = _whole_and_halves(graph, loss_fn, x_spec, y_spec, specs, device, repeats)
    out_specs = [specs[v] for v in graph.outputs]
    out_spec = out_specs[0] if len(out_specs) == 1 else tf.nest.pack_sequence_as(graph.output_structure, out_specs)
    loss_program = StageProgram(lambda out, labels: loss_fn(labels, out), [], out_spec, y_spec, device)
    loss = _profile_program(len(graph.calls), "loss", loss_program, tuple(graph.outputs), (), (), 0,
                            tf.nest.map_structure(_zeros, out_spec), _zeros(y_spec), measure, repeats, probe)
    return Profile(graph.name, int(tf.nest.flatten(x_spec)[0].shape[0]), tuple(profiles), loss,
                   value_bytes, specs, tuple(graph.boundary(k) for k in range(len(graph) + 1)), measure, overhead, whole, halves,
                   probe is not None)


def _whole_and_halves(graph, loss_fn, x_spec, y_spec, specs, device, repeats) -> tuple:
    """Forward and backward seconds of the whole model as one part, and ``((start, stop, forward,
    backward), ...)`` of the model cut before its middle call into two parts, each run alone as the
    executor runs a part. All are timed in the same rounds, one after the other, three times as
    often as a call: a machine that slows down for a while moves them alike."""
    model = graph.segment(0, len(graph))
    pieces = [[(StageProgram(lambda v, labels: loss_fn(labels, model(v, training=True)),
                             model.trainable_variables, x_spec, y_spec, device), x_spec, True)]]
    if len(graph.calls) >= 2:
        cut = len(graph.calls) // 2
        first, second = graph.segment(0, cut), graph.segment(cut, len(graph.calls))
        takes = second.takes
        mid = specs[takes[0]] if len(takes) == 1 else tuple(specs[v] for v in takes)
        pieces.append([(StageProgram(lambda v: first(v, training=True), first.trainable_variables, x_spec,
                                     device=device), x_spec, False)])
        pieces.append([(StageProgram(lambda v, labels: loss_fn(labels, second(v, training=True)),
                                     second.trainable_variables, mid, y_spec, device), mid, True)])
    runs = []   # per piece: its programs' forward and backward calls
    for programs in pieces:
        calls = []
        for program, spec, last in programs:
            x, labels = tf.nest.map_structure(_zeros, spec), (_zeros(y_spec) if last else None)
            out, pack = program.forward(x, labels)
            grad = tf.nest.map_structure(tf.ones_like, out)
            calls.append((lambda p=program, x=x, labels=labels: p.forward(x, labels),
                          lambda p=program, pack=pack, grad=grad: p.backward(pack, grad)))
        runs.append(calls)
    samples = [[[], []] for _ in runs]
    for _ in range(WARMUP):
        for calls in runs:
            for fwd, bwd in calls:
                fwd(), bwd()
    for _ in range(3 * repeats):
        for piece, calls in zip(samples, runs):
            for which in (0, 1):
                _tf_private.wait_for_devices()
                start = time.perf_counter()
                for pair in calls:
                    pair[which]()
                    _tf_private.wait_for_devices()
                piece[which].append(time.perf_counter() - start)
    medians = [(statistics.median(f), statistics.median(b)) for f, b in samples]
    if len(medians) == 1:
        return medians[0], ()
    bounds = (0, len(graph.calls) // 2, len(graph.calls))
    return medians[0], tuple((bounds[i], bounds[i + 1]) + medians[i + 1] for i in range(2))
