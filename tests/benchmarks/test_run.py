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


@pytest.mark.parametrize("argv", [["--programs", "resnet5"], ["--modes", "jit"], ["--steps", "7", "--rounds", "2"]])
def test_bad_arguments_exit(argv):
    with pytest.raises(SystemExit):
        run.parse_args(argv)


def test_metadata_has_versions_and_commit():
    m = run.metadata([])
    assert m["tensorflow"] and m["git_commit"] and m["date"].endswith("UTC")
