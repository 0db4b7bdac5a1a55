"""Coarse units whose Python reads tensor values (GradUnit.reads): a gradient function that takes a
slice's bounds with `constant_value`, an optimizer that branches on a finite check or on its
step count. Skip mode checks those values before skipping the unit; a changed value takes
another path or falls back, so the result is eager's. Before, the graph replayed the unit as
it was traced: silently wrong gradients, unskipped overflows, accumulation applied every step."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


pytestmark = pytest.mark.usefixtures("fresh_terra")


def _equal(got, eager):
    assert len(got) == len(eager)
    for a, b in zip(got, eager):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _tensor_index(Tape, steps=30):
    w = tf.Variable(tf.range(5.0))
    data = [tf.constant(i % 3) for i in range(steps)]
    for i in range(steps):
        with Tape() as tape:
            y = w[data[i] + 1] * 2.0  # the slice's bounds are computed by ops: a graph value
        w.assign_sub(0.1 * tape.gradient(y, w))
    return [w.numpy()]


def test_gradient_of_a_slice_at_a_computed_index_equals_eager():
    eager = _tensor_index(tf.GradientTape)
    got = _tensor_index(tf.TerraGradientTape)
    terra.end_iteration()
    _equal(got, eager)
    s, explain = terra.stats(), terra.explain()
    # the slice's gradient takes the slice's own bounds (graph values), not NumPy copies of
    # them (hook.GRADIENT_RULES): one path serves every index
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (2, 1, 0), explain
    assert "a value the unit's Python read has changed" not in explain


def _sampled_index(Tape, steps=24):
    """An actor-critic's `log(probs[0, action])` with `action` from np.random.choice."""
    rng = np.random.RandomState(0)
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
    opt = keras.optimizers.Adam(0.05)
    states = [tf.constant(rng.normal(size=(1, 3)).astype(np.float32)) for _ in range(steps)]
    losses = []
    for i in range(steps):
        with Tape() as tape:
            probs = model(states[i])
            action = rng.choice(2, p=np.squeeze(probs))
            loss = -tf.math.log(probs[0, action])
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        losses.append(float(loss))
    return [np.array(losses)] + [v.numpy() for v in model.weights]


def test_gradient_of_a_slice_at_a_sampled_python_index_equals_eager():
    eager = _sampled_index(tf.GradientTape)
    with CompileCounter() as c:
        got = _sampled_index(tf.TerraGradientTape)
    _equal(got, eager)
    # iteration 1 creates Adam's variables; p1, with the sampled action a constant, is built at
    # 3; the first other action (iteration 12) falls back once and generalizes p1 to p2 (the
    # index a feed), built, which runs every later iteration
    c.assert_counts(traces=4, graph_builds=2, fallbacks=1)


def _sampled_episodes(Tape, episodes=16, steps=5):
    """The keras-io actor-critic's shape: each episode under one tape, an action sampled from
    the policy at every step (`np.squeeze(probs)`), `log(probs[0, action])` and the critic's
    value per step, returns from NumPy, and the gradient and the update taken inside the
    tape's `with`."""
    keras.utils.set_random_seed(0)
    inp = keras.Input((4,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    model = keras.Model(inp, [keras.layers.Dense(2, activation="softmax")(h),
                              keras.layers.Dense(1)(h)])
    opt = keras.optimizers.Adam(0.01)
    rng = np.random.RandomState(1)
    losses = []
    for _ in range(episodes):
        state = rng.uniform(-1, 1, 4).astype(np.float32)
        log_probs, values = [], []
        with Tape() as tape:
            for _ in range(steps):
                probs, value = model(tf.expand_dims(tf.convert_to_tensor(state), 0))
                values.append(value[0, 0])
                action = np.random.choice(2, p=np.squeeze(probs))
                log_probs.append(tf.math.log(probs[0, action]))
                state = (state + (0.1 if action else -0.1)).astype(np.float32)
            returns = np.cumsum(rng.uniform(size=steps)).tolist()
            loss = sum(-lp * (r - v) for lp, r, v in zip(log_probs, returns, values))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            log_probs.clear()  # (as the example clears its histories)
            values.clear()
        losses.append(float(loss))
    return [np.array(losses)] + [v.numpy() for v in model.weights]


def test_actions_sampled_at_every_step_of_an_episode_are_feeds_of_one_path():
    """Each step's `probs[0, action]` and its gradient take one feed (the bounds are one tensor
    object: ConstRef.origin), two episodes that agree on a step's action by chance do not pin
    it (a constant fed at one pass of a loop is fed at every pass), and the NumPy reads of the
    probabilities are seen while tracing: two traces after the first, one build, no fallback."""
    eager = _sampled_episodes(tf.GradientTape)
    with CompileCounter() as c:
        got = _sampled_episodes(tf.TerraGradientTape)
    _equal(got, eager)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0, path_switches=0)


def _second_gradient(Tape, steps=6, twice_at=4):
    w = tf.Variable(2.0)
    out = []
    for i in range(steps):
        with Tape() as tape:
            loss = w * w
            g = tape.gradient(loss, w)
            if i == twice_at:
                try:
                    tape.gradient(loss, w)
                    out.append("no error")
                except RuntimeError as e:
                    out.append(f"RuntimeError: {e}")
        w.assign_sub(0.1 * g)
        out.append(float(w.numpy()))
    return out


def test_a_second_gradient_of_a_non_persistent_tape_raises_as_in_eager():
    """A gradient the graph computed leaves the tape as eager's does (off the stack, no state):
    a second `gradient` raises eager's RuntimeError, after a fallback."""
    eager = _second_gradient(tf.GradientTape)
    with CompileCounter() as c:
        got = _second_gradient(tf.TerraGradientTape)
    assert got == eager and "RuntimeError: A non-persistent GradientTape" in str(eager), got
    c.assert_counts(traces=3, graph_builds=1, fallbacks=1)


def _loss_scaled(Tape, steps=30, overflow_at=25):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1, dtype="float32")])
        opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        rng = np.random.default_rng(1)
        X = [tf.constant(rng.normal(size=(8, 4)).astype(np.float32)) for _ in range(steps)]
        Y = [tf.constant(rng.normal(size=(8, 1)).astype(np.float32)) for _ in range(steps)]
        losses = []
        for i in range(steps):
            x = X[i] * (1e6 if i == overflow_at else 1.0)  # float16 overflow: skip, halve scale
            with Tape() as tape:
                loss = tf.reduce_mean((model(x) - Y[i]) ** 2)
                scaled = opt.scale_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        return [np.array(losses), opt.iterations.numpy(), opt.dynamic_scale.numpy()] + \
            [v.numpy() for v in model.weights]
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_loss_scaling_skips_an_overflowed_step_as_eager_does():
    eager = _loss_scaled(tf.GradientTape)
    with CompileCounter() as c:
        got = _loss_scaled(tf.TerraGradientTape)
    assert eager[1] == 29 and eager[2] == 16384.0  # the overflow was skipped, scale halved
    _equal(got, eager)
    # p1 built at iteration 3; the 1e6 factor (prepared in iteration 25) falls back and
    # generalizes p1 to p2 (built); at 26 the finite check the optimizer read has changed: a
    # fallback to p3 (built); iteration 30's reads after the loop fall back to p4 (not built:
    # no next iteration came, runtime/filing.py, `last`)
    c.assert_counts(traces=6, graph_builds=3, fallbacks=3)


def _accumulated(Tape, steps=30):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=4)
    rng = np.random.default_rng(1)
    X = [tf.constant(rng.normal(size=(8, 4)).astype(np.float32)) for _ in range(steps)]
    Y = [tf.constant(rng.normal(size=(8, 1)).astype(np.float32)) for _ in range(steps)]
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        losses.append(float(loss))
    return [np.array(losses), opt.iterations.numpy()] + [v.numpy() for v in opt.variables] + \
        [v.numpy() for v in model.weights]


def test_gradient_accumulation_applies_every_fourth_step_as_eager_does():
    eager = _accumulated(tf.GradientTape)
    got = _accumulated(tf.TerraGradientTape)
    terra.end_iteration()
    _equal(got, eager)
    s, explain = terra.stats(), terra.explain()
    # p1 (no update) and p2 (the fourth step's update), each rebuilt once for a value kept past
    # the iteration; the predictor expects p1 after p2 and after p1, so each update step is one
    # switch p1 -> p2 (iterations 8, 12, ..., 28 after p2's build)
    assert (s["graph_builds"], s["path_switches"], s["fallbacks"]) == (4, 7, 3), explain
    assert "stays eager" not in explain


def _pooled_with_schedule(Tape, steps=12):
    """A global average pooling's gradient reads its input's shape (a unit read, the same every
    step) while a Python scalar the program changes every step scales the output
    (examples/demo.py's pattern)."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Dense(3),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4)])
    opt = keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(4)
    X = [rng.normal(size=(4, 8, 8, 2)).astype(np.float32) for _ in range(steps)]
    keep, losses = 1.0, []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean(tf.square(model(X[i]) * keep))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))
        keep -= 0.01
        losses.append(float(loss))
    return [np.array(losses)] + [v.numpy() for v in model.weights]


def test_a_changing_python_scalar_is_generalized_next_to_a_unit_that_reads_a_shape():
    eager = _pooled_with_schedule(tf.GradientTape)
    got = _pooled_with_schedule(tf.TerraGradientTape)
    terra.end_iteration()
    _equal(got, eager)
    s, explain = terra.stats(), terra.explain()
    # p0 and p1 differ only in the scale: generalized to p2 (a feed) at iteration 3, built, then
    # every later step runs it (before, the pooling gradient's shape read froze every constant
    # of the gradient unit, so each step was a new path and the site went eager)
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (3, 1, 0), explain
    assert "generalized to p2" in explain and "stays eager" not in explain
