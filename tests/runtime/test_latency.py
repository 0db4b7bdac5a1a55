"""The feed -> graph -> fetch round trip and the cancel of a blocked graph that
benchmarks/latency.py times (its numbers: benchmarks/results/latency.md, quoted in
docs/runtime.md). Here: every answer is the value put plus one, in both fetch modes, and a
cancel ends a blocked graph; no timing is asserted (speed lives in the benchmark)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from benchmarks import latency  # noqa: E402


@pytest.mark.parametrize("mode,timed", latency.VARIANTS)
def test_every_round_trip_answers_the_value_put_plus_one(mode, timed):
    lat = latency.round_trip_us(200, mode, timed)  # (raises on a wrong answer)
    assert len(lat) == 200 - 200 // 20 and np.isfinite(lat).all()


def test_cancel_ends_a_graph_blocked_on_a_feed():
    # (raises unless each cancel ends the blocked run, in time)
    assert len(latency.cancel_ms(3)) == 3


@pytest.mark.slow  # (the benchmark's smoke test)
def test_the_report_names_every_variant(tmp_path):
    assert latency.main(["--trips", "100", "--repeats", "1", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "latency.md").read_text()
    assert all(f"| {mode}, {'timed' if t else 'untimed'} feed |" in md
               for mode, t in latency.VARIANTS)
