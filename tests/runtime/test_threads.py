"""Training loops on two threads: Terra co-executes one thread at a time (the first to enter a
Terra tape), the other thread's Terra tapes are plain tapes, and both equal eager. Before, one
thread's tape enter finished the other's iteration: an IndexError, an internal error, or a
segmentation fault."""
import os
import subprocess
import sys
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402

_PROGRAM = r"""
import os, sys, threading, warnings
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import numpy as np, tensorflow as tf, keras, terra
Tape = tf.TerraGradientTape if sys.argv[1] == "terra" else tf.GradientTape

def make(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1)])
    rng = np.random.default_rng(seed)
    data = [(rng.normal(size=(4, 6)).astype("float32"), rng.normal(size=(4, 1)).astype("float32"))
            for _ in range(30)]
    return model, keras.optimizers.Adam(1e-2), data

def train(model, opt, data, out):
    losses = []
    for x, y in data:
        with Tape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    # neither thread ends before both trained: otherwise the co-executed thread may finish and
    # exit while the other still trains, which then takes over (test below) and the counts
    # would depend on which thread was faster
    done.wait()
    terra.end_iteration()
    out.append(losses + [float(v.numpy().sum()) for v in model.weights] + [int(opt.iterations)])

done = threading.Barrier(2)
jobs, outs = [make(1), make(2)], [[], []]
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ts = [threading.Thread(target=train, args=(*jobs[k], outs[k])) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
for out in outs:
    print(repr(out[0]))
s = terra.stats()
print("counts", s["traces"], s["fallbacks"], s["graph_builds"], file=sys.stderr)
print("warned", sum("Terra co-executes one thread at a time" in str(x.message) for x in w),
      file=sys.stderr)
"""


def _run(mode):
    p = subprocess.run([sys.executable, "-c", _PROGRAM, mode], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, f"{mode} exited with {p.returncode}:\n{p.stderr[-3000:]}"
    return p.stdout, p.stderr


def test_two_threads_training_side_by_side_equal_eager():
    eager, _ = _run("eager")
    got, err = _run("terra")
    assert got == eager and got.count("\n") == 2
    # one thread co-executed (30 steps: two traces, a build, then the graph), the other warned
    assert "counts 3 0 1" in err and "warned 1" in err, err


@pytest.fixture()
def fresh():
    terra.reset()
    yield
    terra.reset()


def _loop(Tape, seed, steps, out, end=True):
    keras.utils.set_random_seed(seed)
    w = tf.Variable(tf.random.normal((3, 1)))
    x = tf.random.normal((4, 3))
    opt = keras.optimizers.SGD(0.1)
    losses = []
    for _ in range(steps):
        with Tape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        losses.append(float(loss))
    if end:
        terra.end_iteration()
    out.append((losses, w.numpy()))


def _threaded(Tape, seed, steps, end):
    out = []
    t = threading.Thread(target=_loop, args=(Tape, seed, steps, out, end))
    t.start()
    t.join()
    return out[0]


def test_an_exited_threads_session_passes_to_the_next_thread(fresh):
    """A worker thread trains and exits with its last iteration open; the next thread's tapes
    are co-executed (the first iteration is finished on its behalf), not left eager."""
    eager = [_threaded(tf.GradientTape, s, 6, end=False) for s in (1, 2)]
    first = _threaded(tf.TerraGradientTape, 1, 6, end=False)
    assert terra.stats()["graph_builds"] == 1
    second = _threaded(tf.TerraGradientTape, 2, 6, end=True)
    for got, want in zip((first, second), eager):
        assert got[0] == want[0]
        np.testing.assert_array_equal(got[1], want[1])
    s = terra.stats()
    # the same site, co-executed on both threads: the second thread's new variable is a fallback
    # and a new path (paths keep variables by identity), then its graph runs
    assert "run as plain tapes" not in terra.explain(), terra.explain()
    # the second thread's model is new: its first iteration falls back at its variable and
    # is a path that runs the first one's graph over its variables; that path recorded the
    # update's ops one by one (no unit), and later iterations match them so
    assert (s["traces"], s["fallbacks"], s["graph_builds"], s["graph_reuses"]) == (4, 1, 1, 1), \
        terra.explain()
    assert terra.explain().rstrip().endswith("coexecution")


def test_end_iteration_on_another_thread_leaves_the_running_one_alone(fresh):
    w = tf.Variable(2.0)
    for _ in range(4):
        with tf.TerraGradientTape() as tape:
            loss = w * w
        w.assign_sub(0.1 * tape.gradient(loss, w))
    it = terra._SESSION.iteration
    t = threading.Thread(target=terra.end_iteration)
    t.start()
    t.join()
    assert terra._SESSION.iteration is it and it is not None
    terra.end_iteration()
    assert terra._SESSION.iteration is None


def test_a_layer_call_after_the_owner_exited_runs_plain(fresh):
    """A Keras layer called outside any tape once the owning thread has exited with its last
    iteration open: that iteration is finished, and the call runs as plain Keras."""
    keras.utils.set_random_seed(3)
    layer = keras.layers.Dense(2)
    x = tf.random.normal((3, 4))
    want = layer(x).numpy()
    _threaded(tf.TerraGradientTape, 1, 4, end=False)
    assert terra._SESSION.iteration is not None
    np.testing.assert_array_equal(layer(x).numpy(), want)
    assert terra._SESSION.iteration is None and terra._SESSION.owner is None
