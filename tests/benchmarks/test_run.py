import pytest

from benchmarks import run


def test_quick_defaults():
    a = run.parse_args(["--quick"])
    assert a.programs == list(run.QUICK_PROGRAMS) and a.steps == 4 and a.rounds == 2 and a.warmup == 2
    assert a.out.endswith("results/quick")
    assert run.schedule_of(a).steps == 2


def test_full_defaults_and_mode_list():
    a = run.parse_args(["--modes", "eager,function", "--steps", "10"])
    assert len(a.programs) == 10 and a.modes == ["eager", "function"] and a.rounds == 5
    assert run.schedule_of(a).steps == 2


@pytest.mark.parametrize("argv", [["--programs", "resnet5"], ["--modes", "jit"], ["--steps", "7", "--rounds", "2"],
                                  ["--warmup", "1"]])
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        run.parse_args(argv)


def test_metadata_has_versions_and_commit():
    m = run.metadata([])
    assert m["tensorflow"] and m["git_commit"] and m["date"].endswith("UTC")


@pytest.mark.slow  # the whole benchmark harness on a tiny run (~7 s): make test-slow
def test_end_to_end_tiny_run_writes_results(tmp_path):
    """One program in its own process, eager vs tf.function: the frozen keep_prob is caught."""
    import json
    run.main(["--programs", "dropblock", "--modes", "eager,function,terra", "--size", "tiny",
              "--steps", "1", "--rounds", "1", "--warmup", "2", "--out", str(tmp_path), "--no-charts"])
    res = json.loads((tmp_path / "results.json").read_text())
    modes = res["programs"]["dropblock"]["modes"]
    assert modes["eager"]["status"] == "ok" and len(modes["eager"]["losses"]) == 3
    assert modes["function"]["status"] == "wrong", modes["function"]
    assert modes["function"]["reason"].startswith("loss differs at step 1")
    assert modes["terra"]["status"] in ("unavailable", "ok", "wrong", "failed")
    assert res["meta"]["tensorflow"] and res["schedule"]["size"] == "tiny"
    assert "| dropblock |" in (tmp_path / "results.md").read_text()
