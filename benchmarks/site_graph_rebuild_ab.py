"""actor_critic (benchmarks/programs/real) under site_graph="auto" with the site graph taken at
its first READ_RESTARTS restarts after a read (`policy.SITE_BUILD_FACTOR = 0`, standing in for a
long run, where the restarts' thrown-away time reaches the estimate), to see what the site
graph's rebuilds cost as paths keep being compiled.

    python -m benchmarks.site_graph_rebuild_ab EPISODES LABEL

Prints the whole run's time, Terra's counts, each site graph build's seconds (lowering, as
explain() reports it) and the explain() lines about taking, keeping or rebuilding it, and the
last losses (to compare two runs). Results: benchmarks/results/site_graph_rebuild_ab.txt."""
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.runtime import policy  # noqa: E402
from benchmarks.programs.real import actor_critic  # noqa: E402


def main():
    policy.SITE_BUILD_FACTOR = 0.0
    n = int(sys.argv[1])
    t = time.perf_counter()
    r = actor_critic.run(tf.TerraGradientTape, n)
    dt = time.perf_counter() - t
    s = terra.stats()
    ex = terra.explain().splitlines()
    secs = [float(re.search(r", ([0-9.]+) s;", line).group(1)) for line in ex
            if "site graph (switch_case" in line]
    counts = " ".join(f"{k} {s[k]}" for k in ("traces", "fallbacks", "graph_builds",
                                                 "path_switches", "case_switches"))
    print(f"{sys.argv[2]}: {n} episodes {dt:.1f} s; {counts}; site graph builds {len(secs)}: "
          f"{', '.join(f'{x:.2f}' for x in secs)} s")
    for line in ex:
        if "kept" in line or "rebuilt" in line or "takes a site graph" in line:
            print("   ", line[:260])
    print("    losses[-3:]", r["losses"][n - 3:n])


if __name__ == "__main__":
    main()
