"""`tf.function` calls inside a co-executed iteration are coarse units (terra/runtime/units.py).

Each program is run eagerly and under Terra (tests/e2e/harness.py): per-step losses and final
variables must agree, graphs must really run, and traces and fallbacks stay few. The programs
cover a helper under the tape (gradient through it, also replayed after a fallback), helpers
outside the tape (gradient clipping, a metric), data passed straight to a tf.function, Python
arguments that retrace or choose another path, a helper that writes a variable, and a whole
train step wrapped in tf.function with a TerraGradientTape inside (a plain tape there).
"""
import keras
import tensorflow as tf

import terra
from tests.e2e.harness import assert_coexecuted, data, mlp, run_both, weights


# ------------------------------------------------------------------ helper under the tape
@tf.function
def penalty(w):
    return 0.01 * tf.reduce_sum(tf.square(w)), tf.reduce_max(tf.abs(w))


def prog_inside_tape(Tape, steps=12):
    """Gradient flows through the helper; every fourth step a Python branch after the helper
    call leaves the path, so the fallback replays the helper's forward call under the tape."""
    model, opt = mlp(3), keras.optimizers.Adam(0.01)
    X, Y = data(steps)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            pen, peak = penalty(model.trainable_variables[0])
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2) + pen
            if i % 4 == 3:
                loss = loss + 0.1 * peak
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_helper_inside_tape_gradient_flows_through_it():
    stats, explain = run_both(prog_inside_tape)
    assert_coexecuted(stats, explain)
    assert "coexecution" in explain.splitlines()[-1], explain
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 2, 1), explain


# ------------------------------------------------------------------ helpers outside the tape
@tf.function
def clip(grads, norm):
    return tf.clip_by_global_norm(grads, norm)


@tf.function
def standardize(x):
    return (x - tf.reduce_mean(x, axis=0)) / (tf.math.reduce_std(x, axis=0) + 1e-3)


@tf.function
def mae(y, p):
    return tf.reduce_mean(tf.abs(y - p))


def prog_outside_tape(Tape, steps=10):
    model, opt = mlp(5), keras.optimizers.SGD(0.1)
    X, Y = data(steps, seed=4)
    losses, metrics = [], []
    for i in range(steps):
        x, y = standardize(tf.constant(X[i])), tf.constant(Y[i])  # data fed to a helper first
        with Tape() as tape:
            pred = model(x)
            loss = tf.reduce_mean((pred - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        grads, _ = clip(grads, 0.5)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        metrics.append(mae(y, pred))
        losses.append(float(loss))
    return losses + [float(m) for m in metrics], weights(model, opt)


def test_helpers_outside_tape_clip_and_metric():
    stats, explain = run_both(prog_outside_tape)
    assert_coexecuted(stats, explain)
    assert "coexecution" in explain.splitlines()[-1], explain
    # (the loop's end falls back and is traced; its path is not built: no next iteration came,
    # runtime/filing.py, `last`)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 1, 1), explain


# ------------------------------------------------------------------ Python argument retraces
@tf.function
def scaled(w, scale):
    return scale * tf.reduce_sum(w * w)


def prog_python_scalar(Tape, steps=12, schedule=lambda i: (0.01, 0.02)[i % 2]):
    model, opt = mlp(7), keras.optimizers.SGD(0.05)
    X, Y = data(steps, seed=6)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2) + \
                scaled(model.trainable_variables[0], schedule(i))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_python_scalar_alternating_two_concrete_functions():
    stats, explain = run_both(prog_python_scalar)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (5, 2, 1), explain


def test_python_scalar_changing_every_step_stays_correct():
    stats, explain = run_both(lambda T: prog_python_scalar(T, 8, lambda i: 0.01 / (i + 1)))
    # each value is a new concrete function: no graph fits
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (8, 0, 0), explain


# ------------------------------------------------------------------ Python argument picks a path
@tf.function
def head(h, kind):
    if kind == "abs":
        return tf.reduce_mean(tf.abs(h))
    return tf.reduce_mean(tf.square(h))


def prog_python_path(Tape, steps=16):
    model, opt = mlp(9), keras.optimizers.SGD(0.05)
    X, Y = data(steps, seed=8)
    losses = []
    for i in range(steps):
        kind = "abs" if i % 3 == 0 else "square"
        with Tape() as tape:
            loss = head(model(X[i]) - Y[i], kind)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_python_argument_takes_another_path():
    stats, explain = run_both(prog_python_path)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 2, 1), explain


# ------------------------------------------------------------------ a helper writing a variable
def prog_counter(Tape, steps=10):
    model, opt = mlp(11), keras.optimizers.SGD(0.05)
    seen = tf.Variable(0.0)

    @tf.function
    def count(x):
        seen.assign_add(tf.reduce_sum(x))
        return tf.identity(seen)

    X, Y = data(steps, seed=10)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        total = count(grads[0])
        losses += [float(loss), float(total)]
    return losses, weights(model, opt) + [seen.numpy()]


def test_helper_writing_a_variable():
    stats, explain = run_both(prog_counter)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain


# ------------------------------------------------------------------ the whole step is a tf.function
def prog_whole_step(Tape, steps=6):
    model, opt = mlp(13), keras.optimizers.SGD(0.05)
    X, Y = data(steps, seed=12)

    @tf.function
    def step(x, y):
        with Tape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return [float(step(X[i], Y[i])) for i in range(steps)], weights(model, opt)


def test_whole_step_in_tf_function_uses_a_plain_tape():
    stats, explain = run_both(prog_whole_step)
    assert stats["traces"] == 0 and stats["graph_builds"] == 0, explain


# ------------------------------------------------------------------ randomness inside a helper
def prog_noise(Tape, steps=8, generator=False):
    model, opt = mlp(15), keras.optimizers.SGD(0.05)
    X, Y = data(steps, seed=14)
    gen = tf.random.Generator.from_seed(3)

    @tf.function
    def noisy(h):
        shape = tf.shape(h)
        return h + 0.1 * (gen.normal(shape) if generator else tf.random.normal(shape))

    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((noisy(model(X[i])) - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt) + [gen.state.numpy()]


def test_stateful_random_inside_a_helper_stays_eager():
    # a replayed graph instantiates the function's random kernels anew: another sequence
    stats, explain = run_both(prog_noise)
    assert stats["graph_builds"] == 0, explain
    assert "stateful random op without a Generator" in explain, explain


def test_generator_inside_a_helper_coexecutes():
    stats, explain = run_both(lambda T: prog_noise(T, generator=True))
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain


# ------------------------------------------------------------------ data-dependent output shape
@tf.function
def positives(h):
    return tf.boolean_mask(h, h > 0)


def prog_mask(Tape, steps=6):
    model, opt = mlp(17), keras.optimizers.SGD(0.05)
    X, Y = data(steps, seed=16)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            kept = positives(model(X[i]) - Y[i])
            loss = tf.reduce_sum(kept) / float(max(int(kept.shape[0]), 1))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_data_dependent_shape_inside_a_helper_compiles():
    stats, explain = run_both(prog_mask)
    # a path per count of kept values (the program divides by it): the paths differ only in that
    # count and the constant made from it, so they share one graph (a shape group, built when
    # the second count is traced); the third count falls back once and joins it
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 1), explain


# ------------------------------------------------------------------ variables only the helper reads
def prog_helper_variables(Tape, steps=12):
    """`gain` is captured by the helper and `shift` passed to it, and nothing else reads them;
    every third step a fallback replays the helper call under the tape before the gradient.
    (tests/test_tf_private_function_units.py checks that the replayed call alone makes a tape
    watch such variables.)"""
    model, opt = mlp(19), keras.optimizers.SGD(0.05)
    gain, shift = tf.Variable([1.5]), tf.Variable([0.25])

    @tf.function
    def reg(b):
        return 0.1 * tf.reduce_sum(gain * gain) + tf.reduce_sum(b * b)

    X, Y = data(steps, seed=18)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            out = model(X[i])
            loss = tf.reduce_mean((out - Y[i]) ** 2) + reg(shift)
            if i % 3 == 2:   # a Python branch after the helper: the fallback replays it
                loss = loss + 0.5 * tf.reduce_mean(out)
        variables = model.trainable_variables + [gain, shift]
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        losses.append(float(loss))
    return losses, weights(model, opt) + [gain.numpy(), shift.numpy()]


def test_helper_variables_watched_after_a_fallback():
    stats, explain = run_both(prog_helper_variables)
    assert_coexecuted(stats, explain)
    # the branch's path, traced in a fallback, takes `reduce_mean`'s NumPy reduction indices as a
    # feed, so its graph cannot fix the mean's shape; the gradient after it may have read that
    # shape, so the graph fetches the mean from its first build and Python checks its shape
    # before skipping the gradient (no fallback to learn the fetch)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (5, 2, 1), explain


# ------------------------------------------------------------------ evaluation after the loop
@tf.function
def evaluate(model, x, y):
    return tf.reduce_mean((model(x) - y) ** 2)


def prog_eval_after_loop(Tape, steps=8):
    model, opt = mlp(21), keras.optimizers.SGD(0.05)
    X, Y = data(steps + 1, seed=20)
    x_val, y_val = tf.constant(X[-1]), tf.constant(Y[-1])
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    losses.append(float(evaluate(model, x_val, y_val)))
    return losses, weights(model, opt)


def test_tf_function_after_the_loop_ends_the_iteration():
    stats, explain = run_both(prog_eval_after_loop)
    assert_coexecuted(stats, explain)
    assert stats["fallbacks"] == 0, explain
    assert "iteration ended by call of tf.function evaluate" in explain, explain


# ------------------------------------------------------------------ persistent tape
@tf.function
def sum_sq(w):
    return tf.reduce_sum(w * w)


def prog_persistent(Tape, steps=10):
    """A persistent tape makes TF call the higher-order forward/backward pair of the helper."""
    model, opt = mlp(23), keras.optimizers.SGD(0.05)
    X, Y = data(steps, seed=22)
    losses = []
    for i in range(steps):
        with Tape(persistent=True) as tape:
            fit = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
            reg = 0.01 * sum_sq(model.trainable_variables[0])
            if i % 4 == 3:
                reg = reg * 2.0
        g_fit = tape.gradient(fit, model.trainable_variables)
        g_reg = tape.gradient(reg, model.trainable_variables)
        grads = [a if b is None else a + b for a, b in zip(g_fit, g_reg)]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(fit + reg))
    return losses, weights(model, opt)


def test_helper_under_a_persistent_tape():
    stats, explain = run_both(prog_persistent)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 2, 1), explain
