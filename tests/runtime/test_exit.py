"""Terra's threads end before the interpreter finalizes: a program that leaves an iteration's
graph run in flight (no `terra.end_iteration()`) exits cleanly, with no worker thread left."""
import subprocess
import sys
import textwrap

_PROGRAM = textwrap.dedent("""
    import atexit, os, threading
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    # registered before Terra's own handler, so it runs after it (atexit is last in, first out)
    atexit.register(lambda: print("left:", sorted(t.name for t in threading.enumerate()
                                                  if t is not threading.main_thread())))
    import tensorflow as tf, terra
    w = tf.Variable(tf.ones([64, 64]))
    x = tf.random.stateless_normal([64, 64], seed=[1, 2])
    for i in range(12):
        with tf.TerraGradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.matmul(x, w), w))
        w.assign_sub(1e-6 * tape.gradient(loss, w))
    print("overlapped:", terra.stats()["overlapped_iterations"] > 0)
""")


def test_exit_with_a_run_in_flight_is_clean():
    p = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "overlapped: True" in p.stdout, p.stdout
    assert "left: []" in p.stdout, p.stdout
