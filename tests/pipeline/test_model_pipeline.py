"""terra.pipeline.pipeline: an ordinary Keras model (Sequential, functional, a list of blocks) is
cut automatically and trained equal to one device accumulating the same micro-batches; the plan's
pack and memory predictions equal what the built stages hold."""
import keras
import numpy as np
import pytest
import tensorflow as tf

import terra.pipeline as tp
from terra.pipeline import planner
from terra.pipeline.keras_graph import LayerGraph
from tests.pipeline._model import logical_cpus, max_err

TOL = 1e-5
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def residual_model(seed=0, dropout=0.0, bn=False):
    """Dense -> (Dense, Add: a residual stream crossing cuts) -> LayerNorm [-> BatchNorm]
    [-> Dropout] -> Dense -> Dense (logits)."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((12,))
    h = keras.layers.Dense(16, activation="relu", name="d0")(inp)
    r = keras.layers.Dense(16, activation="tanh", name="d1")(h)
    h = keras.layers.Add(name="add")([h, r])
    h = keras.layers.LayerNormalization(name="ln")(h)
    if bn:
        h = keras.layers.BatchNormalization(name="bn")(h)
    if dropout:
        h = keras.layers.Dropout(dropout, seed=seed + 5, name="drop")(h)
    h = keras.layers.Dense(16, activation="relu", name="d2")(h)
    return keras.Model(inp, keras.layers.Dense(5, name="logits")(h))


def data(b=16, seed=0, features=12, classes=5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(b, features)).astype("float32"), rng.integers(0, classes, b).astype("int32")


def reference_steps(model, x, y, m, optimizer, steps, loss=LOSS):
    """One device: per step, micro-batches in order with training=True, gradients of the mean
    loss accumulated, one update. Returns the step losses."""
    out = []
    for _ in range(steps):
        total, losses = None, []
        for xi, yi in zip(np.split(x, m), np.split(y, m)):
            with tf.GradientTape() as tape:
                li = loss(yi, model(xi, training=True))
            grads = [tf.convert_to_tensor(g) / m for g in tape.gradient(li, model.trainable_variables)]
            total = grads if total is None else [a + b for a, b in zip(total, grads)]
            losses.append(float(li))
        optimizer.apply_gradients(zip(total, model.trainable_variables))
        out.append(float(np.mean(losses)))
    return out


def values(model):
    return [v.numpy() for v in model.variables]


# ------------------------------------------------------------------------------- the graph
def test_layer_graph_boundaries_carry_the_residual_stream():
    graph = LayerGraph.of(residual_model())
    names = [c.name for c in graph.calls]
    assert names == ["d0", "d1", "add", "ln", "d2", "logits"]
    # Between d1 and add both d0's output (the residual) and d1's cross: two tensors.
    assert [len(graph.boundary(k)) for k in range(len(graph) + 1)] == [1, 1, 2, 1, 1, 1, 1]
    x, _ = data(4)
    model = residual_model()
    h = x
    for a, b in ((0, 2), (2, 4), (4, 6)):
        h = LayerGraph.of(model).segment(a, b)(h, training=False)
    np.testing.assert_array_equal(h.numpy(), model(x, training=False).numpy())


def test_layer_graph_rejects_a_subclassed_model_and_takes_its_blocks_as_a_list():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.blocks = [keras.layers.Dense(4), keras.layers.Dense(3)]

        def call(self, x):
            for b in self.blocks:
                x = b(x)
            return x
    net = Net()
    with pytest.raises(TypeError, match="subclassed model.*pass its blocks as a list"):
        LayerGraph.of(net)
    graph = LayerGraph.of(net.blocks)
    assert [c.name for c in graph.calls] == [b.name for b in net.blocks]
    with pytest.raises(TypeError, match="expected a keras.Sequential"):
        LayerGraph.of(object())


# ------------------------------------------------------------------------------- training
@pytest.mark.parametrize("cuts", [None, [2, 4]])
def test_functional_model_trains_equal_to_microbatch_single_device(cuts):
    """Planned cuts (FLOP costs: deterministic) and the cut inside the residual (two tensors
    cross it): losses and every variable equal one device's at 1e-5 over three steps."""
    devices = logical_cpus(3)
    x, y = data()
    model, ref = residual_model(), residual_model()
    trainer = tp.pipeline(model, LOSS, keras.optimizers.Adam(0.01), devices=devices, microbatches=4,
                          cuts=cuts, measure=False)
    try:
        losses = [trainer.step(x, y) for _ in range(3)]
        if cuts is not None:
            assert trainer.plan.cuts == (2, 4)
            assert len(trainer.segments[1].takes) == 2  # residual + branch cross the first cut
    finally:
        trainer.close()
    expected = reference_steps(ref, x, y, 4, keras.optimizers.Adam(0.01), 3)
    assert losses == pytest.approx(expected, abs=TOL)
    assert max_err(values(model), values(ref)) < TOL
    # Each part's variables now live on its rank's device; the model still runs as a whole.
    for part, segment in zip(trainer.plan.parts, trainer.segments):
        for v in segment.trainable_variables:
            assert v.value.device.endswith(devices[part.rank].split("/")[-1].replace("device:", "device:"))
    np.testing.assert_allclose(model(x).numpy(), ref(x).numpy(), atol=TOL)


def test_sequential_with_dropout_and_batchnorm_trains_and_evaluates_like_one_device():
    def make():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.BatchNormalization(), keras.layers.Dropout(0.3, seed=7),
                                 keras.layers.Dense(16, activation="relu"), keras.layers.Dense(5)])
    devices = logical_cpus(2)
    x, y = data(seed=1)
    model, ref = make(), make()
    trainer = tp.pipeline(model, LOSS, "adam", devices=devices, microbatches=4, measure=False)
    try:
        losses = [trainer.step(x, y) for _ in range(2)]
        evaluated = trainer.evaluate(x, y)
    finally:
        trainer.close()
    expected = reference_steps(ref, x, y, 4, keras.optimizers.get("adam"), 2)
    assert losses == pytest.approx(expected, abs=TOL)
    assert max_err(values(model), values(ref)) < TOL  # moving statistics and seed state too
    assert float(np.max(np.abs(ref.layers[1].moving_mean.numpy()))) > 0
    want = np.mean([float(LOSS(yi, ref(xi, training=False))) for xi, yi in zip(np.split(x, 4), np.split(y, 4))])
    assert evaluated == pytest.approx(want, abs=TOL)


def test_shared_layer_across_parts_is_updated_once_with_summed_gradients():
    """A layer called at the start and at the end (tied weights) lands in two parts: its
    variables live with the first part and take one update from both parts' gradients."""
    def make():
        keras.utils.set_random_seed(4)
        inp = keras.Input((8,))
        shared = keras.layers.Dense(8, activation="tanh", name="shared")
        h = shared(inp)
        h = keras.layers.Dense(8, activation="relu", name="mid")(h)
        h = shared(h)
        return keras.Model(inp, keras.layers.Dense(3, name="out")(h))
    devices = logical_cpus(2)
    x, y = data(8, seed=2, features=8, classes=3)
    model, ref = make(), make()
    trainer = tp.pipeline(model, LOSS, keras.optimizers.Adam(0.01), devices=devices, microbatches=2,
                          cuts=[2])
    try:
        losses = [trainer.step(x, y) for _ in range(2)]
        assert trainer.trainer._ties, "the shared layer's variables are tied across parts"
    finally:
        trainer.close()
    expected = reference_steps(ref, x, y, 2, keras.optimizers.Adam(0.01), 2)
    assert losses == pytest.approx(expected, abs=TOL)
    assert max_err(values(model), values(ref)) < TOL


def test_list_of_blocks_with_a_loss_by_name_and_global_clipnorm():
    def make():
        keras.utils.set_random_seed(5)
        blocks = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(16, activation="relu"),
                  keras.layers.Dense(5, activation="softmax")]
        for b, n in zip(blocks, (12, 16, 16)):
            b.build((None, n))
        return blocks
    devices = logical_cpus(3)
    x, y = data(12, seed=3)
    blocks, ref = make(), make()
    opt = lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1)  # noqa: E731 - clipping binds
    trainer = tp.pipeline(blocks, "sparse_categorical_crossentropy", opt(), devices=devices,
                          schedule="gpipe", microbatches=3, measure=False)
    try:
        losses = [trainer.step(x, y) for _ in range(2)]
    finally:
        trainer.close()
    ref_model = keras.Sequential(ref)
    loss = lambda a, b: tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(a, b))  # noqa: E731
    expected = reference_steps(ref_model, x, y, 3, opt(), 2, loss)
    assert losses == pytest.approx(expected, abs=TOL)
    assert max_err([v.numpy() for b in blocks for v in b.variables],
                   [v.numpy() for b in ref for v in b.variables]) < TOL


# -------------------------------------------------------------------------------- prediction
def test_plan_predicts_the_built_packs_and_the_ledger_peaks():
    """Predicted pack bytes equal the built stages' saved activations exactly; predicted rank
    peaks equal the executor's ledger up to the optimizer's own scalars (iterations, rate)."""
    devices = logical_cpus(3)
    x, y = data()
    trainer = tp.pipeline(residual_model(bn=True), LOSS, keras.optimizers.Adam(0.01), devices=devices,
                          microbatches=4, measure=False, example_batch=(x, y))
    try:
        plan = trainer.plan  # planned before any step
        assert [p.inflight for p in plan.parts] == [3, 2, 1]  # 1F1B: p - s packs in flight
        trainer.step(x, y)
        rows = trainer.check()
    finally:
        trainer.close()
    assert [r["pack_bytes_predicted"] for r in rows] == [r["pack_bytes"] for r in rows]
    assert trainer.trainer.pack_bytes == [p.act_bytes for p in plan.parts]
    for r in rows:
        assert abs(r["rank_peak_bytes_error"]) < 0.01, r
    text = plan.explain()
    assert "is the slowest" in text and "moving the cut" in text
    assert str(plan).startswith("Plan(1f1b, 3 parts")


def test_an_impossible_memory_budget_is_refused_with_the_numbers():
    devices = logical_cpus(2)
    x, y = data()
    with pytest.raises(planner.NoPlan, match=r"no cut of the 6 calls into 2 parts fits 1000 B per part "
                                                r"\(in-flight packs per part \[2, 1\]\)"):
        tp.pipeline(residual_model(), LOSS, keras.optimizers.Adam(0.01), devices=devices, microbatches=4,
                    measure=False, example_batch=(x, y), memory_budget=1000)


def test_bad_input_is_refused_before_anything_runs():
    devices = logical_cpus(2)
    model = residual_model()
    with pytest.raises(ValueError, match="Chimera runs two model copies"):
        tp.pipeline(model, LOSS, "adam", devices=devices, schedule="chimera")
    with pytest.raises(ValueError, match="does not exist"):
        tp.pipeline(model, LOSS, "adam", devices=["/device:GPU:7", devices[0]])
    with pytest.raises(ValueError, match="unknown option"):
        tp.pipeline(model, LOSS, "adam", devices=devices, kk=2)
    with pytest.raises(ValueError, match="stages=3 but 2 devices"):
        tp.pipeline(model, LOSS, "adam", stages=3, devices=devices)
    with pytest.raises(TypeError, match="loss must be"):
        tp.pipeline(model, 3, "adam", devices=devices)
    built = keras.optimizers.Adam()
    built.build(model.trainable_variables)
    with pytest.raises(ValueError, match="already built"):
        tp.pipeline(model, LOSS, built, devices=devices)
    x, y = data()
    trainer = tp.pipeline(model, LOSS, "adam", devices=devices, microbatches=4, measure=False)
    with pytest.raises(RuntimeError, match="plan is made at the first step"):
        trainer.plan
    with pytest.raises(ValueError, match="multiple of microbatches=4"):
        trainer.step(x[:6], y[:6])
    with pytest.raises(ValueError, match="cuts must be 1 increasing"):
        tp.pipeline(model, LOSS, "adam", devices=devices, cuts=[3, 4], measure=False, example_batch=(x, y))


def test_measuring_leaves_the_model_as_it_was():
    """Profiling and check() run forwards with training=True (Dropout draws, BatchNorm moves its
    statistics); the model's variables are restored after each."""
    devices = logical_cpus(2)
    x, y = data()
    model = residual_model(dropout=0.5, bn=True)
    before = values(model)
    trainer = tp.pipeline(model, LOSS, keras.optimizers.Adam(0.01), devices=devices, microbatches=4,
                          example_batch=(x, y))
    try:
        assert trainer.profile.measured and trainer.profile.whole[0] > 0
        halves = trainer.profile.halves   # the model in two parts ran too (Dropout, BatchNorm)
        n = len(trainer.profile.calls)
        assert [h[:2] for h in halves] == [(0, n // 2), (n // 2, n)] and min(min(h[2:]) for h in halves) > 0
        assert max_err(values(model), before) == 0.0
        trainer.step(x, y)
        after_step = values(model)
        rows = trainer.check(repeats=1)
        assert max_err(values(model), after_step) == 0.0
        assert all(r["forward_s"] > 0 and r["backward_s"] > 0 for r in rows)
    finally:
        trainer.close()


def test_bpipe_plan_counts_accepted_packs_and_trains_equal_to_one_device():
    """With BPipe the acceptor rank holds its partner's packs: the plan's rank peaks (simulated
    with the parts' bytes) equal the executor's ledger, and training is unchanged."""
    devices = logical_cpus(4)
    x, y = data()
    model, ref = residual_model(), residual_model()
    trainer = tp.pipeline(model, LOSS, keras.optimizers.Adam(0.01), devices=devices, microbatches=4,
                          balance="bpipe", measure=False, cuts=[1, 3, 5])
    try:
        losses = [trainer.step(x, y) for _ in range(2)]
        ledger = [r["peak_total"] for r in trainer.memory_report()]
    finally:
        trainer.close()
    assert "bpipe" in trainer.plan.schedule
    # Equal up to the optimizer's own scalars (iterations, learning rate) on the first device.
    assert [abs(a - b) for a, b in zip(trainer.plan.rank_peak_bytes, ledger)] in ([12, 0, 0, 0], [0, 0, 0, 0])
    assert losses == pytest.approx(reference_steps(ref, x, y, 4, keras.optimizers.Adam(0.01), 2), abs=TOL)
    assert max_err(values(model), values(ref)) < TOL
