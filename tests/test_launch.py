"""`python -m terra train.py [args]` and `TERRA=1`: an unmodified program runs with Terra enabled,
with `python train.py`'s argv, `__main__`, `sys.path`, exit code and traceback."""
import os
import subprocess
import sys
import textwrap

import pytest

from terra import env_hook

PROGRAM = textwrap.dedent("""
    import os, sys
    import tensorflow as tf
    import helper  # found next to the script, as `python train.py` finds it
    print("argv", sys.argv[1:], "name", __name__, "tape", tf.GradientTape.__module__)
    if "--config" in sys.argv:
        import terra
        c = terra.config()
        print("config", c["coexecution"], c["max_traces"], c["verbose"], c["xla"])
    w = tf.Variable(1.0)
    for i in range(6):
        with tf.GradientTape() as tape:
            loss = (w * float(i)) ** 2
        w.assign_sub(0.01 * tape.gradient(loss, w))
    print("w", float(w.numpy()))
    if "--fail" in sys.argv:
        helper.boom()
    if "--exit" in sys.argv:
        sys.exit(3)
""")


KERAS_PROGRAM = textwrap.dedent("""
    import keras, numpy as np           # Keras imports TF: Terra is enabled inside that import
    import tensorflow as tf
    from terra import _tf_private as tfp
    fit = tfp.keras_trainer_class().fit
    print("fit wrapped", hasattr(fit, "__terra_original__"), "tape", tf.GradientTape.__module__)
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    m.compile(optimizer="adam", loss="mse", run_eagerly=True)
    x = np.linspace(0, 1, 128, dtype="float32").reshape(32, 4)
    m.fit(x, x[:, :3], batch_size=8, epochs=2, verbose=0)
    print("weights", m.weights[0].numpy().tobytes().hex())
""")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    d = tmp_path_factory.mktemp("prog")
    (d / "train.py").write_text(PROGRAM)
    (d / "kfit.py").write_text(KERAS_PROGRAM)
    (d / "helper.py").write_text("def boom():\n    raise ValueError('boom from helper')\n")
    return d


def _run(args, cwd, env=None):
    e = {k: v for k, v in os.environ.items() if k != "TERRA"}
    e.update(TF_CPP_MIN_LOG_LEVEL="3", **(env or {}))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=300)


def _traceback(stderr):
    return stderr[stderr.index("Traceback"):]


def test_script_runs_as_main_with_its_argv_and_stats(program, tmp_path):
    r = _run(["-m", "terra", "--stats", str(program / "train.py"), "a", "--b"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "argv ['a', '--b'] name __main__ tape terra.tape" in r.stdout
    plain = _run([str(program / "train.py"), "a", "--b"], cwd=tmp_path)
    w = [line for line in plain.stdout.splitlines() if line.startswith("w ")]
    assert w and w[0] in r.stdout.splitlines()  # same result as the plain run
    assert "tape tensorflow.python.eager.backprop" in plain.stdout
    # the summary: 6 iterations, p0 then p1 twice, built at the second
    assert "terra: 6 iterations at 1 site(s): 2 traces, 1 graph builds, 0 fallbacks" in r.stderr
    assert "site train.py:12: coexecution" in r.stderr


def test_exception_exit_code_and_traceback_are_pythons(program, tmp_path):
    r = _run(["-m", "terra", str(program / "train.py"), "--fail"], cwd=tmp_path)
    plain = _run([str(program / "train.py"), "--fail"], cwd=tmp_path)
    assert r.returncode == plain.returncode == 1
    assert _traceback(r.stderr) == _traceback(plain.stderr)
    assert "ValueError: boom from helper" in r.stderr
    r = _run(["-m", "terra", str(program / "train.py"), "--exit"], cwd=tmp_path)
    assert r.returncode == 3, r.stderr


@pytest.mark.slow  # several interpreter launches (~15 s): make test-slow
def test_options_become_terra_config_and_module_mode(program, tmp_path):
    r = _run(["-m", "terra", "--no-coexecution", "--max-traces", "3", "-vv",
              str(program / "train.py"), "--config"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "config False 3 2 False" in r.stdout
    assert "terra: [graph_build]" in r.stdout  # verbose 2 prints events
    r = _run(["-m", "terra", "-m", "train", "x"], cwd=program)
    assert r.returncode == 0, r.stderr
    assert "argv ['x'] name __main__ tape terra.tape" in r.stdout
    r = _run(["-m", "terra", "--max-traces", "zero", "train.py"], cwd=program)
    assert r.returncode == 2 and "invalid int value" in r.stderr
    r = _run(["-m", "terra", "missing.py"], cwd=program)
    assert r.returncode == 2 and "can't open file" in r.stderr


@pytest.mark.slow  # several interpreter launches (~15 s): make test-slow
def test_environment_hook_enables_terra_only_when_asked(program, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    pth = env_hook.install(str(site))
    assert os.path.basename(pth) == env_hook.PTH_NAME
    boot = textwrap.dedent(f"""
        import site, sys, runpy
        site.addsitedir({str(site)!r})
        print("at start-up", "tensorflow" in sys.modules, "terra" in sys.modules)
        sys.argv = [{str(program / 'train.py')!r}, "e"]
        sys.path.insert(0, {str(program)!r})
        runpy.run_path(sys.argv[0], run_name="__main__")
    """)
    on = _run(["-c", boot], cwd=tmp_path, env={"TERRA": "--stats"})
    assert on.returncode == 0, on.stderr
    assert "at start-up False False" in on.stdout  # TF is the program's to import, later
    assert "tape terra.tape" in on.stdout
    assert "terra: 6 iterations at 1 site(s)" in on.stderr
    off = _run(["-c", boot], cwd=tmp_path, env={"TERRA": "0"})
    assert off.returncode == 0, off.stderr
    assert "tape tensorflow.python.eager.backprop" in off.stdout
    boot_keras = boot.replace("train.py", "kfit.py")
    keras_on = _run(["-c", boot_keras], cwd=tmp_path, env={"TERRA": "--stats"})
    keras_plain = _run([str(program / "kfit.py")], cwd=tmp_path)
    assert keras_on.returncode == 0, keras_on.stderr
    assert "fit wrapped True tape terra.tape" in keras_on.stdout
    weights = [line for line in keras_plain.stdout.splitlines() if line.startswith("weights")]
    assert weights and weights[0] in keras_on.stdout.splitlines()  # eager's, bit for bit
    assert "terra: 8 iterations at 1 site(s)" in keras_on.stderr
    env_hook.uninstall(str(site))
    assert not os.path.exists(pth)


def test_environment_options_parse():
    assert env_hook.options("1") == []
    assert env_hook.options("--stats --max-traces 4") == ["--stats", "--max-traces", "4"]


def test_a_programs_own_option_that_abbreviates_several_of_terras_reaches_the_program():
    """`--s` would abbreviate `--stats`, `--site-graph`, `--shape-groups` and `--speculation`:
    after the script it is the program's, never an ambiguous option of the launcher's."""
    from terra.launch import parser
    a = parser().parse_args(["--stats", "train.py", "a", "--s", "--st"])
    assert a.stats and a.script == "train.py" and a.args == ["a", "--s", "--st"]
