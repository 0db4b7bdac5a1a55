"""benchmarks/limits.py: the physical limit of fasterrcnn_like's step (graph alone + numpy
alone). At size "tiny": the graph-alone step computes the program's step (its first loss is
eager's), and the limit is the sum of the two parts it names."""
import numpy as np
import pytest

from benchmarks import limits


@pytest.mark.slow  # (a benchmark's smoke test: the default suite keeps within its budget)
@pytest.mark.usefixtures("fresh_terra")
def test_limit_is_the_graph_alone_plus_the_numpy_part_of_the_programs_own_step():
    res = limits.run(steps=2, warmup=1, size="tiny")
    first = res["graph first loss"]
    np.testing.assert_allclose(first["graph"], first["eager"], rtol=1e-5)
    lim = res["limit"]
    assert lim["step_ms"] == pytest.approx(res["graph alone"]["median_ms"] +
                                           res["numpy alone"]["median_ms"])
    assert lim["best_speedup"] == pytest.approx(res["eager"]["median_ms"] / lim["step_ms"])
    # the Terra run of the same program: one path, no fallback; its graph would be built at
    # its second sighting, iteration 3, the last here: that filing waits for a next iteration
    # (runtime/filing.py, `last`), which does not come
    assert res["terra stats"] == {"traces": 3, "fallbacks": 0, "graph_builds": 0}
    md = limits.markdown(res, {"date": "d", "tf": "t", "machine": "m", "steps": 2, "warmup": 1})
    assert "graph alone" in md and f"x{lim['best_speedup']:.2f}" in md
