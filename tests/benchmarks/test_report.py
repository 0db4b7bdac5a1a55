"""Report writers on a fake result set."""
import json

import pytest

from benchmarks import report


def mode(name, status="ok", steps=(0.1, 0.1, 0.1, 0.1), reason=None, stats=None):
    return {"mode": name, "label": name, "status": status, "reason": reason, "build_s": 0.1,
            "warmup_s": [2.0, 0.1] if steps else [], "step_s": list(steps),
            "losses": [[0, 1.0]], "max_rel_loss_diff": 0.0, "var_rel_diff": 0.0, "terra_stats": stats}


TERRA_STATS = {"warmup": {"traces": 2, "fallbacks": 0, "graph_builds": 1},
               "timed": {"traces": 0, "fallbacks": 1, "graph_builds": 0, "python_exec_s": 0.04,
                         "python_stall_s": 0.0, "graph_exec_s": 0.2, "graph_stall_s": 0.02},
               "timed_steps": 4}


def fake_results(with_terra=False):
    lazy = mode("terra_lazy", steps=(0.5,) * 4) if with_terra else mode("terra_lazy", "unavailable", (), "missing")
    terra = (mode("terra", steps=(0.25, 0.25, 0.25, 0.25), stats=TERRA_STATS) if with_terra
             else mode("terra", "unavailable", (), "Terra runtime not built yet (missing terra.GradientTape)"))
    return {
        "meta": {"date": "2026-01-01 00:00 UTC", "tensorflow": "2.21.0", "git_commit": "abc"},
        "schedule": {"warmup": 2, "rounds": 2, "steps": 2},
        "programs": {
            "alpha": {"modes": {"eager": mode("eager", steps=(0.4, 0.5, 0.5, 0.6)),
                                "function": mode("function", steps=(0.2, 0.25, 0.25, 0.3)),
                                "function_xla": mode("function_xla", "failed", (), "step 0: InvalidArgumentError: no kernel"),
                                "terra": terra, "terra_lazy": lazy}},
            "beta": {"modes": {"eager": mode("eager"),
                               "function": mode("function", "wrong", (0.05,) * 4, "loss differs at step 1: 1 vs eager 2"),
                               "function_xla": mode("function_xla", steps=(0.02,) * 4),
                               "terra": terra}},
        },
    }


def test_timing_and_speedup():
    s = report.summarize(fake_results())
    assert s["alpha"]["eager"]["median_s"] == pytest.approx(0.5)
    assert s["alpha"]["function"]["speedup"] == pytest.approx(2.0)
    assert s["alpha"]["function"]["speedup_p25"] == pytest.approx(0.5 / 0.2625)
    assert s["alpha"]["function_xla"] is None
    assert s["beta"]["function_xla"]["speedup"] == pytest.approx(5.0)
    assert s["alpha"]["function"]["first_step_s"] == 2.0


def test_write_all_produces_valid_json_markdown_and_charts(tmp_path):
    paths = report.write_all(fake_results(), str(tmp_path))
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["programs"]["alpha"]["modes"]["function"]["step_s"] == [0.2, 0.25, 0.25, 0.3]
    md = (tmp_path / "results.md").read_text()
    assert "| alpha | 500 | x2.00 [1.90-2.11] | FAILED | n/a |" in md
    assert "| beta | 100 | WRONG (x2.00 [2.00-2.00]) | x5.00 [5.00-5.00] | n/a |" in md
    assert "loss differs at step 1" in md and "no kernel" in md
    assert "Terra runtime not built yet" in md
    pngs = [p for p in paths if p.endswith(".png")]
    assert len(pngs) == 6
    for p in pngs:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_terra_tables_when_stats_exist(tmp_path):
    res = fake_results(with_terra=True)
    md = report.markdown(res)
    # (no paper number for a toy program; no new_paths in these stats: a run before it counted)
    assert "| alpha | 2 | n/a | 1 | 1 | - | ok |" in md
    assert "| alpha | 10.0 | 0.0 | 50.0 | 5.0 |" in md
    assert "| alpha | x2.00 [2.00-2.00] | x1.00 [1.00-1.00] |" in md
    paths = report.write_all(res, str(tmp_path))
    assert sum(p.endswith(".png") for p in paths) == 6


def test_table_3_3_stands_beside_the_papers_numbers_and_steps_are_timed_in_order(tmp_path):
    res = fake_results(with_terra=True)
    res["programs"]["gpt2"] = res["programs"].pop("alpha")
    assert "| gpt2 | 2 | n/a | 1 | 1 | 2 / 0 | ok |" in report.markdown(res)
    r = res["programs"]["gpt2"]["modes"]["terra"]
    r["terra_stats"] = {k: dict(v) if isinstance(v, dict) else v
                        for k, v in r["terra_stats"].items()}  # (not TERRA_STATS itself)
    r["terra_stats"]["warmup"]["new_paths"] = 2
    assert "| gpt2 | 2 | 2 | 1 | 1 | 2 / 0 | ok |" in report.markdown(res)
    r = res["programs"]["gpt2"]["modes"]["terra"]
    pts = report.step_timeline(r)
    assert [t for _, t in pts] == list(r["warmup_s"]) + list(r["step_s"])
    assert [i for i, _ in pts] == list(range(len(pts)))


def test_terra_against_autograph_is_a_ratio_of_the_same_runs_steps():
    res = fake_results(with_terra=True)
    md = report.markdown(res)
    assert "## Terra against AutoGraph" in md
    # terra: 0.25 s a step; function: 0.2, 0.25, 0.25, 0.3 (fake_results)
    t = report.summarize(res)["alpha"]
    want = t["terra"]["median_s"] / t["function"]["median_s"]
    assert f"| alpha | {want:.2f} |" in md
    res["programs"]["alpha"]["modes"]["function"]["status"] = "wrong"
    assert "| alpha | AutoGraph WRONG |  |  |" in report.markdown(res)
