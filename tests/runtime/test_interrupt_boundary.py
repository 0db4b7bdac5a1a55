"""Ctrl-C while Terra completes the step Python has left (at the next tape's `__enter__`): the
step completes, then KeyboardInterrupt is raised, so the weights are those of an eager run of
exactly `optimizer.iterations` steps. Before, the interrupt dropped the pending step's run:
`optimizer.iterations` one short, or weights of no eager step."""
import _thread
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.compiler.channels import wait_event, wait_until  # noqa: E402
from terra.runtime.interrupts import held_interrupts  # noqa: E402
from terra.runtime.iteration import Iteration  # noqa: E402

STEPS = 40


pytestmark = pytest.mark.usefixtures("fresh_terra", "python_sigint")


def _data():
    rng = np.random.default_rng(7)
    return [(rng.normal(size=(512, 256)).astype("float32"),
             rng.normal(size=(512, 1)).astype("float32")) for _ in range(STEPS)]


def _train(Tape, steps):
    """Train up to `steps` steps; a Ctrl-C ends the loop (a user's `except KeyboardInterrupt`)."""
    keras.utils.set_random_seed(11)
    # a graph step of tens of ms against a skeleton of a few: Python waits at the boundary
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-3)
    interrupted = False
    try:
        for x, y in _data()[:steps]:
            with Tape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
    except KeyboardInterrupt:
        interrupted = True
    terra.end_iteration()
    return interrupted, int(opt.iterations), [v.numpy() for v in model.weights]


def _interrupt_at_the_first_boundary_wait():
    """A profile function for the main thread that presses Ctrl-C the first time the thread
    enters a wait (`wait_until`, `wait_event`) inside `Iteration.finish` (the boundary). It sees
    the call itself, so the interrupt lands there however busy the machine is (a thread
    sampling the main thread's stack, as this test did before, can miss every such wait on a
    loaded machine, and then no Ctrl-C comes at all)."""
    waits = (wait_until.__code__, wait_event.__code__)
    finish = Iteration.finish.__code__
    state = {"depth": 0, "fired": False}

    def profile(frame, event, arg):
        code = frame.f_code
        if code is finish:
            state["depth"] += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and code in waits and state["depth"] > 0 and not state["fired"]:
            state["fired"] = True
            _thread.interrupt_main()
    return profile


def test_ctrl_c_while_the_left_step_completes_keeps_that_step():
    previous = sys.getprofile()
    sys.setprofile(_interrupt_at_the_first_boundary_wait())
    try:
        interrupted, done, weights = _train(tf.TerraGradientTape, STEPS)
    finally:
        sys.setprofile(previous)
    assert interrupted and 3 <= done < STEPS, (interrupted, done)
    _, eager_done, eager = _train(tf.GradientTape, done)
    assert eager_done == done
    for a, b in zip(weights, eager):
        np.testing.assert_array_equal(a, b)


def test_held_interrupts_raises_after_the_block_and_a_second_press_at_once():
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts() as held:
            _thread.interrupt_main()
            time.sleep(0.01)  # (a signal is handled between bytecodes)
            assert held.pressed
            finished = True
    assert finished
    with pytest.raises(KeyboardInterrupt):
        with held_interrupts():
            _thread.interrupt_main()
            time.sleep(0.01)
            _thread.interrupt_main()
            time.sleep(0.01)
            pytest.fail("the second press did not raise at once")
    import signal
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
