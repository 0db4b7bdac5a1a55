"""benchmarks/hook_overhead.py's skip-mode case: the step it times runs compiled (its counts are
in the case's title) and every variant reports a time per op."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from benchmarks import hook_overhead  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def test_skip_case_times_every_variant_on_a_compiled_path():
    r = hook_overhead.bench_skip(5, 2)
    assert r["ops_per_chain"] == 10
    assert "(traces / fallbacks / builds 2 / 0 / 1)" in r["case"], r["case"]
    assert list(r["variants"]) == ["eager", "tf.function", "Terra, operators",
                                   "Terra, tf.multiply / tf.add"]
    for v in r["variants"].values():
        assert v["repeats"] == 2 and 0 < v["min_us"] <= v["median_us"] <= v["max_us"]
