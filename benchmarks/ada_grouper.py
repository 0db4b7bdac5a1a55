"""Ada-Grouper against fixed k under a preempted link: the tiny GPT on 4 logical CPUs, every
message between ranks held back by an injected time per byte (`PipelineTrainer(link_delay=...)`)
that follows a trace: nominal, preempted, worse, recovered. Each fixed-k candidate runs the same
trace (the offline sweep: per phase, the best k); the adaptive trainer runs it once, choosing k
between steps. Writes benchmarks/results/ada_grouper.{json,md} (ada_grouper_cluster.* with
--cluster: the ranks on local server workers, run inside a loopback-only namespace).

    python benchmarks/ada_grouper.py [--steps-per-phase 24] [--budget 3000000]
    unshare -rn sh -c 'ip link set lo up && python benchmarks/ada_grouper.py --cluster'
"""
import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
P = 4


def run_trace(trainer, step, k_now, delay, trace):
    """Per step of ``trace`` (time per byte): the step's seconds and the k it ran."""
    out = []
    for per_byte in trace:
        delay["per_byte"] = per_byte
        k = k_now()
        step()
        out.append((trainer.last_step_seconds, k))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-per-phase", type=int, default=24)
    parser.add_argument("--budget", type=int, default=3_000_000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--parallel", type=float, default=None,
                        help="the tuner's model: how many actions this machine's cores run at once at "
                             "full speed (Costs.parallel; 0: a device per rank). Default 1 on logical "
                             "CPUs (an action alone uses both cores through the process's one pool), "
                             "2 on cluster workers (a worker's action is mostly its RPC, one core each)")
    parser.add_argument("--cluster", action="store_true",
                        help="ranks on local tf.distribute.Server workers (run inside `unshare -rn`)")
    args = parser.parse_args()
    if args.parallel is None:
        args.parallel = 2.0 if args.cluster else 1.0
    if args.cluster:
        from terra.pipeline import cluster
        with cluster.LocalCluster(P) as local:
            run(args, local.devices, "cluster workers (one process each)")
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * P)
        run(args, [d.name for d in tf.config.list_logical_devices("CPU")][:P], "logical CPUs")


def run(args, devices, where):
    import keras
    from terra.pipeline import executor as ex, stage as st
    from terra.pipeline.adaptive import AdaptiveKFKB

    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (args.batch, 16)).astype("int32")
    y = (x + 1) % 64
    phases = [("nominal", 0.0), ("preempted", 1e-6), ("congested", 3e-6), ("recovered", 0.0)]
    trace = [pb for _, pb in phases for _ in range(args.steps_per_phase)]

    def trainer():
        delay = {"per_byte": 0.0}
        tr = ex.PipelineTrainer(st.tiny_gpt(P, devices=devices), lambda: keras.optimizers.Adam(1e-3),
                                devices=devices, schedule="1f1b", microbatches=4,
                                link_delay=lambda n: n * delay["per_byte"])
        return tr, delay

    tr, delay = trainer()
    # Every rank here shares this machine's cores (logical CPUs, or local worker processes).
    ada = AdaptiveKFKB(tr, x, y, budget=args.budget, period=3, parallel=args.parallel or None)
    candidates = ada.candidates
    adaptive = run_trace(tr, lambda: ada.step(x, y), lambda: ada.k, delay, trace)
    tr.close()
    fixed = {}
    for c in candidates:
        tr, delay = trainer()
        tr.set_schedule(c.schedule)
        tr.step(x, y)     # build and warm up
        tr.step(x, y)
        fixed[c.k] = [t for t, _ in run_trace(tr, lambda: tr.step(x, y), lambda: c.k, delay, trace)]
        tr.close()
    n = args.steps_per_phase
    report = {"p": P, "where": where, "batch": args.batch, "budget": args.budget, "phases": phases,
              "candidates": [str(c) for c in candidates], "nominal_seconds": ada.nominal_seconds,
              "adaptive": {"seconds": [t for t, _ in adaptive], "k": [k for _, k in adaptive],
                           "inferred_per_byte": [h[3] for h in ada.tuner.history]},
              "fixed": fixed, "machine": f"{os.cpu_count()} CPU cores, TF {tf.__version__}"}
    lines = [f"# Ada-Grouper under an injected slow link ({P} ranks on {where}, global batch {args.batch})", "",
             f"Machine: {report['machine']}. Link: every message between ranks waits bytes x time-per-byte. "
             f"Candidates on the memory-limit curve (budget {args.budget} B per rank): "
             f"{', '.join(report['candidates'])}. Median step ms per phase ({n} steps each). The tuner "
             "is told each step's time and the link's measured seconds per byte over the step's messages, "
             "re-chooses from that at once, and switches for a predicted gain of 10% or more; its model "
             f"has the {P} ranks share this machine's cores (`parallel={args.parallel:g}`).", "",
             "| phase | s/byte | " + " | ".join(f"k={k}" for k in fixed) + " | offline best | adaptive (k at phase end) |",
             "|---|---|" + "---|" * len(fixed) + "---|---|"]
    for i, (name, pb) in enumerate(phases):
        sl = slice(i * n, (i + 1) * n)
        meds = {k: statistics.median(ts[sl]) for k, ts in fixed.items()}
        best = min(meds, key=meds.get)
        ada_med = statistics.median(report["adaptive"]["seconds"][sl])
        lines.append(f"| {name} | {pb:g} | " + " | ".join(f"{meds[k] * 1e3:.0f}" for k in fixed) +
                     f" | k={best} | {ada_med * 1e3:.0f} (k={report['adaptive']['k'][(i + 1) * n - 1]}) |")
    totals = {k: sum(ts) for k, ts in fixed.items()}
    ada_total = sum(report["adaptive"]["seconds"])
    lines += ["", "Whole trace: " + ", ".join(f"k={k} {t:.2f} s" for k, t in totals.items()) +
              f"; adaptive {ada_total:.2f} s ({ada_total / min(totals.values()):.2f} x the best fixed k)."]
    report["totals"] = {"fixed": totals, "adaptive": ada_total}
    os.makedirs(RESULTS, exist_ok=True)
    name = "ada_grouper_cluster" if args.cluster else "ada_grouper"
    with open(os.path.join(RESULTS, name + ".json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(RESULTS, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
