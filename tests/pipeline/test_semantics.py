"""Training semantics of PipelineTrainer on plain Keras layers equal single-device training that
accumulates gradients over the same micro-batches in the same order: the training flag, Dropout
draws, BatchNorm statistics, Embedding (IndexedSlices) gradients, tied weights, nested values
across a cut, one optimizer over all variables, forward-only evaluation."""
import keras
import numpy as np
import pytest
import tensorflow as tf

from terra.pipeline import executor as ex
from terra.pipeline import stage as st
from tests.pipeline._model import logical_cpus, max_err

TOL = 1e-5
VOCAB, D, SEQ = 16, 8, 4


def _init(k):
    return keras.initializers.GlorotUniform(seed=k)


def _built(layer, shape):
    layer.build(shape)
    return layer


def keras_parts(devices, dropout=0.5):
    """Embedding + Dense + Dropout | BatchNorm + Dense (logits), each part built on its device."""
    with tf.device(devices[0]):
        first = [_built(keras.layers.Embedding(VOCAB, D, embeddings_initializer=_init(1)), (None, SEQ)),
                 _built(keras.layers.Dense(D, activation="relu", kernel_initializer=_init(2)), (None, SEQ, D)),
                 keras.layers.Dropout(dropout, seed=3)]
    with tf.device(devices[1]):
        last = [_built(keras.layers.BatchNormalization(), (None, SEQ, D)),
                _built(keras.layers.Dense(VOCAB, kernel_initializer=_init(4)), (None, SEQ, D))]
    return [first, last]


def tokens(b, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (b, SEQ)).astype("int32"), rng.integers(0, VOCAB, (b, SEQ)).astype("int32"))


def all_variables(parts):
    """Every variable the parts hold (trainable, statistics, seed states), once each."""
    seen, out = set(), []
    for part in parts:
        for layer in part:
            for v in getattr(layer, "variables", None) or getattr(layer, "trainable_variables", []):
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
    return out


def snapshot(variables):
    return [np.array(v.numpy()) for v in variables]


def restore(variables, values):
    for v, value in zip(variables, values):
        v.assign(value)


def microbatch_reference(parts, x, y, m, optimizer):
    """Single device, one micro-batch after the other with training=True, gradients of the mean
    loss accumulated, one update: (loss, grads, every variable's value after). Restores all."""
    def forward(h, training):
        for part in parts:
            h = st.sequential(part, training)(h)
        return h
    variables = st.trainable_variables([layer for part in parts for layer in part])
    every = all_variables(parts)
    before = snapshot(every)
    total, losses = None, []
    for xi, yi in zip(np.split(x, m), np.split(y, m)):
        with tf.GradientTape() as tape:
            loss = st.lm_loss(yi, forward(xi, True))
        grads = [tf.convert_to_tensor(g) / m for g in tape.gradient(loss, variables)]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
        losses.append(float(loss))
    optimizer.apply_gradients(zip(total, variables))
    after = snapshot(every)
    restore(every, before)
    return float(np.mean(losses)), [g.numpy() for g in total], after


def _trainer(parts, devices, schedule="1f1b", m=4, optimizer=lambda: keras.optimizers.Adam(0.01), **kw):
    return ex.PipelineTrainer(parts, optimizer, devices=devices, schedule=schedule, microbatches=m, **kw)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_training_step_equals_microbatch_single_device(schedule):
    """training=True reaches every layer: Dropout draws what one device draws from the same seed
    state, BatchNorm's moving statistics take the same m updates, the Embedding's IndexedSlices
    gradient goes through the whole backward (1F1B) and the split one (ZB-H1)."""
    devices = logical_cpus(2)
    parts = keras_parts(devices)
    x, y = tokens(8)
    ref_loss, ref_grads, ref_after = microbatch_reference(parts, x, y, 4, keras.optimizers.Adam(0.01))
    every = all_variables(parts)
    trainer = _trainer(parts, devices, schedule)
    try:
        loss = trainer.step(x, y)
    finally:
        trainer.close()
    assert loss == pytest.approx(ref_loss, abs=TOL)
    assert max_err([g for part in trainer.last_gradients for g in part], ref_grads) < TOL
    assert max_err(snapshot(every), ref_after) < TOL
    bn, drop = parts[1][0], parts[0][2]
    assert float(np.max(np.abs(bn.moving_mean.numpy()))) > 0  # the statistics moved
    assert drop.seed_generator.state.numpy().tolist() == [3, 4]  # one draw per micro-batch


def test_evaluate_runs_forwards_only_with_training_false():
    devices = logical_cpus(2)
    parts = keras_parts(devices)
    x, y = tokens(8, seed=1)
    every = all_variables(parts)
    before = snapshot(every)
    expected = np.mean([float(st.lm_loss(yi, st.sequential(parts[0] + parts[1], False)(xi)))
                        for xi, yi in zip(np.split(x, 4), np.split(y, 4))])
    trainer = _trainer(parts, devices)
    try:
        loss = trainer.evaluate(x, y)
        assert max_err(snapshot(every), before) == 0.0  # no update, no statistics, no draw
        assert loss == pytest.approx(expected, abs=TOL)
        assert trainer._built_for is None  # no forward/backward pair was built
        assert trainer.step(x, y) != pytest.approx(expected, abs=1e-3)  # Dropout is active there
    finally:
        trainer.close()


class _TiedHead:
    """Logits from the embedding matrix of another part (weight tying)."""

    def __init__(self, embedding):
        self.embedding = embedding
        self.trainable_variables = [embedding.embeddings]

    def __call__(self, h):
        return tf.matmul(h, self.embedding.embeddings, transpose_b=True)


def test_tied_weights_take_one_update_with_summed_gradients():
    devices = logical_cpus(2)
    with tf.device(devices[0]):
        emb = _built(keras.layers.Embedding(VOCAB, D, embeddings_initializer=_init(1)), (None, SEQ))
        fc = _built(keras.layers.Dense(D, activation="tanh", kernel_initializer=_init(2)), (None, SEQ, D))
    with tf.device(devices[1]):
        fc2 = _built(keras.layers.Dense(D, kernel_initializer=_init(3)), (None, SEQ, D))
    parts = [[emb, fc], [fc2, _TiedHead(emb)]]
    x, y = tokens(8, seed=2)
    ref_loss, ref_grads, ref_after = microbatch_reference(parts, x, y, 4, keras.optimizers.Adam(0.01))
    every = all_variables(parts)
    trainer = _trainer(parts, devices)
    try:
        loss = trainer.step(x, y)
    finally:
        trainer.close()
    assert loss == pytest.approx(ref_loss, abs=TOL)
    assert max_err(snapshot(every), ref_after) < TOL
    # The tied matrix's gradient is the sum of both uses, seen from both parts; part 0 owns it.
    g = trainer.last_gradients
    assert max_err([g[0][0], g[1][-1]], [ref_grads[0], ref_grads[0]]) < TOL
    assert trainer.parts[0].owned == [0, 1, 2] and trainer.parts[1].owned == [0, 1]


class _Split:
    """First part: a residual stream and a mask cross the cut together (a dict of two tensors)."""

    def __init__(self, device):
        with tf.device(device):
            self.emb = _built(keras.layers.Embedding(VOCAB, D, embeddings_initializer=_init(5)), (None, SEQ))
        self.trainable_variables = self.emb.trainable_variables

    def __call__(self, ids):
        return {"h": self.emb(ids), "mask": tf.cast(ids % 3 != 0, tf.int32)}


class _Mix:
    """Middle part: updates the stream under the mask and passes both on."""

    def __init__(self, device):
        with tf.device(device):
            self.fc = _built(keras.layers.Dense(D, activation="tanh", kernel_initializer=_init(6)), (None, SEQ, D))
        self.trainable_variables = self.fc.trainable_variables

    def __call__(self, inputs):
        keep = tf.cast(inputs["mask"], tf.float32)[..., None]
        return {"h": inputs["h"] + keep * self.fc(inputs["h"]), "mask": inputs["mask"]}


class _Out:
    def __init__(self, device):
        with tf.device(device):
            self.fc = _built(keras.layers.Dense(VOCAB, kernel_initializer=_init(7)), (None, SEQ, D))
        self.trainable_variables = self.fc.trainable_variables

    def __call__(self, inputs):
        return self.fc(inputs["h"] * tf.cast(inputs["mask"], tf.float32)[..., None])


def test_a_nested_structure_crosses_the_cuts():
    devices = logical_cpus(3)
    parts = [[_Split(devices[0])], [_Mix(devices[1])], [_Out(devices[2])]]
    x, y = tokens(6, seed=3)
    ref_loss, ref_grads, ref_after = microbatch_reference(parts, x, y, 3, keras.optimizers.SGD(0.5))
    every = all_variables(parts)
    trainer = _trainer(parts, devices, m=3, optimizer=lambda: keras.optimizers.SGD(0.5))
    try:
        loss = trainer.step(x, y)
    finally:
        trainer.close()
    assert loss == pytest.approx(ref_loss, abs=TOL)
    assert max_err([g for part in trainer.last_gradients for g in part], ref_grads) < TOL
    assert max_err(snapshot(every), ref_after) < TOL
    spec = trainer.parts[0].program.output_spec
    assert spec["mask"].dtype == tf.int32 and spec["h"].shape == (2, SEQ, D)


def test_one_optimizer_clips_by_the_global_norm():
    """``global_clipnorm`` needs every gradient in one optimizer; one optimizer per part clips
    each part by its own norm and lands elsewhere."""
    devices = logical_cpus(2)
    parts = keras_parts(devices, dropout=0.0)
    x, y = tokens(8, seed=4)
    make = lambda: keras.optimizers.SGD(1.0, global_clipnorm=0.05)  # noqa: E731
    _, _, ref_after = microbatch_reference(parts, x, y, 4, make())
    every = all_variables(parts)
    before = snapshot(every)
    results = []
    for one in (True, False):
        restore(every, before)
        trainer = _trainer(parts, devices, optimizer=make, one_optimizer=one)
        try:
            trainer.step(x, y)
        finally:
            trainer.close()
        results.append(snapshot(every))
        if one:
            assert trainer.optimizer is not None and all(p.optimizer is None for p in trainer.parts)
    assert max_err(results[0], ref_after) < TOL
    assert max_err(results[1], ref_after) > 1e-3


def test_a_loss_scale_optimizer_seeds_every_stage_with_its_one_scale():
    """The backward starts from the optimizer's scaled loss and its update unscales: the result
    equals single-device training with the same LossScaleOptimizer (scale 2**10 here); with one
    optimizer per part there would be one dynamic scale per part, which is refused."""
    devices = logical_cpus(2)
    parts = keras_parts(devices)
    x, y = tokens(8, seed=5)
    make = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=2.0 ** 10)  # noqa: E731
    ref_opt = make()
    variables = st.trainable_variables([layer for part in parts for layer in part])
    every = all_variables(parts)
    before = snapshot(every)
    total = None
    for xi, yi in zip(np.split(x, 4), np.split(y, 4)):
        with tf.GradientTape() as tape:
            loss = ref_opt.scale_loss(st.lm_loss(yi, st.sequential(parts[0] + parts[1], True)(xi)) / 4)
        grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, variables)]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    ref_opt.apply_gradients(zip(total, variables))
    ref_after = snapshot(every)
    restore(every, before)
    trainer = _trainer(parts, devices, optimizer=make, one_optimizer=True)
    try:
        trainer.step(x, y)
    finally:
        trainer.close()
    assert max_err(snapshot(every), ref_after) < TOL
    assert max_err([g for part in trainer.last_gradients for g in part], [g.numpy() for g in total]) < 2.0 ** 10 * TOL
    restore(every, before)
    trainer = _trainer(parts, devices, optimizer=make)
    with pytest.raises(ValueError, match="a LossScaleOptimizer needs one_optimizer=True"):
        trainer.step(x, y)
    trainer.close()


@pytest.mark.parametrize("name,options", [("gpipe", {}), ("1f1b", {}), ("interleaved", {"v": 2}), ("kfkb", {"k": 2}),
                                          ("chimera", {}), ("zb-h1", {}), ("zb-v", {}),
                                          ("dualpipe-v", {})])
def test_every_schedule_runs_each_stages_forwards_in_microbatch_order(name, options):
    """What makes a stage's Dropout draws and BatchNorm updates those of one device: a stage's
    stateful layers see micro-batches 0, 1, ... in order (BPipe moves packs, never forwards)."""
    from terra.pipeline.actions import F
    for p, m in ((2, 4), (4, 8), (8, 8)):
        for balance in (None, "bpipe"):
            sch = ex.make_schedule(name, p, m, balance, **options)
            for stage in range(sch.num_stages):
                order = [a.microbatch for r in range(p) for a in sch.compute_order(r)
                         if a.kind is F and a.stage == stage]
                assert order == sorted(order), (name, p, m, balance, stage, order)


def test_one_optimizer_with_chimera_updates_both_pipelines_like_one_device():
    from tests.pipeline._model import batch, reference
    devices = logical_cpus(4)
    parts = st.tiny_gpt(4, devices=devices)
    replicas = st.tiny_gpt(4, devices=devices[::-1])
    x, y = batch(8)
    _, ref_grads, ref_weights, variables = reference(parts, x, y, keras.optimizers.Adam(1e-3))
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(1e-3), devices=devices,
                                 schedule="chimera", microbatches=4, replica_stages=replicas,
                                 one_optimizer=True)
    try:
        trainer.step(x, y)
    finally:
        trainer.close()
    assert max_err([g for part in trainer.last_gradients for g in part], ref_grads) < TOL
    assert max_err([v.numpy() for v in variables], ref_weights) < TOL
    rvars = [v for part in replicas for v in st.trainable_variables(part)]
    assert max_err([v.numpy() for v in rvars], ref_weights) < TOL
    # Adam's two slots sit with each variable (rank 0 also holds the step count and the rate).
    from terra.pipeline.memory import variable_bytes
    expected = [2 * variable_bytes(st.trainable_variables(part)) + (12 if r == 0 else 0)
                for r, part in enumerate(parts)]
    assert [r["optimizer"] for r in trainer.ledger.report()] == expected


class _Masked:
    """First part taking a nested batch: token ids and a padding mask."""

    def __init__(self, device):
        with tf.device(device):
            self.emb = _built(keras.layers.Embedding(VOCAB, D, embeddings_initializer=_init(8)), (None, SEQ))
        self.trainable_variables = self.emb.trainable_variables

    def __call__(self, batch):
        return {"h": self.emb(batch["ids"]), "mask": batch["mask"]}


def test_the_batch_may_be_a_nested_structure():
    devices = logical_cpus(2)
    parts = [[_Masked(devices[0])], [_Out(devices[1])]]
    ids, y = tokens(8, seed=6)
    x = {"ids": ids, "mask": (ids % 2).astype("int32")}
    variables = st.trainable_variables([layer for part in parts for layer in part])
    every = all_variables(parts)
    before = snapshot(every)
    total, losses = None, []
    for i in range(4):
        xi = {k: v[2 * i:2 * i + 2] for k, v in x.items()}
        with tf.GradientTape() as tape:
            loss = st.lm_loss(y[2 * i:2 * i + 2], parts[1][0](parts[0][0](xi)))
        grads = [tf.convert_to_tensor(g) / 4 for g in tape.gradient(loss, variables)]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
        losses.append(float(loss))
    keras.optimizers.SGD(0.5).apply_gradients(zip(total, variables))
    ref_after = snapshot(every)
    restore(every, before)
    trainer = _trainer(parts, devices, optimizer=lambda: keras.optimizers.SGD(0.5))
    try:
        assert trainer.evaluate(x, y) == pytest.approx(float(np.mean(losses)), abs=TOL)  # no Dropout here
        loss = trainer.step(x, y)
        with pytest.raises(ValueError, match="same batch size"):
            trainer.step({"ids": ids, "mask": x["mask"][:4]}, y)
    finally:
        trainer.close()
    assert loss == pytest.approx(float(np.mean(losses)), abs=TOL)
    assert max_err(snapshot(every), ref_after) < TOL


def deep_keras_parts(devices):
    """Four parts with a Dropout and a BatchNorm in each middle part."""
    parts = keras_parts([devices[0], devices[-1]])
    middle = []
    for k, device in enumerate(devices[1:-1]):
        with tf.device(device):
            middle.append([_built(keras.layers.Dense(D, activation="relu", kernel_initializer=_init(20 + k)),
                                  (None, SEQ, D)),
                           keras.layers.Dropout(0.3, seed=30 + k),
                           _built(keras.layers.BatchNormalization(), (None, SEQ, D))])
    return [parts[0]] + middle + [parts[1]]


@pytest.mark.parametrize("schedule,balance", [("1f1b", "bpipe"), ("zb-v", None)])
def test_four_stages_with_dropout_and_batchnorm_match_one_device(schedule, balance):
    """Dropout masks saved for the backward survive an evict/load round trip (1F1B + BPipe) and
    a split backward over two chunks per rank (ZB-V: 8 parts)."""
    devices = logical_cpus(4)
    plan = ex.make_schedule(schedule, 4, 8, balance)
    parts = deep_keras_parts([devices[plan.stage_ranks[k]] for k in range(plan.pipe_depth)])
    x, y = tokens(16, seed=7)
    ref_loss, ref_grads, ref_after = microbatch_reference(parts, x, y, 8, keras.optimizers.Adam(0.01))
    every = all_variables(parts)
    trainer = ex.PipelineTrainer(parts, lambda: keras.optimizers.Adam(0.01), devices=devices,
                                 schedule=schedule, balance=balance, microbatches=8)
    try:
        loss = trainer.step(x, y)
    finally:
        trainer.close()
    assert any(a.kind.name == "EVICT" for _, _, a in trainer.schedule.actions()) == (balance == "bpipe")
    assert loss == pytest.approx(ref_loss, abs=TOL)
    assert max_err([g for part in trainer.last_gradients for g in part], ref_grads) < TOL
    assert max_err(snapshot(every), ref_after) < TOL
