"""A program's call of a composite TF API function is one coarse unit (terra/runtime/units.py
`api_call`, `_tf_private.API_UNIT_FUNCTIONS` and `API_UNIT_METHODS`).

`tf.nn.sparse_softmax_cross_entropy_with_logits` and its kin are TF Python around one kernel
(shape checks, reshapes, masking: up to fifteen ops). Called by the program under a tape, each
call is recorded as a unit and skipped whole in later iterations: its Python does not run; so
is indexing a tensor (`x[:, 1:]`), except the slice of the next batch in an iteration's tail,
which stays an eager twin. A
call whose guard fails (another plain argument) runs its ops one by one; inside a Keras loss
object the call belongs to the loss's unit. Every program equals eager bit for bit, and an op
error inside a skipped unit is eager's exception at the user's line."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.ops import nn_impl, nn_ops  # noqa: E402

import terra  # noqa: E402
from terra import _tf_private as tfp  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def _body_counter(monkeypatch, module, name):
    """Count the Python runs of a TF function's body (the public function calls it)."""
    runs = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        runs.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return runs


def _detector(Tape, steps=8, axis_at=None, name_at=None):
    """Objectness by sigmoid cross-entropy and classes by sparse softmax cross-entropy, over a
    small dense head; from step `axis_at` on the class loss is a dense softmax cross-entropy
    over the batch axis (another function, other ops); from step `name_at` on the objectness
    call is given a name (another plain argument, the same ops: eager ignores names)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(5)])
    opt = keras.optimizers.Adam(0.01)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4, 6)), tf.float32)
    obj = tf.constant(rng.integers(0, 2, (4,)), tf.float32)
    cls = tf.constant(rng.integers(0, 4, (4,)), tf.int32)
    onehot = tf.one_hot(cls, 4)
    losses = []
    for i in range(steps):
        with Tape() as tape:
            out = model(x)
            if name_at is not None and i >= name_at:
                o = tf.nn.sigmoid_cross_entropy_with_logits(labels=obj, logits=out[:, 0],
                                                            name="objectness")
            else:
                o = tf.nn.sigmoid_cross_entropy_with_logits(labels=obj, logits=out[:, 0])
            if axis_at is not None and i >= axis_at:
                c = tf.nn.softmax_cross_entropy_with_logits(onehot, out[:, 1:], axis=0)
            else:
                c = tf.nn.sparse_softmax_cross_entropy_with_logits(cls, out[:, 1:])
            loss = tf.reduce_mean(o + c)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    terra.end_iteration()
    return losses, [v.numpy() for v in model.weights + opt.variables]


def _assert_same(got, eager):
    assert got[0] == eager[0]
    for a, b in zip(got[1], eager[1], strict=True):
        np.testing.assert_array_equal(a, b)


def _api_units():
    return sorted(u.guard[0].__name__ for s in SESSION.sites.values() for p in s.paths.values()
                  for u in p.units.values() if callable(u.guard[0]))


def test_cross_entropies_called_by_the_program_are_skipped_whole(monkeypatch):
    eager = _detector(tf.GradientTape)
    sig = _body_counter(monkeypatch, nn_impl, "sigmoid_cross_entropy_with_logits")
    sparse = _body_counter(monkeypatch, nn_ops, "sparse_softmax_cross_entropy_with_logits")
    with CompileCounter() as c:
        got = _detector(tf.TerraGradientTape)
    _assert_same(got, eager)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # their Python ran in the three traced steps only
    assert (len(sig), len(sparse)) == (3, 3)
    assert _api_units().count("sigmoid_cross_entropy_with_logits_v2") == 2
    assert _api_units().count("_slice_helper") == 4  # `out[:, 0]`, `out[:, 1:]`, two paths


def test_without_api_units_their_ops_are_matched_one_by_one(monkeypatch):
    eager = _detector(tf.GradientTape)
    sig = _body_counter(monkeypatch, nn_impl, "sigmoid_cross_entropy_with_logits")
    old = terra.config(api_units=False)
    try:
        with CompileCounter() as c:
            got = _detector(tf.TerraGradientTape)
    finally:
        terra.config(**old)
    _assert_same(got, eager)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert len(sig) == 8 and _api_units() == []


def test_a_call_whose_plain_argument_changes_runs_its_ops_one_by_one(monkeypatch):
    eager = _detector(tf.GradientTape, steps=10, name_at=6)
    sig = _body_counter(monkeypatch, nn_impl, "sigmoid_cross_entropy_with_logits")
    with CompileCounter() as c:
        got = _detector(tf.TerraGradientTape, steps=10, name_at=6)
    _assert_same(got, eager)
    # from step 7 on the unit's guard fails (another name): its Python runs and its ops,
    # matched one by one, are the path's: no fallback
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert len(sig) == 3 + 4


def test_another_function_where_a_unit_stands_leaves_the_path():
    eager = _detector(tf.GradientTape, steps=10, axis_at=6)
    with CompileCounter() as c:
        got = _detector(tf.TerraGradientTape, steps=10, axis_at=6)
    _assert_same(got, eager)
    # step 7 calls the dense cross-entropy where the sparse one's unit stands: its ops,
    # matched one by one, leave the path at its first (one fallback); the new path is
    # built at once
    c.assert_counts(traces=4, graph_builds=2, fallbacks=1)


def _matched_one_by_one(monkeypatch):
    """Op types skip mode matches one by one (not inside a skipped unit)."""
    from terra.runtime.python_runner import PythonRunner
    seen = []
    original = PythonRunner.op

    def op(self, op_type, inputs, attrs, route, run):
        if self.skipping:
            seen.append(op_type)
        return original(self, op_type, inputs, attrs, route, run)
    monkeypatch.setattr(PythonRunner, "op", op)
    return seen


@pytest.mark.parametrize("api_units", [True, False])
def test_indexing_a_tensor_is_a_unit(monkeypatch, api_units):
    eager = _detector(tf.GradientTape)
    seen = _matched_one_by_one(monkeypatch)
    old = terra.config(api_units=api_units)
    try:
        with CompileCounter() as c:
            got = _detector(tf.TerraGradientTape)
    finally:
        terra.config(**old)
    _assert_same(got, eager)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    # `out[:, 0]` and `out[:, 1:]`: two slices per step, in the five skipped steps
    assert seen.count("StridedSlice") == (0 if api_units else 2 * 5)
    assert _api_units().count("_slice_helper") == (4 if api_units else 0)


def _tail_batches(Tape, lengths=(6, 6, 6, 6, 6, 6)):
    """The next batch sliced after the step's block (eager twins in skip mode)."""
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(3)
    opt = keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    full = [tf.constant(rng.normal(size=(2, n + 1, 4)), tf.float32) for n in lengths]
    x = full[0][:, :-1]
    losses = []
    for k in range(len(lengths)):
        with Tape() as tape:
            loss = tf.reduce_mean(dense(x) ** 2)
        grads = tape.gradient(loss, dense.trainable_variables)
        opt.apply_gradients(zip(grads, dense.trainable_variables))
        losses.append(float(loss))
        if k + 1 < len(lengths):
            x = full[k + 1][:, :-1]
    terra.end_iteration()
    return losses, [v.numpy() for v in dense.variables]


@pytest.mark.parametrize("api_units", [True, False])
def test_a_slice_of_the_next_batch_stays_an_eager_twin(api_units):
    eager = _tail_batches(tf.GradientTape)
    old = terra.config(api_units=api_units)
    try:
        with CompileCounter() as c:
            got = _tail_batches(tf.TerraGradientTape)
    finally:
        terra.config(**old)
    _assert_same(got, eager)
    # the slice of the next batch runs eagerly beside the graph in the tail of the skipped
    # iterations 4 and 5 (the last one has none), with API units as without
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0, eager_twins=2)


def test_an_index_of_a_value_of_data_dependent_length_is_matched_one_by_one():
    """`tf.where(m)[:, 0]`: skipped whole, the slice would wait for the mask's count to check
    its input's shape; matched one by one, its placeholder takes the graph's unknown length."""
    def run(Tape):
        v = tf.Variable(tf.ones((6,)))
        opt = keras.optimizers.SGD(0.1)
        rng = np.random.default_rng(0)
        data = [tf.constant(rng.normal(size=(6, 2)), tf.float32) for _ in range(3)]
        losses = []
        for i in range(9):
            y = data[i % 3]
            with Tape() as tape:
                idx = tf.where(y[:, 0] > 0.0)[:, 0]
                loss = tf.reduce_sum(tf.gather(v, idx) * tf.gather(y[:, 1], idx))
            opt.apply_gradients([(tape.gradient(loss, v), v)])
            losses.append(float(loss))
        terra.end_iteration()
        return losses, [v.numpy()]
    eager = run(tf.GradientTape)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape)
    _assert_same(got, eager)
    # counts 3 and 2 form the group, whose graph fetches the count Python read while traced
    # (learning it cost step 3 a fallback, a trace and a rebuild); from then on a step whose
    # count another member was traced with switches to it at the gradient unit (its input's
    # shape): no step reads the gradient's indices (the update does not, nor does Terra's own
    # flattening of the gradients: `units._flat_gradients` builds no TypeSpec)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, path_switches=3)
    # `y[:, 0]` and `y[:, 1]` are units on every path; `tf.where(...)[:, 0]` is not
    paths = sum(len(s.paths) for s in SESSION.sites.values())
    assert _api_units().count("_slice_helper") == 2 * paths


def test_inside_a_keras_loss_the_call_is_the_losss():
    def run(Tape):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        opt = keras.optimizers.SGD(0.1)
        x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3) / 10)
        y = tf.constant([0, 3, 1, 2])
        losses = []
        for _ in range(6):
            with Tape() as tape:
                loss = loss_fn(y, model(x))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                    model.trainable_variables))
            losses.append(float(loss))
        terra.end_iteration()
        return losses, [v.numpy() for v in model.weights]
    eager = run(tf.GradientTape)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape)
    _assert_same(got, eager)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)
    assert _api_units() == []


def test_an_op_error_inside_a_skipped_unit_is_eagers_at_the_users_line():
    """A label out of range reaches the graph inside a skipped cross-entropy: eager's
    exception type, naming the user's line; the steps before it are eager's."""
    def run(Tape, losses):
        v = tf.Variable(tf.ones((3, 4)))
        opt = keras.optimizers.SGD(0.1)
        x = tf.constant(np.eye(3, dtype=np.float32))
        good, bad = tf.constant([0, 1, 2]), tf.constant([0, 7, 2])
        for k in range(7):
            with Tape() as tape:
                logits = tf.matmul(x, v)
                ce = tf.nn.sparse_softmax_cross_entropy_with_logits(bad if k == 5 else good, logits)  # CE
                loss = tf.reduce_sum(ce)
            opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
            losses.append(float(loss))

    def outcome(Tape):
        terra.reset()
        losses = []
        with pytest.raises(tf.errors.InvalidArgumentError) as info:
            run(Tape, losses)
        return losses, info.value
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# CE"))
    eager_losses, _ = outcome(tf.GradientTape)
    got_losses, got_error = outcome(tf.TerraGradientTape)
    assert got_losses == eager_losses and len(eager_losses) == 5
    assert f"test_api_units.py:{line}" in str(got_error)
    stats = terra.stats()
    # the error's iteration falls back, as every failed run does
    assert (stats["traces"], stats["graph_builds"], stats["fallbacks"]) == (3, 1, 1)
    assert _api_units() == ["sparse_softmax_cross_entropy_with_logits_v2"] * 2


def test_the_functions_are_where_the_hook_patches_them():
    """Fails loudly when TF moves one of them out of its public module."""
    assert [name for _, name in tfp.api_unit_functions()] == \
        [name for _, name in tfp.API_UNIT_FUNCTIONS]
    for owner, name in tfp.api_unit_functions():
        assert owner is getattr(tf, "nn") and callable(getattr(owner, name))
    assert [name for _, name in tfp.api_unit_methods()] == list(tfp.API_UNIT_METHODS)
    for owner, name in tfp.api_unit_methods():
        method = owner.__dict__[name]
        assert getattr(method, "__wrapped__", method).__name__ == "_slice_helper"
