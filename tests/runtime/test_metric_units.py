"""A built-in Keras averaging metric's `update_state` (`Mean`, `Sum` and every
`MeanMetricWrapper`: accuracies, errors) is one coarse unit (terra/runtime/units.py, rule
"metric"), guarded on the metric, its plain settings and its function's keyword arguments, and
on its inputs' producers; its state is its variables. Each program runs eagerly and under Terra:
same losses, metric results and variables, bit for bit."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra import _tf_private as tfp  # noqa: E402
from terra.ir.records import VariableRef  # noqa: E402
from terra.tracing import hook  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(timeout_s=30.0)
    yield
    terra.reset()
    terra.config(**old)


class DoubledAccuracy(keras.metrics.SparseCategoricalAccuracy):
    """A user's metric: its own `update_state` (Python Terra does not see into) calls the
    built-in one."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(y_true, 2.0 * y_pred, sample_weight)


def train(Tape, steps=12, epoch=4, metric=None, change=None, weighted=False, keep=None,
          anew=False):
    """The loop of Keras' "training loop from scratch" guide: a metric updated every step, its
    result read and reset every epoch, and a `Mean` of the loss."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3)])
    opt = keras.optimizers.SGD(0.1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    acc = metric() if metric is not None else keras.metrics.SparseCategoricalAccuracy()
    mean = keras.metrics.Mean()
    if keep is not None:
        keep += [acc, mean]
    rng = np.random.default_rng(4)
    xs = rng.normal(size=(steps, 16, 6)).astype(np.float32)
    ys = rng.integers(0, 3, size=(steps, 16)).astype(np.int64)
    ws = rng.uniform(size=(steps, 16)).astype(np.float32)
    losses, results = [], []
    for i in range(steps):
        if anew and i % epoch == 0:  # new metrics every epoch, as many programs make them
            acc, mean = type(acc)(), keras.metrics.Mean()
            if keep is not None:
                keep += [acc, mean]
        if change is not None:
            change(acc, i)
        x, y = tf.constant(xs[i]), tf.constant(ys[i])
        with Tape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        if weighted:
            acc.update_state(y, logits, sample_weight=tf.constant(ws[i]))
        else:
            acc.update_state(y, logits)
        mean.update_state(loss)
        losses.append(float(loss))
        if (i + 1) % epoch == 0:
            results.append((float(acc.result()), float(mean.result())))
            acc.reset_state()
            mean.reset_state()
    return losses, results, [v.numpy().tolist() for v in
                             (*model.variables, *acc.variables, *mean.variables)]


def both(keep=None, **kw):
    eager = train(tf.GradientTape, **kw)
    with CompileCounter() as c:
        got = train(tf.TerraGradientTape, keep=keep, **kw)
    assert got == eager, terra.explain()
    return c


def metric_units(metrics):
    """(metric's index in `metrics`, ops) of each unit of the compiled paths that is a call of
    one of `metrics` (its guard names the metric's variables)."""
    keys = {id(v.value.handle): k for k, m in enumerate(metrics) for v in m.variables}
    out = set()
    for p in (p for s in terra._SESSION.sites.values() for p in s.paths.values()):
        if p.graph is None:
            continue
        for u in p.units.values():
            owners = {keys[g.key] for g in u.guard[2:] if isinstance(g, VariableRef) and
                      g.key in keys}
            out |= {(k, u.end - u.start) for k in owners}
    return sorted(out)


def counting_matches(monkeypatch):
    from terra.runtime.python_runner import PythonRunner
    matched = []
    original = PythonRunner._skip

    def counting(self, *args, **kwargs):
        matched.append((self.iteration.number, args[0]))
        return original(self, *args, **kwargs)
    monkeypatch.setattr(PythonRunner, "_skip", counting)
    return matched


def test_metric_updates_are_units_and_their_results_equal_eager(monkeypatch):
    matched = counting_matches(monkeypatch)
    metrics = []
    c = both(keep=metrics)
    # the epochs' result reads and resets come after the path's last op: eager, no fallback
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # the accuracy's update (21 ops) and the mean's (9), each one unit
    assert metric_units(metrics) == [(0, 21), (1, 9)]
    # compiled iterations match no op one by one but the epochs' reads past the path's end
    assert {op for n, op in matched} == {"ReadVariableOp"}, matched
    assert {n for n, op in matched} == {4, 8, 12}, matched


def test_metrics_made_anew_every_epoch_are_units_of_the_renamed_path(monkeypatch):
    """A first tape before the loop files variable roles (roles.py): the next epochs' metrics
    are made in the same place as the first's, so their steps are predicted on the first
    epoch's graph over their variables, and the metrics' guards (their class, settings and
    variables) hold for the new objects."""
    def first_tape(Tape):  # a site of its own, in a frame that returns
        with Tape():
            tf.constant(0.0)

    def program(Tape, **kw):
        first_tape(Tape)
        return train(Tape, **kw)
    eager = program(tf.GradientTape, anew=True)
    matched, metrics = counting_matches(monkeypatch), []
    with CompileCounter() as c:
        got = program(tf.TerraGradientTape, anew=True, keep=metrics)
    assert got == eager, terra.explain()
    c.assert_counts(traces=4, graph_builds=1, fallbacks=0, role_renames=2)
    # (0 and 1: the pair `train` makes before its loop, unused here) each epoch's accuracy
    # and mean are units of their own epoch's path
    assert metric_units(metrics) == [(2, 21), (3, 9), (4, 21), (5, 9), (6, 21), (7, 9)]
    assert {op for n, op in matched} == {"ReadVariableOp"}, matched


def test_a_sample_weight_is_guarded_like_any_input():
    both(weighted=True).assert_counts(traces=3, graph_builds=1, fallbacks=0)


def test_changing_a_metrics_keyword_argument_is_not_skipped():
    def change(acc, i):
        if i == 6:
            acc._fn_kwargs["k"] = 1
    metrics = []
    c = both(metric=lambda: keras.metrics.SparseTopKCategoricalAccuracy(k=2), change=change,
             keep=metrics)
    c.assert_counts(traces=4, graph_builds=2, fallbacks=1)


def test_a_users_metric_runs_its_own_update_state():
    metrics = []
    both(metric=DoubledAccuracy, keep=metrics).assert_counts(traces=3, graph_builds=1,
                                                             fallbacks=0)
    # its built-in `update_state`, called from its own, is matched op by op: only the Mean is
    # a unit
    assert [k for k, _ in metric_units(metrics)] == [1]


def test_the_metric_patches_are_keras_own_methods():
    """Fails loudly when Keras moves its averaging metrics: they would lose their units."""
    methods = tfp.keras_metric_unit_methods()
    assert [cls.__name__ for cls, _ in methods] == ["Mean", "Sum", "MeanMetricWrapper"]
    assert all(name == "update_state" and "update_state" in vars(cls) for cls, name in methods)
    assert set(methods) <= set(hook.patched_attributes())
    assert tfp.keras_metric_settings(keras.metrics.Mean()) is not None
    assert tfp.keras_metric_settings(DoubledAccuracy()) is None
