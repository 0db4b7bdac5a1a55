"""An op error inside the program's own `try`/`except` is raised inside that `try`, at the step
it belongs to, as in eager: the ops that may raise for a value are sync points there
(`PathView.barriers`), so the `except` sees the error and the loop goes on. Each program runs
eagerly and under Terra; losses, variables, optimizer iterations and the caught errors (type and
step) must be equal."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.tracing.locations import except_regions  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh():
    terra.reset()
    old = terra.config(timeout_s=30.0)
    yield
    terra.reset()
    terra.config(**old)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                             keras.layers.Dense(3)])


_TABLE = tf.constant([1.0, 2.0, 3.0])


def _labels(step, bad):
    return tf.constant(np.full(16, 7 if step in bad else step % 3), dtype=tf.int32)


def _forward_in_try(Tape, steps=40, bad=(25,)):
    model, opt = _model(), keras.optimizers.SGD(0.01)
    x = tf.random.stateless_normal((16, 4), seed=(1, 2))
    caught, losses, after = [], [], []
    for step in range(steps):
        y = _labels(step, bad)
        with Tape() as tape:
            try:
                loss = tf.reduce_mean(tf.gather(_TABLE, y)) * tf.reduce_mean(model(x))
                after.append(step)  # Python after the failing op, inside the try
            except tf.errors.InvalidArgumentError as e:
                caught.append((step, type(e).__name__))
                loss = tf.reduce_mean(model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return caught, after, losses, int(opt.iterations), [v.numpy() for v in model.weights]


def _assert_equal(eager, got):
    *head, weights = eager
    *ghead, gweights = got
    assert ghead == head, terra.explain()
    for a, b in zip(weights, gweights):
        np.testing.assert_array_equal(b, a)


def test_an_error_in_a_try_around_the_forward_is_caught_there():
    eager = _forward_in_try(tf.GradientTape)
    assert eager[0] == [(25, "InvalidArgumentError")]
    with CompileCounter() as c:
        got = _forward_in_try(tf.TerraGradientTape)
    _assert_equal(eager, got)
    # the gather is read (a sync point) at step 3, which falls back and rebuilds its path to
    # fetch it; the failing step falls back and goes on traced through the `except` (a new
    # path, built)
    c.assert_counts(traces=5, graph_builds=3, fallbacks=2)


def test_errors_at_several_steps_each_land_on_their_own_step():
    eager = _forward_in_try(tf.GradientTape, steps=30, bad=(9, 10, 21))
    assert [s for s, _ in eager[0]] == [9, 10, 21]
    got = _forward_in_try(tf.TerraGradientTape, steps=30, bad=(9, 10, 21))
    _assert_equal(eager, got)


def _uses_values_from_before(Tape, steps=30, bad=(11, 23)):
    model, opt = _model(), keras.optimizers.SGD(0.01)
    x = tf.random.stateless_normal((16, 4), seed=(1, 2))
    caught, losses = [], []
    for step in range(steps):
        y = _labels(step, bad)
        with Tape() as tape:
            logits = model(x)
            try:
                loss = tf.reduce_mean(tf.gather(_TABLE, y)) * tf.reduce_mean(logits)
            except tf.errors.InvalidArgumentError as e:
                caught.append((step, type(e).__name__))
                loss = tf.reduce_mean(logits ** 2)  # made before the op that failed
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return caught, losses, int(opt.iterations), [v.numpy() for v in model.weights]


def test_the_except_clause_uses_values_made_before_the_failing_op():
    eager = _uses_values_from_before(tf.GradientTape)
    assert [s for s, _ in eager[0]] == [11, 23]
    got = _uses_values_from_before(tf.TerraGradientTape)
    _assert_equal(eager, got)


def _step_in_try(Tape, steps=30, bad=(12,)):
    """A try around the whole step (outside the tape): no sync point is added."""
    model, opt = _model(), keras.optimizers.SGD(0.01)
    x = tf.random.stateless_normal((16, 4), seed=(1, 2))
    caught = []
    for step in range(steps):
        y = _labels(step, bad)
        try:
            with Tape() as tape:
                loss = tf.reduce_mean(tf.gather(_TABLE, y)) * tf.reduce_mean(model(x))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
        except tf.errors.InvalidArgumentError as e:
            caught.append((step, type(e).__name__))
    return caught, int(opt.iterations), [v.numpy() for v in model.weights]


def test_a_try_around_the_whole_step_adds_no_sync_point():
    eager = _step_in_try(tf.GradientTape)
    with CompileCounter() as c:
        got = _step_in_try(tf.TerraGradientTape)
    _assert_equal(eager, got)
    # the failing step falls back at the next op; its error leaves the tape's block (an
    # iteration with no op of its own after the failed one: not filed, counted as a trace)
    c.assert_counts(traces=4, graph_builds=1, fallbacks=1)


def _caught_at_a_new_batch_size(Tape, steps=8, bad=4):
    """Batches of 1 and 2 rows; the first batch of 2 fails inside the tape (a column out of
    range) and the program skips that step; the next batch of 2 does not fail."""
    keras.utils.set_random_seed(0)
    model, opt = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]), \
        keras.optimizers.SGD(0.1)
    xs = np.random.default_rng(0).normal(size=(steps, 2, 4)).astype("float32")
    caught, losses = [], []
    for step in range(steps):
        x = tf.constant(xs[step][:[1, 1, 1, 1, 2, 2, 1, 2][step]])
        try:
            with Tape() as tape:
                out = model(x)
                col = 5 if step == bad else 0
                loss = tf.reduce_mean(out ** 2) + tf.reduce_sum(tf.gather(out, [col], axis=1))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        except tf.errors.InvalidArgumentError as e:
            caught.append((step, type(e).__name__))
    return caught, losses, int(opt.iterations), [v.numpy() for v in model.weights]


def test_a_path_that_ended_at_a_caught_error_is_traced_on_inside_the_tape():
    """The step that failed was traced up to the failing op: its path ends there, inside the
    tape's block. The next step of that batch size goes past that end while its tape is still
    open, so the program is inside its step, not past the loop: it falls back and is traced on
    (it used to end the iteration there and run the rest eagerly, off the tape: "No gradients
    provided for any variable")."""
    eager = _caught_at_a_new_batch_size(tf.GradientTape)
    assert eager[0] == [(4, "InvalidArgumentError")]
    with CompileCounter() as c:
        got = _caught_at_a_new_batch_size(tf.TerraGradientTape)
    _assert_equal(eager, got)
    # steps 0-3: two paths traced, one built; step 4 falls back at its new batch size and is
    # traced to the failing op (built); step 5 falls back past that end and is traced whole
    # (a shape group with the batch of 1: built); steps 6 and 7 switch
    c.assert_counts(traces=5, graph_builds=3, fallbacks=2, path_switches=3)


def _caught_in_a_dataset_loop(Tape, steps=8, bad=3):
    """A loop over a tf.data dataset; from step `bad` on the step scales by another Python
    constant, and step `bad` fails inside the tape (a column out of range), skipped by the
    program. Its path ends at the failing op, followed only by the next batch's
    IteratorGetNext (a host op)."""
    keras.utils.set_random_seed(0)
    model, opt = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]), \
        keras.optimizers.SGD(0.1)
    rng = np.random.default_rng(0)
    ds = tf.data.Dataset.from_tensor_slices(rng.normal(size=(steps, 2, 4)).astype("float32"))
    caught, losses = [], []
    for step, x in enumerate(ds):
        try:
            with Tape() as tape:
                out = model(x) * (0.5 if step >= bad else 1.0)
                col = 5 if step == bad else 0
                loss = tf.reduce_mean(out ** 2) + tf.reduce_sum(tf.gather(out, [col], axis=1))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        except tf.errors.InvalidArgumentError as e:
            caught.append((step, type(e).__name__))
    return caught, losses, int(opt.iterations), [v.numpy() for v in model.weights]


def test_a_path_that_ended_at_a_caught_error_before_the_next_batch_is_traced_on():
    """Found by the fuzzer (seed 539). The next step of the failed step's constant switches to
    its path and reaches the op that failed there, where only the next batch's host op is left
    of the path: with its tape open, the program is inside its step, so it falls back and is
    traced on (it used to end the iteration there as at an epoch's end, and run the rest
    eagerly, off the tape: "No gradients provided for any variable")."""
    eager = _caught_in_a_dataset_loop(tf.GradientTape)
    assert eager[0] == [(3, "InvalidArgumentError")]
    with CompileCounter() as c:
        got = _caught_in_a_dataset_loop(tf.TerraGradientTape)
    _assert_equal(eager, got)
    # iterations 1-3: two paths traced, one built; 4 (step 3) falls back at the new constant
    # and is traced to the failing op (built); 5 takes that path and falls back where the op
    # failed, traced whole (the constant made a feed: built); 6 falls back once more at the
    # gradient and its path is built; 7 and 8 run compiled
    c.assert_counts(traces=6, graph_builds=4, fallbacks=3, path_switches=0)


def _first_call_offsets(fn):
    import dis
    return [(ins.positions.lineno - fn.__code__.co_firstlineno, ins.offset)
            for ins in dis.get_instructions(fn) if ins.opname == "CALL"]


def test_except_regions_follow_the_handler_chain():
    def f(g, Tape):
        with Tape():
            try:
                g(1)                  # +3: try/except
            except ValueError:
                pass
            try:
                g(2)                  # +7: try/finally only
            finally:
                pass
            try:
                try:
                    g(3)              # +12: finally inside except
                finally:
                    pass
            except Exception:
                pass
            try:
                g(4)                  # +18: bare except
            except:  # noqa: E722
                pass
        g(5)                          # +21: nothing
    calls = {}
    for line, offset in _first_call_offsets(f):
        calls.setdefault(line, offset)
    assert len(except_regions(f.__code__, calls[3])) == 1
    assert except_regions(f.__code__, calls[7]) == ()
    assert len(except_regions(f.__code__, calls[12])) == 1
    assert len(except_regions(f.__code__, calls[18])) == 1
    assert except_regions(f.__code__, calls[21]) == ()
    with_call = calls[1]  # Tape(): every region found starts after it (inside the with)
    assert all(s > with_call for k in (3, 12, 18) for s in except_regions(f.__code__, calls[k]))


def _end_syncs():
    return sorted({p.view.end_sync for site in terra._SESSION.sites.values()
                   for p in site.paths.values() if p.view is not None})


def test_only_a_try_entered_every_step_makes_the_run_end_inside_it():
    """A `try` around one step: each iteration's run ends at its last op (inside the `try`); a
    `try` around the whole loop (a Ctrl-C handler, say) keeps iterations in flight."""
    model, opt = _model(), keras.optimizers.SGD(0.01)
    x = tf.random.stateless_normal((16, 4), seed=(1, 2))

    def step(y):
        with tf.TerraGradientTape() as tape:
            loss = tf.reduce_mean(tf.gather(_TABLE, y)) * tf.reduce_mean(model(x))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                model.trainable_variables))

    try:
        for s in range(6):
            step(_labels(s, ()))
    except KeyboardInterrupt:  # pragma: no cover - not raised
        pass
    terra.end_iteration()
    assert _end_syncs() == [False]
    terra.reset()
    for s in range(6):
        try:
            step(_labels(s, ()))
        except tf.errors.InvalidArgumentError:  # pragma: no cover - not raised
            pass
    terra.end_iteration()
    assert _end_syncs() == [True]
