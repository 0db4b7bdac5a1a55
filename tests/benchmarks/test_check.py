import numpy as np

from benchmarks import check


def test_compare_losses_reports_first_differing_step():
    ref = {0: 1.0, 1: 2.0, 2: 3.0}
    assert check.compare_losses(ref, dict(ref), 1e-5, 1e-6) is None
    r = check.compare_losses(ref, {0: 1.0, 1: 2.5, 2: 9.0}, 1e-5, 1e-6)
    assert r.startswith("loss differs at step 1: 2.5 vs eager 2")


def test_compare_losses_tolerates_rounding():
    assert check.compare_losses({0: 1.0}, {0: 1.0 + 1e-7}, 1e-5, 1e-6) is None


def test_compare_update():
    before = [("w", np.ones((2, 2), np.float32)), ("step", np.array(3))]
    ref = [("w", np.full((2, 2), 0.9, np.float32)), ("step", np.array(4))]
    assert check.compare_update(before, ref, [(n, v.copy()) for n, v in ref], 0.1, 5) is None
    near = [("w", np.full((2, 2), 0.901, np.float32)), ("step", np.array(4))]
    assert check.compare_update(before, ref, near, 0.1, 5) is None
    skipped = [(n, v.copy()) for n, v in before]
    assert check.compare_update(before, ref, skipped, 0.1, 5).startswith(
        "step 5: variable step updated differently")
    no_w_update = [("w", np.ones((2, 2), np.float32)), ("step", np.array(4))]
    assert "update of step 5 differs from eager's: relative L2 1" in check.compare_update(before, ref, no_w_update, 0.1, 5)
    assert "shape" in check.compare_update(before, ref, [("w", np.ones(4, np.float32)), ref[1]], 0.1, 5)


def test_variable_diff_is_global_and_nan_aware():
    ref = [("big", np.full(100, 10.0)), ("zero_grad_bias", np.zeros(2))]
    got = [("big", np.full(100, 10.0)), ("zero_grad_bias", np.array([1e-4, -1e-4]))]
    rel, (name, d) = check.variable_diff(ref, got)
    assert name == "zero_grad_bias" and d == 1e-4 and rel < 2e-6
    rel, (name, _) = check.variable_diff(ref, [("big", np.full(100, np.nan)), got[1]])
    assert np.isnan(rel) and name == "big"


def test_first_line():
    assert check.first_line(ValueError("bad\nmore")) == "ValueError: bad"


def test_first_line_of_a_tf_function_error_is_its_message():
    e = AttributeError("in user code:\n\n    File x.py, line 3\n\n    AttributeError: 'SymbolicTensor' object has no attribute 'numpy'\n")
    assert check.first_line(e) == "AttributeError: 'SymbolicTensor' object has no attribute 'numpy'"


def test_first_line_drops_long_attribute_lists():
    e = ValueError("compile graph __inference_f_1[_XlaMustCompile=true,config_proto=1234567890123456789,x=1] on XLA: no kernel")
    assert check.first_line(e) == "ValueError: compile graph __inference_f_1 on XLA: no kernel"
