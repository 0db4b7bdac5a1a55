import numpy as np

from benchmarks import check


def test_compare_losses_reports_first_differing_step():
    ref = {0: 1.0, 1: 2.0, 2: 3.0}
    assert check.compare_losses(ref, dict(ref), 1e-5, 1e-6) is None
    r = check.compare_losses(ref, {0: 1.0, 1: 2.5, 2: 9.0}, 1e-5, 1e-6)
    assert r.startswith("loss differs at step 1: 2.5 vs eager 2")


def test_compare_losses_tolerates_rounding():
    assert check.compare_losses({0: 1.0}, {0: 1.0 + 1e-7}, 1e-5, 1e-6) is None


def test_compare_variables():
    a = [("w", np.ones((2, 2), np.float32)), ("step", np.array(3))]
    assert check.compare_variables(a, [(n, v.copy()) for n, v in a], 1e-5) is None
    b = [("w", np.full((2, 2), 1.1, np.float32)), ("step", np.array(3))]
    assert "relative L2 0.1" in check.compare_variables(a, b, 1e-5)
    assert "largest in w" in check.compare_variables(a, b, 1e-5)
    assert "step differs" in check.compare_variables(a, [a[0], ("step", np.array(4))], 1e-5)
    assert "shape" in check.compare_variables(a, [("w", np.ones(4, np.float32)), a[1]], 1e-5)
    assert "1 variables vs 2" in check.compare_variables(a, a[:1], 1e-5)


def test_variable_diff_is_global_and_nan_aware():
    ref = [("big", np.full(100, 10.0)), ("zero_grad_bias", np.zeros(2))]
    got = [("big", np.full(100, 10.0)), ("zero_grad_bias", np.array([1e-4, -1e-4]))]
    rel, (name, d) = check.variable_diff(ref, got)
    assert name == "zero_grad_bias" and d == 1e-4 and rel < 2e-6
    rel, (name, _) = check.variable_diff(ref, [("big", np.full(100, np.nan)), got[1]])
    assert np.isnan(rel) and name == "big"
    assert check.compare_variables(ref, [("big", np.full(100, np.nan)), got[1]], 1e-5) is not None


def test_first_line():
    assert check.first_line(ValueError("bad\nmore")) == "ValueError: bad"


def test_later_steps_allow_drift_but_not_the_first():
    ref = {0: 1.0, 1: 2.0}
    assert check.compare_losses(ref, {0: 1.0, 1: 2.0 * (1 + 1e-4)}, 1e-5, 1e-6, drift_rtol=1e-3) is None
    assert "step 0" in check.compare_losses(ref, {0: 1.0 + 1e-4, 1: 2.0}, 1e-5, 1e-6, drift_rtol=1e-3)
    assert "step 1" in check.compare_losses(ref, {0: 1.0, 1: 2.01}, 1e-5, 1e-6, drift_rtol=1e-3)


def test_first_line_of_a_tf_function_error_is_its_message():
    e = AttributeError("in user code:\n\n    File x.py, line 3\n\n    AttributeError: 'SymbolicTensor' object has no attribute 'numpy'\n")
    assert check.first_line(e) == "AttributeError: 'SymbolicTensor' object has no attribute 'numpy'"
