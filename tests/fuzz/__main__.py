"""`python -m tests.fuzz SEED [SEED ...]` or `python -m tests.fuzz --range A B`: run fuzz programs
(eager and Terra), print each seed's result and the path of its standalone script.

--all: keep the feature combinations listed in KNOWN_GAPS (off by default, as in the tests).
--exact: compare losses and variables bit for bit (default: rtol 1e-5; see docs/testing.md).
"""
import argparse
import ast
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from tests.fuzz.runner import known_gap_exclusions, run_seed  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz")
    p.add_argument("seeds", nargs="*", type=int)
    p.add_argument("--range", nargs=2, type=int, metavar=("A", "B"))
    p.add_argument("--all", action="store_true", help="keep the KNOWN_GAPS combinations")
    p.add_argument("--exact", action="store_true", help="compare bit for bit, not with rtol 1e-5")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a terra.config setting for the Terra run (e.g. grappler=False)")
    p.add_argument("--exclude", default="", help="features to switch off, comma-separated")
    p.add_argument("-v", action="store_true", help="print the whole report of a failing seed")
    a = p.parse_args(argv)
    seeds = list(a.seeds) + (list(range(*a.range)) if a.range else [])
    extra = tuple(filter(None, a.exclude.split(",")))
    config = {}
    for item in a.set:
        name, _, value = item.partition("=")
        config[name] = ast.literal_eval(value)
    failed = []
    for seed in seeds:
        try:
            exclude = (() if a.all else known_gap_exclusions(seed)) + extra
            r = run_seed(seed, exclude=exclude, exact=a.exact, config=config)
        except Exception as e:  # the harness itself failed
            print(f"seed {seed}: CRASH {type(e).__name__}: {e}", flush=True)
            failed.append(seed)
            continue
        status = "ok" if not r.problems else "DIFF"
        st = r.stats
        print(f"seed {seed}: {status} {r.seconds:.2f}s iterations {st.get('iterations')} "
              f"traces {st.get('traces')} builds {st.get('graph_builds')} "
              f"fallbacks {st.get('fallbacks')} switches {st.get('path_switches')} {r.path}",
              flush=True)
        if r.problems:
            failed.append(seed)
            print(r.report() if a.v else "  " + "\n  ".join(r.problems), flush=True)
    print(f"{len(seeds) - len(failed)}/{len(seeds)} equal to eager; differing: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
