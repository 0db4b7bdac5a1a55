"""benchmarks/ratio.py: a block's numbers, and the ratios the report draws from them."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from benchmarks import ratio  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def _block(ms, cpu=1.0, stats=None):
    b = {"wall_ms": list(ms), "cpu_ms": [cpu] * len(ms)}
    if stats is not None:
        b["stats"] = stats
    return b


def test_summary_takes_the_median_of_process_medians_and_each_rounds_ratio():
    s = {"traces": 3, "fallbacks": 0, "graph_builds": 1}
    blocks = {"function": [_block([10, 11, 30]), _block([20, 20, 21]), _block([12, 12, 12])],
              "terra": [_block([11, 11, 11], 2.0, s), _block([22, 25, 22], 4.0, s),
                        _block([12, 13, 50], 3.0, s)]}
    r = ratio.summarize(blocks)
    assert r["process_medians_ms"] == {"function": [11.0, 20.0, 12.0], "terra": [11.0, 22.0, 13.0]}
    assert r["function_ms"] == 12.0 and r["terra_ms"] == 13.0
    assert r["ratio"] == pytest.approx(13 / 12)
    assert r["round_ratios"] == pytest.approx([1.0, 1.1, 13 / 12])
    assert r["terra_cpu_ms"] == 3.0 and r["terra_stats"] == [s, s, s]
    md = ratio.markdown({"cnn": r}, {"machine": "m", "tf": "t", "rounds": 3, "steps": 3,
                                     "warmup": 1})
    assert "| cnn | 12.00 | 13.00 | 1.08 | 1.00-1.10 | 3.00 |" in md


def test_a_block_times_its_steps_and_reads_terras_counts():
    out = ratio.child("transformer", "terra", steps=3, warmup=2)
    assert len(out["wall_ms"]) == len(out["cpu_ms"]) == 3
    assert all(w > 0 for w in out["wall_ms"])
    # one path, one graph, no fallback (the traces of Table 3.3's static programs)
    assert out["stats"] == {"traces": 3, "fallbacks": 0, "graph_builds": 1}
    out = ratio.child("transformer", "function", steps=2, warmup=1)
    assert len(out["wall_ms"]) == 2 and "stats" not in out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        ratio.main(["--rounds", "0"])
    with pytest.raises(SystemExit):
        ratio.main(["--child", "cnn", "eager"])
    with pytest.raises(SystemExit):
        ratio.main(["--intra-op", "-1"])
