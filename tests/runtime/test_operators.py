"""Arithmetic on skipped placeholders: `x * 0.5`, `1.0 - x`, `x / 3`, `x ** 2`, `2.0 ** x` on a
float placeholder go straight to their op (python_runner `_OPERATORS`), not through TF's
operator layers, and an op eager sent to its slow route only because a Python number met a
recording tape is matched once, on its fast route (`_skip`). Equal to eager bit for bit, with
exact counts; in compiled iterations every op reaches skip mode once, on its fast route, and no
number is converted by TF's operator code on the way."""
import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from terra.runtime import python_runner  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def _program(Tape, steps=8, change_at=None):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(size=(3, 3)).astype(np.float32))
    b = tf.constant(rng.normal(size=(3,)).astype(np.float32))
    xs = [tf.constant(rng.normal(size=(4, 3)).astype(np.float32)) for _ in range(steps)]
    opt = keras.optimizers.SGD(0.05)
    losses = []
    for i, x in enumerate(xs):
        scale = 0.25 if i == change_at else 0.5   # a Python number the program changes once
        with Tape() as tape:
            h = tf.matmul(x, w)
            h = h * scale + 1           # __mul__ (a float), __add__ (an int)
            h = 2.0 * h - 0.5           # __rmul__, __sub__
            h = 1.0 - h / 3             # __truediv__ (an int), __rsub__
            h = h ** 2 + 0.1 * (h + h)  # __pow__, a placeholder on both sides
            h = 1.5 / (h * h + 2.0) - b  # __rtruediv__, an eager tensor of the same dtype
            loss = tf.reduce_mean(h) + 2.0 ** tf.reduce_mean(x)  # __rpow__
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        losses.append(float(loss))
    return losses, w.numpy()


def _same(got, want):
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])


class _Arrivals:
    """Each op skip mode sees in compiled iterations (route, op type), and each number TF's
    operator code converts to a tensor on the way there."""

    def __init__(self, monkeypatch):
        self.ops, self.converted = [], []
        skip, converted = python_runner.PythonRunner._skip, python_runner.PythonRunner.converted

        def _skip(runner, op_type, inputs, attrs, route):
            self.ops.append((route, op_type))
            return skip(runner, op_type, inputs, attrs, route)

        def _converted(runner, value, dtype, tensor):
            if runner.skipping:
                self.converted.append(value)
            return converted(runner, value, dtype, tensor)
        monkeypatch.setattr(python_runner.PythonRunner, "_skip", _skip)
        monkeypatch.setattr(python_runner.PythonRunner, "converted", _converted)


def test_operators_on_placeholders_match_their_op_once_on_the_fast_route(monkeypatch):
    eager = _program(tf.GradientTape)
    seen = _Arrivals(monkeypatch)
    with CompileCounter() as c:
        got = _program(tf.TerraGradientTape)
    _same(got, eager)
    c.assert_counts(traces=3, fallbacks=0, graph_builds=1, iterations=8)
    # p0 makes the optimizer's state; p1, seen twice, is built; iterations 4-8 run compiled:
    # 20 ops each (the optimizer's update is one unit), and the read of `w` that ends the last.
    # Through TF's operators a number would be converted first (`+ 1`, `2.0 *`, `/ 3`, ...),
    # and `h * scale`, `- 0.5` and `** 2` under the tape would each come twice, the second
    # time on their slow route
    assert len(seen.ops) == 5 * 20 + 1, seen.ops
    assert all(route == "fast" for route, _ in seen.ops), seen.ops
    assert [v for v in seen.converted if isinstance(v, (int, float))] == []
    per_iteration = collections.Counter(op for _, op in seen.ops[:20])
    assert per_iteration == {"Mul": 4, "AddV2": 5, "Sub": 3, "RealDiv": 2, "Pow": 2, "Mean": 2,
                             "ReadVariableOp": 1, "MatMul": 1}, per_iteration


def test_a_changed_number_falls_back_at_its_operator_and_equals_eager():
    eager = _program(tf.GradientTape, change_at=5)
    with CompileCounter() as c:
        got = _program(tf.TerraGradientTape, change_at=5)
    _same(got, eager)
    # iteration 6 diverges at `h * scale` (0.25, traced as 0.5): a fallback there, whose trace
    # differs from p1's only in that constant, which then becomes a feed of one graph for both
    c.assert_counts(traces=4, fallbacks=1, graph_builds=2, iterations=8)


@pytest.mark.parametrize("operand", ["int_tensor", "numpy", "float64_tensor"])
def test_operands_the_shortcut_leaves_to_tf_behave_as_in_eager(operand):
    """An integer placeholder, a NumPy operand, or a tensor of another dtype take TF's operator:
    the same values, and the same error where eager raises one."""
    def run(Tape, out=None):
        w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
        out = [] if out is None else out
        for i in range(5):
            with Tape() as tape:
                h = tf.matmul(tf.ones((2, 2)), w)
                if operand == "int_tensor":
                    k = tf.cast(h, tf.int32) * 3 + 1  # integer placeholders: TF's operators
                    h = h + tf.cast(k // 2, tf.float32)
                elif operand == "numpy":
                    h = h * np.float32(0.5) + np.ones((2, 2), np.float32)
                elif i == 3:  # compiled by now: eager raises here, and so must Terra
                    h = h * tf.constant(2.0, tf.float64)
                else:
                    h = h * tf.constant(2.0, tf.float32)
                loss = tf.reduce_sum(h)
            w.assign_sub(0.01 * tape.gradient(loss, w))
            out.append(float(loss))
        return out, w.numpy()

    if operand == "float64_tensor":
        kept = {}
        for Tape in (tf.GradientTape, tf.TerraGradientTape):
            out = kept[Tape] = []
            with pytest.raises(tf.errors.InvalidArgumentError) as e:
                run(Tape, out)
            assert "test_operators.py" in "".join(__import__("traceback").format_tb(e.tb))
        assert kept[tf.TerraGradientTape] == kept[tf.GradientTape] and \
            len(kept[tf.GradientTape]) == 3
        return
    eager = run(tf.GradientTape)
    with CompileCounter() as c:
        got = run(tf.TerraGradientTape)
    _same(got, eager)
    c.assert_counts(traces=2, fallbacks=0, graph_builds=1)


def test_the_operator_table_names_ops_tf_has():
    for method, (op_type, _) in python_runner._OPERATORS.items():
        assert hasattr(tf.Tensor, method) and hasattr(tf.raw_ops, op_type), method
