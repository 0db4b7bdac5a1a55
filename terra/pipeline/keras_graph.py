"""A Keras model as a list of calls over numbered values, and model parts cut from it.

A pipeline cut may fall between any two calls of a topological order of the model's graph. What
crosses it is every value made before the cut and read after it (a residual stream and a mask
together, say), so `boundary(k)` is a set, not one tensor. `Segment` runs calls ``start..stop``
as one model part for `PipelineTrainer`: it takes the values of boundary ``start`` and returns
those of boundary ``stop`` (the model's outputs for the last part).

Accepted models: `keras.Sequential` (its layers in order), functional models (Keras' own node
order; a nested model is one call), and a plain list of blocks applied in order (how a subclassed
model made of blocks is handed over: its ``call`` is Python the graph cannot see).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import tensorflow as tf

from terra import _tf_private
from terra.pipeline.stage import takes_training, trainable_variables


@dataclass(frozen=True)
class Call:
    """One call of the model: ``operation`` reads values ``inputs`` and makes ``outputs``
    (value numbers). ``node`` is the functional-graph node, None in a chain; ``keys`` pairs the
    ids of the node's input KerasTensors with their value numbers (Keras fills node arguments in
    by tensor id)."""
    index: int
    name: str
    operation: object
    inputs: tuple
    outputs: tuple
    node: object = None
    keys: tuple = ()

    def run(self, values: dict, training) -> None:
        if self.node is not None:
            ids = {key: values[num] for key, num in self.keys}
            outs = _tf_private.keras_node_call(self.node, ids, training)
        else:
            (x,) = (values[i] for i in self.inputs)
            flag = training is not None and takes_training(self.operation)
            outs = [self.operation(x, training=training) if flag else self.operation(x)]
        if len(outs) != len(self.outputs):
            raise ValueError(f"{self.name} returned {len(outs)} values, its graph node has {len(self.outputs)}")
        for num, value in zip(self.outputs, outs):
            values[num] = value


class LayerGraph:
    """The calls of a model in a runnable order, with the values crossing every possible cut."""

    def __init__(self, calls: Sequence[Call], inputs: tuple, outputs: tuple, input_structure,
                 output_structure, name: str):
        self.calls = tuple(calls)
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.input_structure = input_structure
        self.output_structure = output_structure
        self.name = name
        last_use = {v: len(self.calls) for v in self.outputs}
        for call in self.calls:
            for v in call.inputs:
                last_use[v] = max(last_use.get(v, -1), call.index)
        made = {v: -1 for v in self.inputs}
        for call in self.calls:
            for v in call.outputs:
                made[v] = call.index
        self._made, self._last_use = made, last_use

    def __len__(self):
        return len(self.calls)

    def boundary(self, k: int) -> tuple:
        """Values crossing a cut before call ``k``: made before it, read at or after it."""
        if not 0 <= k <= len(self.calls):
            raise ValueError(f"cut {k} is outside 0..{len(self.calls)}")
        if k == 0:
            return self.inputs
        if k == len(self.calls):
            return self.outputs
        return tuple(v for v, at in sorted(self._made.items()) if at < k and self._last_use.get(v, -1) >= k)

    def segment(self, start: int, stop: int) -> "Segment":
        return Segment(self, start, stop)

    @classmethod
    def of(cls, model) -> "LayerGraph":
        """The graph of a Sequential or functional model, or of a list of blocks."""
        import keras
        if isinstance(model, (list, tuple)):
            return cls._chain(list(model), "blocks")
        if isinstance(model, keras.Sequential):
            return cls._chain(list(model.layers), model.name)
        if _tf_private.is_keras_functional(model):
            return cls._functional(model)
        if isinstance(model, keras.Model):
            raise TypeError(
                f"{type(model).__name__} is a subclassed model: its call is Python that cannot be "
                f"cut automatically; pass its blocks as a list (applied in order), a Sequential, "
                f"or a functional model")
        raise TypeError(f"expected a keras.Sequential, a functional keras.Model or a list of blocks, "
                        f"got {type(model).__name__}")

    @classmethod
    def _chain(cls, blocks, name):
        if not blocks:
            raise ValueError("the model has no layers to cut")
        for b in blocks:
            if not callable(b):
                raise TypeError(f"block {b!r} is not callable")
        calls = [Call(i, getattr(b, "name", type(b).__name__), b, (i,), (i + 1,)) for i, b in enumerate(blocks)]
        return cls(calls, (0,), (len(blocks),), 0, 0, name)

    @classmethod
    def _functional(cls, model):
        numbers: dict[int, int] = {}

        def number(tensor):
            return numbers.setdefault(id(tensor), len(numbers))

        inputs = tuple(number(t) for t in model.inputs)
        calls = []
        for node in _tf_private.keras_functional_nodes(model):
            ins = tuple(number(t) for t in node.input_tensors)
            outs = tuple(number(t) for t in node.outputs)
            keys = tuple((id(t), numbers[id(t)]) for t in node.input_tensors)
            calls.append(Call(len(calls), node.operation.name, node.operation, ins, outs, node, keys))
        missing = [t for t in model.outputs if id(t) not in numbers]
        if missing:
            raise ValueError(f"model outputs {missing} are not made by any call")
        outputs = tuple(numbers[id(t)] for t in model.outputs)
        in_structure = model._inputs_struct if hasattr(model, "_inputs_struct") else list(inputs)
        out_structure = model._outputs_struct if hasattr(model, "_outputs_struct") else list(outputs)
        return cls(calls, inputs, outputs, in_structure, out_structure, model.name)


class Segment:
    """Calls ``start .. stop - 1`` of a graph as one model part (a callable with
    ``trainable_variables`` and a ``training`` keyword, what `PipelineTrainer` takes).

    The first part takes the model's input (its structure); a later part takes the values of its
    boundary, one tensor or a tuple. A middle part returns its end boundary the same way; the last
    part returns the model's output(s)."""

    def __init__(self, graph: LayerGraph, start: int, stop: int):
        if not 0 <= start < stop <= len(graph):
            raise ValueError(f"segment {start}..{stop} is empty or outside the {len(graph)} calls")
        self.graph, self.start, self.stop = graph, start, stop
        self.calls = graph.calls[start:stop]
        self.takes = graph.boundary(start)
        self.gives = graph.boundary(stop)
        self.operations = list({id(c.operation): c.operation for c in self.calls}.values())
        self.trainable_variables = trainable_variables(self.operations)
        self.name = f"{graph.name}[{self.calls[0].name}..{self.calls[-1].name}]"

    @property
    def variables(self) -> list:
        """Every variable the part's operations hold (statistics and seed states too), once each."""
        seen, out = set(), []
        for op in self.operations:
            for v in getattr(op, "variables", None) or getattr(op, "trainable_variables", []) or []:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    @property
    def non_trainable_variables(self) -> list:
        trainable = {id(v) for v in self.trainable_variables}
        return [v for v in self.variables if id(v) not in trainable]

    def __call__(self, x, training: Optional[bool] = None):
        if self.start == 0:
            flat = tf.nest.flatten(x)
        else:
            flat = list(x) if len(self.takes) > 1 else [x]
        if len(flat) != len(self.takes):
            raise ValueError(f"{self.name} takes {len(self.takes)} value(s), got {len(flat)}")
        values = dict(zip(self.takes, flat))
        for call in self.calls:
            call.run(values, training)
        if self.stop == len(self.graph):
            outs = [values[v] for v in self.graph.outputs]
            return outs[0] if len(outs) == 1 else tf.nest.pack_sequence_as(self.graph.output_structure, outs)
        outs = tuple(values[v] for v in self.gives)
        return outs[0] if len(outs) == 1 else outs

    def __repr__(self):
        return f"Segment({self.name}, calls {self.start}..{self.stop - 1})"
