"""The real-program harness (benchmarks/real.py): its comparison, its reading of explain(), and one
program run through every mode."""
import argparse

import numpy as np
import pytest

from benchmarks import real


def test_compare_is_exact_only_when_every_value_is():
    a = {"losses": [1.0, 2.0], "variables": [np.array([1.0, 2.0], np.float32)]}
    same = {"losses": [1.0, 2.0], "variables": [np.array([1.0, 2.0], np.float32)]}
    off = {"losses": [1.0, 2.0], "variables": [np.array([1.0, 2.2], np.float32)]}
    short = {"losses": [1.0], "variables": [np.array([1.0, 2.0], np.float32)]}
    assert real.compare(a, same) == {"exact": True, "max_rel_diff": 0.0}
    c = real.compare(a, off)
    assert not c["exact"] and abs(c["max_rel_diff"] - 0.1) < 1e-6
    assert real.compare(a, short) == {"exact": False, "max_rel_diff": None}


def test_site_states_reads_explains_closing_lines():
    text = ("[trace] a.py:3 iteration 1: new path p0 ()\n"
            "site a.py:3: 4 traces, 3 paths, 1 fallbacks, coexecution\n"
            "site b.py:9: 8 traces, 8 paths, 0 fallbacks, eager (8 traces without a compilable repeat)\n"
            "site c.py:5: 5 traces, 4 paths, 2 fallbacks, coexecution, site graph over 3 paths, "
            "19 restarts after a read (0.32 s of graph thrown away)\n"
            "site d.py:7: 5 traces, 4 paths, 2 fallbacks, coexecution, 11 restarts after a read "
            "(0.01 s of graph thrown away)\n")
    assert real.site_states(text) == {
        "a.py:3": "coexecution", "b.py:9": "eager (8 traces without a compilable repeat)",
        "c.py:5": "coexecution", "d.py:7": "coexecution"}


@pytest.mark.slow  # a real program through eager, Terra and tf.function (~10 s): make test-slow
def test_one_program_through_every_mode():
    a = argparse.Namespace(steps=6, rounds=1, size="tiny", seed=0)
    r = real.run_program("scratch_mnist", a, log=lambda s: None)
    assert r["errors"] == {}
    assert r["equal"]["exact"] is True
    assert r["compiled"] is True and r["sites"] and set(r["sites"].values()) == {"coexecution"}
    for mode in real.MODES:
        assert r["modes"][mode]["median_ms"] > 0
    md = real.markdown({"meta": {"date": "d", "machine": "m", "tensorflow": "t", "git_commit": "c"},
                        "size": "tiny", "steps": 6, "rounds": 1, "programs": [r]})
    assert "| scratch_mnist | bit-identical | yes |" in md
