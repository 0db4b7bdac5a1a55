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

from tests.fuzz.generator import generate

# Features switched off in the seeded suites because Terra differs from eager on them: each entry
# names the bug (docs/testing.md, "Fuzzer"). Remove an entry once its bug is fixed.
KNOWN_GAPS: dict[str, str] = {}

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


def write(seed: int, exclude=tuple(KNOWN_GAPS), exact: bool = False,
          config=None) -> tuple[str, str]:
    source = generate(seed, exclude=exclude, timeout_s=TIMEOUT_S, exact=exact, config=config)
    path = os.path.join(directory(), f"fuzz_seed_{seed}.py")
    with open(path, "w") as f:
        f.write(source)
    return path, source


def run_seed(seed: int, exclude=tuple(KNOWN_GAPS), exact: bool = False, config=None) -> Result:
    path, source = write(seed, exclude, exact, config)
    namespace = {"__name__": f"terra_fuzz_seed_{seed}", "__file__": path}
    start = time.perf_counter()
    exec(compile(source, path, "exec"), namespace)
    eager, got, problems, explain = namespace["run_both"]()
    return Result(seed, path, source, eager, got, problems, explain, time.perf_counter() - start)
