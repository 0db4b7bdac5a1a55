"""examples/pipeline_gpt.py runs from a checkout: a plain-Keras GPT cut automatically trains equal
to one device, and the plan's pack and peak predictions match the built stages and the ledger."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # an interpreter, two models, a profile (~20 s): make test-slow
def test_pipeline_gpt_example_matches_one_device_and_its_plan():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "pipeline_gpt.py"), "--steps", "3",
                          "--stages", "2", "--blocks", "2"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    rows = re.findall(r"^ +(\d+) +([\d.]+) +([\d.]+) +\d+$", text, re.M)
    assert len(rows) == 3
    for _, got, want in rows:
        assert abs(float(got) - float(want)) < 1e-4, text
    worst = float(re.search(r"largest difference of any variable from one-device training: (\S+)", text).group(1))
    assert worst < 1e-4
    parts = re.findall(r"part \d rank \d: pack (\d+) / (\d+) B, peak (\d+) / (\d+) B", text)
    assert len(parts) == 2
    for pack_p, pack_m, peak_p, peak_m in parts:
        assert pack_p == pack_m
        assert abs(int(peak_p) - int(peak_m)) <= 16   # the optimizer's own scalars
    assert "is the slowest" in text
