"""benchmarks/fit.py at a small size: Terra's fit gives eager's weights, and the report renders."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import terra  # noqa: E402
from benchmarks import fit  # noqa: E402


def test_fit_benchmark_measures_a_custom_train_step_equal_to_eager():
    prog = "custom: Python state + reads"
    try:
        results = fit.measure(epochs=2, repeats=1, names={prog})
    finally:
        terra.disable()
        terra.reset()
    assert list(results) == [prog]
    res = results[prog]
    assert set(res) == {"eager fit", "terra"}
    assert res["terra"]["bit_identical_to_eager"]
    assert res["terra"]["stats"]["iterations"] == 64  # 2048 / 64 batches x 2 epochs
    md = fit.markdown(results, {"machine": "m", "tf": "t", "keras": "k", "epochs": 2,
                                "repeats": 1})
    assert f"| {prog} | terra |" in md and "identical" in md
