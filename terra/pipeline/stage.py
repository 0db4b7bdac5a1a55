"""Pipeline stages: a model part compiled into a forward/backward pair with stage-owned saved tensors.

A `tf.GradientTape` keeps a micro-batch's saved activations inside a closure, so nobody can move
them. A `StageProgram` builds the tape-style pair itself (`terra._tf_private.forward_backward_pair`):
``forward`` returns the stage output plus the *residual pack* (the tensors the backward needs) and
``backward`` takes the output gradient plus that pack. The executor owns the pack and can evict it
to another device and load it back (BPipe).

Moving a pack tensor by tensor breaks sharing: some pack tensors are variable reads (snapshots that
alias the weights) and some are views (Reshape/Identity/...) of other pack tensors. `PackPlan`
classifies the pack once per stage: variable reads, constants and views of them *stay* on the
owner, only *bases* move, and views are *rebuilt* from their moved base after the load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import tensorflow as tf

from terra import _tf_private

# Ops whose output shares its input's buffer (same bytes, different shape at most).
VIEW_OPS = frozenset({"Reshape", "Identity", "ExpandDims", "Squeeze", "Snapshot"})
# Ops whose output is not an activation: a snapshot of a weight or a constant.
KEPT_OPS = frozenset({"ReadVariableOp", "Const"})


@dataclass(frozen=True, slots=True)
class View:
    """Pack slot ``slot`` is a view of slot ``base`` with static shape ``shape``."""
    slot: int
    base: int
    shape: tuple


@dataclass(frozen=True, slots=True)
class PackPlan:
    """How one micro-batch's residual pack moves. Slots index `StageProgram.pack_sources`.

    ``moved``: base tensors that are copied to the acceptor and back; ``kept``: variable reads and
    constants (and views of them) that stay on the owner; ``views``: rebuilt from their base after a load.
    ``moved_bytes`` is what an eviction frees and what the ledger counts as the pack's size.
    """
    moved: tuple
    kept: tuple
    views: tuple
    moved_bytes: int
    kept_bytes: int

    def __repr__(self):
        return (f"PackPlan(moved={len(self.moved)} tensors/{self.moved_bytes} B, kept={len(self.kept)}"
                f" ({self.kept_bytes} B), views={len(self.views)})")


def _nbytes(t) -> int:
    shape = t.shape
    if not shape.is_fully_defined():
        raise ValueError(f"pack tensor {t.name} has a dynamic shape {shape}; stages need static shapes")
    return int(np.prod(shape.as_list(), dtype=np.int64)) * t.dtype.size


def plan_pack(graph_tensors: Sequence) -> PackPlan:
    """Classify pack tensors (forward-graph tensors, in slot order) into moved / kept / views."""
    slot_of = {id(t): i for i, t in enumerate(graph_tensors)}
    moved, kept, views = [], [], []

    def root(t):
        """Follow view ops up to a tensor that is itself a pack slot (or give up)."""
        while t.op.type in VIEW_OPS and t.op.inputs:
            t = t.op.inputs[0]
            if id(t) in slot_of:
                return slot_of[id(t)]
        return None

    def views_kept(t):
        """A view (Reshape, ...) of a weight read or constant shares that buffer: it is no
        activation, and moving it would free nothing."""
        while t.op.type in VIEW_OPS and t.op.inputs:
            t = t.op.inputs[0]
        return t.op.type in KEPT_OPS

    for i, t in enumerate(graph_tensors):
        if t.op.type in KEPT_OPS or (t.op.type in VIEW_OPS and views_kept(t)):
            kept.append(i)
            continue
        base = root(t) if t.op.type in VIEW_OPS and t.shape.is_fully_defined() else None
        if base is not None and graph_tensors[base].dtype == t.dtype:
            views.append((i, base))
        else:
            moved.append(i)
    # A view whose base is kept (a view of a weight) stays too; chains resolve to a moved base.
    resolved = []
    moved_set = set(moved)
    for slot, base in views:
        while base not in moved_set and base not in kept:
            base = dict(views)[base]
        if base in kept:
            kept.append(slot)
        else:
            resolved.append(View(slot, base, tuple(graph_tensors[slot].shape.as_list())))
    return PackPlan(tuple(moved), tuple(sorted(kept)), tuple(resolved),
                    sum(_nbytes(graph_tensors[i]) for i in moved),
                    sum(_nbytes(graph_tensors[i]) for i in kept))


class Pack:
    """One micro-batch's residual pack, owned by the executor: a list of tensors by slot."""
    __slots__ = ("tensors", "resident")

    def __init__(self, tensors):
        self.tensors = list(tensors)
        self.resident = True

    def split(self, plan: PackPlan):
        """Drop moved bases and views (they leave with an eviction); return the bases."""
        bases = [self.tensors[i] for i in plan.moved]
        for i in plan.moved:
            self.tensors[i] = None
        for view in plan.views:
            self.tensors[view.slot] = None
        self.resident = False
        return bases

    def restore(self, plan: PackPlan, bases):
        """Put loaded bases back and rebuild views from them (no copy: a reshape shares bytes)."""
        for i, t in zip(plan.moved, bases):
            self.tensors[i] = t
        for view in plan.views:
            base = self.tensors[view.base]
            self.tensors[view.slot] = tf.reshape(base, view.shape)
        self.resident = True


def _dense(g):
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


def _spec(t):
    return tf.TensorSpec(t.shape, t.dtype)


class StageProgram:
    """One model part compiled for one device and one micro-batch shape.

    ``fn(x)`` (or ``fn(x, labels)`` for the last stage, returning a scalar loss) is traced once;
    its forward/backward pair is built from that trace. ``variables`` are the trainable variables
    the gradients are returned for, in order. ``x`` and a middle stage's output may be any nested
    structure of tensors (a residual stream plus a mask): whatever crosses a cut is sent whole;
    gradients come back in the same structure, None for leaves that take none (integer masks).
    """

    def __init__(self, fn: Callable, variables: Sequence, input_spec,
                 label_spec: Optional[tf.TensorSpec] = None, device: Optional[str] = None):
        self.device = device
        self.variables = list(variables)
        self.is_last = label_spec is not None
        self.input_spec = input_spec
        specs = [input_spec] + ([label_spec] if label_spec is not None else [])
        with tf.device(device):
            concrete = tf.function(fn, autograph=False).get_concrete_function(*specs)
        pair = _tf_private.forward_backward_pair(concrete)
        self._pair = pair
        self._captures = list(concrete.captured_inputs)
        self._num_inputs = len(tf.nest.flatten(input_spec))
        self._num_args = self._num_inputs + (1 if self.is_last else 0)
        out = pair.forward_graph.outputs
        self._out_structure = concrete.structured_outputs
        if len(tf.nest.flatten(self._out_structure, expand_composites=True)) != pair.num_outputs:
            raise ValueError(f"a stage must return a tensor or a nested structure of tensors, got "
                             f"{self._out_structure!r}")
        self.output_spec = tf.nest.pack_sequence_as(self._out_structure,
                                                    [_spec(t) for t in out[:pair.num_outputs]])
        if self.is_last and (pair.num_outputs != 1 or out[0].shape.rank != 0):
            raise ValueError(f"the last stage must return a scalar loss, got {self.output_spec}")
        # Pack slots: the backward captures that come from the forward (side outputs).
        self.pack_sources = tuple(k for kind, k in pair.capture_sources if kind == "side")
        self.plan = plan_pack([out[k] for k in self.pack_sources])
        # Which backward output is the gradient of each variable / of the stage input.
        handle_pos = {id(c): self._num_args + j for j, c in enumerate(self._captures)}
        self._var_grad = []
        for v in self.variables:
            handle = getattr(v, "handle", None)
            pos = handle_pos.get(id(handle))
            if pos is None:
                raise ValueError(f"stage variable {v.name} is not used by the stage function")
            self._var_grad.append(pos)
        self.output_grad_needed = pair.num_output_grads > 0
        self._grad_specs = [_spec(out[i]) for i in pair.grad_outputs]
        self._split = None

    # --------------------------------------------------------------------------------- calls
    def forward(self, x, labels=None):
        """Run the forward on the stage device; returns (output, Pack)."""
        args = ([tf.convert_to_tensor(t) for t in tf.nest.flatten(x)]
                + ([tf.convert_to_tensor(labels)] if self.is_last else []) + self._captures)
        with tf.device(self.device):
            outs = self._pair.forward(*args)
        n = self._pair.num_outputs
        output = outs[0] if self.is_last else tf.nest.pack_sequence_as(self._out_structure, list(outs[:n]))
        return output, Pack([outs[k] for k in self.pack_sources])

    def _input_grad(self, grads):
        """The stage input's gradient in the input's structure (None where there is none)."""
        flat = [_dense(g) for g in grads[:self._num_inputs]]
        return tf.nest.pack_sequence_as(self.input_spec, flat)

    def backward(self, pack: Pack, output_grad):
        """Run the backward; returns (input gradient or None, [variable gradients])."""
        grads_in, captures = self._backward_args(pack, output_grad)
        with tf.device(self.device):
            grads = self._pair.backward(grads_in, captures)
        var_grads = [_dense(grads[i]) for i in self._var_grad]
        return self._input_grad(grads), var_grads

    # ------------------------------------------------------------ split backward (B, then W)
    @property
    def split(self):
        """The backward cut into its input half and weight half (`_tf_private.split_backward`),
        built on first use: only zero-bubble schedules need it."""
        if self._split is None:
            self._split = _tf_private.split_backward(self._pair, range(self._num_args), self._var_grad)
        return self._split

    def _backward_args(self, pack: Pack, output_grad):
        if not pack.resident:
            raise RuntimeError("backward on an evicted pack: load it first")
        side = iter(pack.tensors)
        captures = [next(side) if kind == "side" else src for kind, src in self._pair.capture_sources]
        if output_grad is None or not self.output_grad_needed:
            return [], captures
        flat = tf.nest.flatten(output_grad)
        grads = []
        for i, spec in zip(self._pair.grad_outputs, self._grad_specs):
            g = _dense(flat[i])
            if g is None:  # an output the next stage did not use
                with tf.device(self.device):
                    g = tf.zeros(spec.shape, spec.dtype)
            grads.append(g)
        return grads, captures

    @property
    def residual_bytes(self) -> int:
        """Bytes B leaves for W per micro-batch: the output gradient and the intermediate
        gradients the weight half starts from."""
        grads = sum(int(s.shape.num_elements() or 0) * s.dtype.size for s in self._grad_specs)
        return grads + self.split.saved_bytes

    def backward_input(self, pack: Pack, output_grad):
        """B: the input gradient (or None) and the residual that `backward_weight` needs (the
        output gradient and the intermediate gradients B computed on the way). The pack stays
        owned by the caller until W."""
        grads_in, captures = self._backward_args(pack, output_grad)
        with tf.device(self.device):
            grads, saved = self.split.input_grads(grads_in, captures)
        return self._input_grad(grads), (grads_in, saved)

    def backward_weight(self, pack: Pack, residual):
        """W: the variable gradients, from B's residual and the pack (no forward, no input-gradient
        work is redone)."""
        grads_in, saved = residual
        _, captures = self._backward_args(pack, None)
        with tf.device(self.device):
            grads = self.split.weight_grads(saved, grads_in, captures)
        return [_dense(g) for g in grads]

    def __repr__(self):
        return (f"StageProgram(device={self.device!r}, vars={len(self.variables)}, "
                f"out={self.output_spec.shape}, {self.plan!r})")


# ------------------------------------------------------------------------------ model parts
def partition(layers: Sequence, num_stages: int) -> list[list]:
    """Split a layer list into ``num_stages`` contiguous parts of near-equal length."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if len(layers) < num_stages:
        raise ValueError(f"cannot split {len(layers)} layers into {num_stages} stages")
    bounds = np.linspace(0, len(layers), num_stages + 1).round().astype(int)
    return [list(layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def takes_training(part) -> bool:
    """Whether ``part`` takes a ``training`` keyword: every Keras layer (and model) does, and so
    does any callable that declares it."""
    import inspect

    import keras
    if isinstance(part, keras.layers.Layer):
        return True
    try:
        params = inspect.signature(part).parameters
    except (TypeError, ValueError):
        return False
    return "training" in params


def sequential(parts: Sequence, training: Optional[bool] = None) -> Callable:
    """Compose layers/callables left to right; ``training`` (when not None) is passed to every
    part that takes it, so Dropout and BatchNorm run in the mode of the step."""
    parts = list(parts)
    calls = [(part, training is not None and takes_training(part)) for part in parts]

    def call(x):
        for part, flag in calls:
            x = part(x, training=training) if flag else part(x)
        return x
    return call


def trainable_variables(parts: Sequence) -> list:
    seen, out = set(), []
    for part in parts:
        for v in getattr(part, "trainable_variables", []):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


# ------------------------------------------------------------------------------- tiny GPT
class _Block:
    """Pre-LN transformer block: causal multi-head self-attention and a GELU MLP (plain TF ops
    around Keras Dense/LayerNorm; tracing is several times cheaper than keras MultiHeadAttention)."""

    def __init__(self, d_model, heads, seq, seed):
        import keras
        init = lambda k: keras.initializers.GlorotUniform(seed=seed * 10 + k)  # noqa: E731
        self.heads, self.seq, self.d_model = heads, seq, d_model
        self.ln1 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.qkv = keras.layers.Dense(3 * d_model, kernel_initializer=init(1))
        self.proj = keras.layers.Dense(d_model, kernel_initializer=init(4))
        self.ln2 = keras.layers.LayerNormalization(epsilon=1e-5)
        self.fc1 = keras.layers.Dense(4 * d_model, activation="gelu", kernel_initializer=init(2))
        self.fc2 = keras.layers.Dense(d_model, kernel_initializer=init(3))
        shape = (1, seq, d_model)
        for layer in (self.ln1, self.qkv, self.proj, self.ln2, self.fc1):
            layer.build(shape)
        self.fc2.build((1, seq, 4 * d_model))
        self.trainable_variables = [v for layer in (self.ln1, self.qkv, self.proj, self.ln2, self.fc1, self.fc2)
                                    for v in layer.trainable_variables]

    def attention(self, x):
        b, t, d, h = tf.shape(x)[0], self.seq, self.d_model, self.heads
        q, k, v = tf.split(self.qkv(x), 3, axis=-1)
        split = lambda z: tf.transpose(tf.reshape(z, [b, t, h, d // h]), [0, 2, 1, 3])  # noqa: E731
        scores = tf.matmul(split(q), split(k), transpose_b=True) / float(np.sqrt(d // h))
        causal = tf.linalg.band_part(tf.ones([t, t]), -1, 0)
        scores = scores - 1e9 * (1.0 - causal)
        out = tf.matmul(tf.nn.softmax(scores, axis=-1), split(v))
        return self.proj(tf.reshape(tf.transpose(out, [0, 2, 1, 3]), [b, t, d]))

    def __call__(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(self.fc1(self.ln2(x)))


class _Embed:
    """Token + learned position embedding (one-hot matmul: dense gradients, no IndexedSlices)."""

    def __init__(self, vocab, d_model, seq, seed):
        rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.tok = tf.Variable(rng.normal(0, 0.02, (vocab, d_model)).astype("float32"), name="tok")
        self.pos = tf.Variable(rng.normal(0, 0.02, (seq, d_model)).astype("float32"), name="pos")
        self.trainable_variables = [self.tok, self.pos]

    def __call__(self, ids):
        return tf.einsum("btv,vd->btd", tf.one_hot(ids, self.vocab), self.tok) + self.pos


class _Head:
    """Final LayerNorm and the vocabulary projection (returns logits)."""

    def __init__(self, vocab, d_model, seq, seed):
        import keras
        self.ln = keras.layers.LayerNormalization(epsilon=1e-5)
        self.out = keras.layers.Dense(vocab, kernel_initializer=keras.initializers.GlorotUniform(seed))
        self.ln.build((1, seq, d_model))
        self.out.build((1, seq, d_model))
        self.trainable_variables = self.ln.trainable_variables + self.out.trainable_variables

    def __call__(self, x):
        return self.out(self.ln(x))


def lm_loss(labels, logits):
    """Mean token cross-entropy (a micro-batch mean: the pipeline averages over micro-batches)."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


def tiny_gpt(num_parts: int, *, vocab: int = 64, d_model: int = 32, heads: int = 2, seq: int = 16,
             blocks_per_part: int = 1, seed: int = 0, devices: Optional[Sequence[str]] = None):
    """A GPT-style model cut into ``num_parts`` parts of ``blocks_per_part`` transformer blocks:
    part 0 starts with the embeddings, the last part ends with the head. Part k's variables are
    created on ``devices[k]`` when given. Returns a list of parts (lists of callables)."""
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts must be a positive int, got {num_parts!r}")
    if d_model % heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
    parts = []
    for k in range(num_parts):
        with tf.device(None if devices is None else devices[k]):
            part = [_Embed(vocab, d_model, seq, seed)] if k == 0 else []
            part += [_Block(d_model, heads, seq, seed + 100 * k + j) for j in range(blocks_per_part)]
            if k == num_parts - 1:
                part.append(_Head(vocab, d_model, seq, seed + 7))
        parts.append(part)
    return parts
