"""Write a seed's program to a file, run it eagerly and under Terra, compare (tests/fuzz/generator.py).

The program runs in this process from its file (compiled with the file's name, so tracebacks and
the exception lines the comparison checks are the script's own lines). The same file, run with
plain `python`, is the standalone reproduction.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
import time

from tests.fuzz.generator import FEATURES, choose, generate

# Feature combinations on which Terra differs from eager, each with the bug it hits
# (docs/testing.md, "Fuzzer"). A seed whose program would hold every feature of an entry gets the
# entry's first feature switched off; all other choices of the seed stay as they are. Remove an
# entry once its bug is fixed: the seeds that had it then run it again.
KNOWN_GAPS: dict[tuple[str, ...], str] = {}


for _combo in KNOWN_GAPS:
    assert set(_combo) <= set(FEATURES), _combo


def known_gap_exclusions(seed: int, gaps=None) -> tuple[str, ...]:
    """The features switched off in `seed`'s program because of `gaps` (default KNOWN_GAPS)."""
    gaps = KNOWN_GAPS if gaps is None else gaps
    excluded: list[str] = []
    while True:  # switching one off may not remove another combination: repeat until none is whole
        on = {k for k, v in choose(seed, excluded)["features"].items() if v}
        whole = [combo for combo in gaps if set(combo) <= on]
        if not whole:
            return tuple(excluded)
        excluded.append(whole[0][0])

TIMEOUT_S = 20.0


@dataclasses.dataclass
class Result:
    seed: int
    path: str
    source: str
    eager: dict
    terra: dict
    problems: list
    explain: str
    seconds: float
    stats: dict

    def report(self) -> str:
        return (f"fuzz seed {self.seed}: Terra differs from eager\n"
                + "\n".join(self.problems)
                + f"\nreproduce: python {self.path}   (or: python -m tests.fuzz {self.seed})\n"
                + "--- program\n" + self.source
                + "--- terra.explain()\n" + self.explain)


def directory() -> str:
    d = os.environ.get("TERRA_FUZZ_DIR") or os.path.join(tempfile.gettempdir(), "terra_fuzz")
    os.makedirs(d, exist_ok=True)
    return d


def write(seed: int, exclude=None, exact: bool = False, config=None) -> tuple[str, str]:
    """Write seed's script; `exclude`: features to switch off (default: those of KNOWN_GAPS)."""
    if exclude is None:
        exclude = known_gap_exclusions(seed)
    source = generate(seed, exclude=exclude, timeout_s=TIMEOUT_S, exact=exact, config=config)
    path = os.path.join(directory(), f"fuzz_seed_{seed}.py")
    with open(path, "w") as f:
        f.write(source)
    return path, source


def run_seed(seed: int, exclude=None, exact: bool = False, config=None) -> Result:
    path, source = write(seed, exclude, exact, config)
    namespace = {"__name__": f"terra_fuzz_seed_{seed}", "__file__": path}
    start = time.perf_counter()
    exec(compile(source, path, "exec"), namespace)
    eager, got, problems, explain = namespace["run_both"]()
    return Result(seed, path, source, eager, got, problems, explain, time.perf_counter() - start,
                  dict(namespace["STATS"]))
