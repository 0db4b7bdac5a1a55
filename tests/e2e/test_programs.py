"""End-to-end equality: user programs run eagerly and under Terra give the same losses and weights.

Each program is written the way a user writes an eager training loop, and each exercises
something AutoGraph gets wrong or that stresses the co-execution runtime. Besides equality
(rtol 1e-5), each test bounds the number of traces and fallbacks, and checks graphs really ran.
"""
import random

import keras
import numpy as np
import tensorflow as tf

import terra
from tests.e2e.harness import assert_coexecuted, data, mlp, run_both, weights


# 1 ------------------------------------------------------------------ Python object mutation
class DropScale:
    """DropBlock-style schedule: a Python attribute mutated every step and used in ops."""

    def __init__(self):
        self.keep_prob = 1.0

    def __call__(self, x):
        return x * self.keep_prob


def prog_mutation(Tape, steps=10):
    model, opt, scale = mlp(), keras.optimizers.SGD(0.05), DropScale()
    X, Y = data(steps)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            h = scale(model(X[i]))
            loss = tf.reduce_mean((h - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        scale.keep_prob -= 0.03
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_python_object_mutation():
    stats, explain = run_both(prog_mutation)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain


# 2 ------------------------------------------------------------------ trainer storing loss on self
class Trainer:
    def __init__(self, Tape):
        self.Tape = Tape
        self.model = mlp(1)
        self.opt = keras.optimizers.Adam(0.01)
        self.last_loss = None
        self.history = []

    def step(self, x, y):
        with self.Tape() as tape:
            loss = tf.reduce_mean(tf.square(self.model(x) - y))
            if self.last_loss is not None:  # a penalty on the change of the loss
                loss = loss + 0.1 * tf.abs(loss - self.last_loss)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.opt.apply_gradients(zip(grads, self.model.trainable_variables))
        self.last_loss = loss
        self.history.append(loss)


def prog_trainer(Tape, steps=10):
    t = Trainer(Tape)
    X, Y = data(steps)
    for i in range(steps):
        t.step(X[i], Y[i])
    return [float(l) for l in t.history], weights(t.model, t.opt)


def test_trainer_stores_loss_on_self():
    stats, explain = run_both(prog_trainer)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain


# 3 ------------------------------------------------------------------ Python-random path choice
class RandomDepth(keras.Model):
    """SDPoint-style: Python's random module picks which block runs."""

    def __init__(self):
        super().__init__()
        self.a = keras.layers.Dense(8, activation="relu")
        self.b = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, x):
        h = self.a(x) if random.random() < 0.5 else self.b(x)
        return self.out(h)


def prog_random_path(Tape, steps=24):
    keras.utils.set_random_seed(0)
    random.seed(3)
    model = RandomDepth()
    model(np.zeros((8, 4), np.float32))
    opt = keras.optimizers.SGD(0.05)
    X, Y = data(steps)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_python_random_path_choice():
    stats, explain = run_both(prog_random_path)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 2, 1), explain
    # the state-making first iteration's path and the two branches, each traced once at least
    assert stats["new_paths"] == 3, explain


# 4 ------------------------------------------------------------------ NumPy metric fed back
def prog_numpy_metric(Tape, steps=10):
    model, opt = mlp(2, out=3), keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(5)
    X = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    L = rng.integers(0, 3, size=(steps, 8))
    losses = []
    for i in range(steps):
        with Tape() as tape:
            logits = model(X[i])
            # a scikit-learn-style metric computed on materialized logits
            acc = float(np.mean(np.argmax(np.asarray(logits), axis=1) == L[i]))
            ce = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(L[i], logits,
                                                                            from_logits=True))
            loss = ce * (1.5 - acc)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_numpy_metric_fed_back_into_loss():
    stats, explain = run_both(prog_numpy_metric)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain


# 5 ------------------------------------------------------------------ generator of varying length
def chunks(x, sizes):
    start = 0
    for s in sizes:
        yield x[start:start + s]
        start += s


def prog_generator(Tape, steps=16):
    model, opt = mlp(3), keras.optimizers.SGD(0.05)
    X, Y = data(steps)
    plans = [(4, 4), (2, 2, 4)]
    losses = []
    for i in range(steps):
        sizes = plans[(i // 2) % 2]
        with Tape() as tape:
            loss = 0.0
            for xs, ys in zip(chunks(X[i], sizes), chunks(Y[i], sizes)):
                loss = loss + tf.reduce_sum((model(xs) - ys) ** 2)
            loss = loss / 8.0
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_generator_of_varying_length():
    stats, explain = run_both(prog_generator)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (5, 2, 1), explain


# 6 ------------------------------------------------------------------ try/except choosing ops
def risky_normalize(h, allowed):
    if not allowed:
        raise ValueError("normalization not allowed this step")
    return h / (tf.norm(h, axis=1, keepdims=True) + 1.0)


def prog_try_except(Tape, steps=12):
    model, opt = mlp(4), keras.optimizers.SGD(0.05)
    X, Y = data(steps)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            h = model(X[i])
            try:
                h = risky_normalize(h, allowed=(i % 3 != 2))
            except ValueError:
                h = tf.tanh(h)
            loss = tf.reduce_mean((h - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_try_except_chooses_ops():
    stats, explain = run_both(prog_try_except)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (5, 2, 1), explain


# 7 ------------------------------------------------------------------ data-dependent early exit
def prog_early_exit(Tape, steps=40):
    model, opt = mlp(5), keras.optimizers.SGD(0.02)
    X, Y = data(4)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i % 4]) - Y[i % 4]) ** 2)
        if loss.numpy() < 0.45:  # data-dependent exit of the training loop
            losses.append(float(loss))
            break
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_data_dependent_early_exit():
    stats, explain = run_both(prog_early_exit)
    assert_coexecuted(stats, explain)
    # the exit's iteration falls back and is traced; its path's graph would be built by a next
    # iteration, which does not come (runtime/filing.py, `last`)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 1, 1), explain


# 8 ------------------------------------------------------------------ two tapes, two optimizers
def prog_gan(Tape, steps=10):
    keras.utils.set_random_seed(6)
    gen = keras.Sequential([keras.layers.Input((2,)), keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dense(4)])
    disc = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(1)])
    g_opt, d_opt = keras.optimizers.Adam(1e-3), keras.optimizers.Adam(2e-3)
    rng = np.random.default_rng(7)
    real = rng.normal(size=(steps, 8, 4)).astype(np.float32)
    noise = rng.normal(size=(steps, 8, 2)).astype(np.float32)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    losses = []
    for i in range(steps):
        with Tape() as g_tape, Tape() as d_tape:
            fake = gen(noise[i], training=True)
            real_out, fake_out = disc(real[i]), disc(fake)
            d_loss = bce(tf.ones_like(real_out), real_out) + bce(tf.zeros_like(fake_out), fake_out)
            g_loss = bce(tf.ones_like(fake_out), fake_out)
        g_grads = g_tape.gradient(g_loss, gen.trainable_variables)
        d_grads = d_tape.gradient(d_loss, disc.trainable_variables)
        g_opt.apply_gradients(zip(g_grads, gen.trainable_variables))
        d_opt.apply_gradients(zip(d_grads, disc.trainable_variables))
        losses += [float(g_loss), float(d_loss)]
    return losses, weights(gen, disc, g_opt, d_opt)


def test_two_tapes_two_optimizers():
    stats, explain = run_both(prog_gan)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain


# 9 ------------------------------------------------------------------ recursion over varying trees
TREES = [("leaf", 0), (("leaf", 1), ("leaf", 2)), ((("leaf", 0), ("leaf", 3)), ("leaf", 1))]


class TreeNet:
    def __init__(self):
        keras.utils.set_random_seed(8)
        self.embed = keras.layers.Embedding(4, 6)
        self.combine = keras.layers.Dense(6, activation="tanh")
        self.head = keras.layers.Dense(1)

    def encode(self, tree):
        if tree[0] == "leaf":
            return self.embed(tf.constant([tree[1]]))
        return self.combine(tf.concat([self.encode(tree[0]), self.encode(tree[1])], axis=1))

    def variables(self):
        return self.embed.trainable_variables + self.combine.trainable_variables + \
            self.head.trainable_variables


def prog_trees(Tape, steps=15):
    net = TreeNet()
    for t in TREES:  # build every layer once
        net.head(net.encode(t))
    opt = keras.optimizers.SGD(0.1)
    targets = [0.5, -0.3, 0.8]
    losses = []
    for i in range(steps):
        k = i % 3
        with Tape() as tape:
            loss = tf.reduce_sum((net.head(net.encode(TREES[k])) - targets[k]) ** 2)
        grads = tape.gradient(loss, net.variables())
        opt.apply_gradients(zip(grads, net.variables()))
        losses.append(float(loss))
    return losses, weights(net.variables(), opt)


def test_recursion_over_varying_trees():
    stats, explain = run_both(prog_trees)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (7, 3, 2), explain


# 10 ----------------------------------------------------------------- smaller last batch
def prog_last_batch(Tape, epochs=3):
    model, opt = mlp(9), keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(10)
    X = rng.normal(size=(28, 4)).astype(np.float32)
    Y = rng.normal(size=(28, 1)).astype(np.float32)
    losses = []
    for _ in range(epochs):
        for s in range(0, 28, 8):  # batches 8, 8, 8, 4
            with Tape() as tape:
                loss = tf.reduce_mean((model(X[s:s + 8]) - Y[s:s + 8]) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
    return losses, weights(model, opt)


def test_smaller_last_batch():
    stats, explain = run_both(prog_last_batch)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 2, 1), explain


# 11 ----------------------------------------------------------------- globals and printing
STEP = 0
PRINTED = []


def prog_globals(Tape, steps=10):
    global STEP
    STEP = 0
    PRINTED.clear()
    model, opt = mlp(11), keras.optimizers.SGD(0.05)
    X, Y = data(steps)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        STEP += 1
        if STEP % 3 == 0:
            PRINTED.append(f"step {STEP}: loss {loss:.5f}")
            print(PRINTED[-1])
        losses.append(loss)
    return [float(l) for l in losses], weights(model, opt) + [np.array(len(PRINTED))]


def test_globals_and_printing():
    stats, explain = run_both(prog_globals)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain


# 12 ----------------------------------------------------------------- op error, then more training
def prog_op_error(Tape, steps=10):
    model, opt = mlp(12), keras.optimizers.SGD(0.05)
    X, Y = data(steps)
    table = tf.constant([1.0, 2.0, 3.0, 4.0])
    losses, errors = [], []
    for i in range(steps):
        idx = np.array([0, 1, 2, 3] if i != 5 else [0, 1, 2, 9], np.int32)  # 9 is out of range
        try:
            with Tape() as tape:
                w = tf.gather(table, idx)
                loss = tf.reduce_mean((model(X[i] * w) - Y[i]) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        except tf.errors.InvalidArgumentError as e:
            errors.append(type(e).__name__)
            losses.append(-1.0)
    assert errors == ["InvalidArgumentError"], errors
    return losses, weights(model, opt)


def test_op_error_then_more_training():
    stats, explain = run_both(prog_op_error)
    assert_coexecuted(stats, explain)
    # the failing iteration falls back and goes on traced after the op that failed; its error
    # leaves the tape's block at once (an empty trace, not filed, counted)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 1, 1), explain


# 13 ----------------------------------------------------------------- persistent tape, jacobian
def prog_persistent_jacobian(Tape, steps=6):
    model, opt = mlp(13), keras.optimizers.SGD(0.05)
    X, Y = data(steps)
    losses = []
    for i in range(steps):
        x = tf.constant(X[i])
        with Tape(persistent=True) as tape:
            tape.watch(x)
            pred = model(x)
            loss = tf.reduce_mean((pred - Y[i]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        dx = tape.gradient(loss, x)
        if i == 4:
            jac = tape.jacobian(pred, x)  # Terra does not compile jacobians: runs eagerly
            losses.append(float(tf.reduce_sum(jac)))
        del tape
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses += [float(loss), float(tf.reduce_sum(dx))]
    return losses, weights(model, opt)


def test_persistent_tape_and_jacobian():
    stats, explain = run_both(prog_persistent_jacobian)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (4, 1, 1), explain


# 14 ----------------------------------------------------------------- a tf.function inside the step
@tf.function
def l2_penalty(w):
    return 0.01 * tf.reduce_sum(w * w)


def prog_tf_function_inside(Tape, steps=6):
    model, opt = mlp(21), keras.optimizers.SGD(0.05)
    X, Y = data(steps)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            loss = tf.reduce_mean((model(X[i]) - Y[i]) ** 2) + l2_penalty(model.trainable_variables[0])
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return losses, weights(model, opt)


def test_tf_function_inside_step_coexecutes():
    # the tf.function call is one coarse unit: skipped as a whole, its forward/backward
    # functions replayed in the generated graph
    stats, explain = run_both(prog_tf_function_inside)
    assert_coexecuted(stats, explain)
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 0), explain
    assert "coexecution" in explain.splitlines()[-1], explain
