"""benchmarks/soak.py at a small size: the faulted program equals eager under Terra, with the
errors and interrupts it injects, and the report renders."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import terra  # noqa: E402
from benchmarks import soak  # noqa: E402


def test_soak_program_equals_eager_with_its_faults():
    try:
        r = soak.measure(340)
    finally:
        terra.reset()
    assert r["equal_to_eager"], r
    # out-of-range labels at steps 96, 193, 290; a KeyboardInterrupt at step 330
    assert (r["caught_errors"], r["interrupts"], r["losses_compared"]) == (3, 1, 339)
    assert r["terra"]["iterations"] == 340
    md = soak.markdown(r, {"date": "d", "machine": "m", "tf": "t", "keras": "k"})
    assert "| equal to eager (losses, caught errors, interrupts, iterations, weights) | yes |" in md
