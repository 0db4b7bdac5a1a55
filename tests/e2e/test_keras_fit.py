"""Keras `fit(..., run_eagerly=True)` under `terra.enable()`: Keras' TF trainer opens
`tf.GradientTape()` in `train_step`, so every batch is one Terra iteration. Losses, metrics,
the logs a callback reads every batch, and the final weights equal eager's, bit for bit (Dense
models: deterministic kernels), with exact trace / build / fallback counts."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import random  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.disable()
    terra.reset()
    yield
    terra.disable()
    terra.reset()


class PlainStep(keras.Model):
    """The custom `train_step` of Keras' guide."""

    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(16, activation="relu")
        self.d2 = keras.layers.Dense(4)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.acc = keras.metrics.SparseCategoricalAccuracy(name="acc")

    def call(self, x, training=False):
        return self.d2(self.d1(x))

    @property
    def metrics(self):
        return [self.loss_tracker, self.acc]

    def forward_loss(self, x, y):
        y_pred = self(x, training=True)
        return keras.losses.sparse_categorical_crossentropy(y, y_pred, from_logits=True), y_pred

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            per_example, y_pred = self.forward_loss(x, y)
            loss = tf.reduce_mean(per_example)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.acc.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        per_example, y_pred = self.forward_loss(x, y)
        self.loss_tracker.update_state(tf.reduce_mean(per_example))
        self.acc.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class PythonState(PlainStep):
    """Python state on `self` that `tf.function` would freeze: a step counter, a list of every
    step's loss read with `.numpy()`, and a loss weight that changes every third step."""

    def __init__(self):
        super().__init__()
        self.steps_seen = 0
        self.seen_losses = []

    def train_step(self, data):
        x, y = data
        self.steps_seen += 1
        weight = 2.0 if self.steps_seen % 3 == 0 else 1.0
        with tf.GradientTape() as tape:
            per_example, y_pred = self.forward_loss(x, y)
            loss = weight * tf.reduce_mean(per_example)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.acc.update_state(y, y_pred)
        self.seen_losses.append(self.loss_tracker.result().numpy())
        return {m.name: m.result() for m in self.metrics}


class RandomBranch(PlainStep):
    """A Python-random branch (seeded): an extra noise term on some batches."""

    def __init__(self):
        super().__init__()
        self.rng = random.Random(3)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            per_example, y_pred = self.forward_loss(x, y)
            loss = tf.reduce_mean(per_example)
            if self.rng.random() < 0.3:
                loss = loss + 0.01 * tf.add_n([tf.reduce_sum(tf.square(w))
                                               for w in self.trainable_variables])
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(loss)
        self.acc.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class LogReader(keras.callbacks.Callback):
    """Reads the logs every batch, as a user's logging callback does."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append({k: float(v) for k, v in sorted(logs.items())})


def _data(n=96):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 8)).astype(np.float32),
            rng.integers(0, 4, size=(n,)).astype(np.int32))


def _fit(cls, epochs=3, callbacks=(), verbose=0):
    keras.utils.set_random_seed(0)
    model = cls()
    model.compile(optimizer=keras.optimizers.Adam(0.01), run_eagerly=True)
    x, y = _data()
    history = model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=verbose,
                        callbacks=list(callbacks))
    return model, history.history


def _same(eager, got):
    (m0, h0), (m1, h1) = eager, got
    assert h1 == h0
    assert len(m1.weights) == len(m0.weights)
    for a, b in zip(m1.weights, m0.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def _terra_fit(cls, **kwargs):
    with terra.enable():
        assert tf.GradientTape is terra.GradientTape
        out = _fit(cls, **kwargs)
    assert tf.GradientTape is terra.tape.tf.GradientTape  # restored on the context's exit
    return out


@pytest.mark.parametrize("cls, counts", [
    # iteration 1 creates the optimizer's slots (not compilable), 2 and 3 file the step's path
    # and build it; each epoch's last batch ends its iteration where Keras makes the next
    # epoch's data iterator (AnonymousIteratorV3) in place of the next batch's IteratorGetNext,
    # the host op that ends the path: the graph has done its work (`path_view.host_tail`). (It
    # fell back there once per epoch: 6 traces, 3 fallbacks.)
    (PlainStep, (3, 1, 0)),
    (PythonState, (3, 1, 0)),
])
def test_fit_with_a_custom_train_step_equals_eager(cls, counts):
    eager = _fit(cls)
    got = _terra_fit(cls)
    _same(eager, got)
    s = terra.stats()
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == counts, terra.explain()
    if cls is PythonState:
        assert got[0].steps_seen == eager[0].steps_seen == 36
        np.testing.assert_array_equal(got[0].seen_losses, eager[0].seen_losses)


def test_fit_with_a_python_random_branch_equals_eager():
    eager = _fit(RandomBranch)
    got = _terra_fit(RandomBranch)
    _same(eager, got)
    s = terra.stats()
    # as above, plus the branch's path (a fallback at its first run, built then); later branch
    # changes switch between the two compiled paths at the first op where they differ
    assert (s["traces"], s["graph_builds"], s["fallbacks"], s["path_switches"]) == \
        (4, 2, 1, 7), terra.explain()


def test_a_callback_reading_the_logs_every_batch_sees_eagers_values():
    cb0, cb1 = LogReader(), LogReader()
    eager = _fit(PlainStep, callbacks=[cb0])
    got = _terra_fit(PlainStep, callbacks=[cb1])
    _same(eager, got)
    assert len(cb1.batches) == 36
    assert cb1.batches == cb0.batches
    s = terra.stats()
    assert (s["traces"], s["graph_builds"], s["fallbacks"]) == (3, 1, 0), terra.explain()


def test_validation_evaluate_and_predict_after_fit_equal_eager():
    """They open no tape: Terra leaves them to Keras (eager). `fit`'s validation and the calls
    after `fit` are outside every training iteration (Keras' entry points end it)."""
    x, y = _data(32)

    def run():
        model, history = _fit(PlainStep, epochs=2)
        keras.utils.set_random_seed(1)
        return (history, model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True),
                model.predict(x, batch_size=8, verbose=0), model)

    def run_with_validation():
        keras.utils.set_random_seed(0)
        model = PlainStep()
        model.compile(optimizer=keras.optimizers.Adam(0.01), run_eagerly=True)
        xt, yt = _data()
        h = model.fit(xt, yt, batch_size=8, epochs=2, shuffle=False, verbose=0,
                      validation_data=(x, y))
        return h.history, model

    h0, e0, p0, m0 = run()
    v0, mv0 = run_with_validation()
    terra.reset()
    with terra.enable():
        h1, e1, p1, m1 = run()
        s = terra.stats()
        v1, mv1 = run_with_validation()
    assert (h1, e1) == (h0, e0)
    np.testing.assert_array_equal(p1, p0)
    _same((m0, h0), (m1, h1))
    assert v1 == v0 and "val_loss" in v1
    _same((mv0, v0), (mv1, v1))
    # 24 training iterations; evaluate and predict ran none
    assert (s["iterations"], s["traces"], s["graph_builds"], s["fallbacks"]) == (24, 3, 1, 0), \
        terra.explain()
