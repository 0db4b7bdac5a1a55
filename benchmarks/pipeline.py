"""Pipeline schedules with and without BPipe, side by side: iteration time (median of repeats and
spread), per-stage peak bytes (ledger; allocator from per-process cluster workers) and BPipe's
transfer overhead, each beside what the cost model predicts from the stages' measured action
times (`terra.pipeline.calibrate`); on the cluster, a plain-Keras GPT cut by the planner with its
predicted peaks beside the workers' allocator peaks. Writes benchmarks/results/pipeline.{json,md},
pipeline_memory.png and pipeline_prediction.png.

    python benchmarks/pipeline.py [--stages 4] [--repeats 7] [--no-cluster]
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
SCHEDULES = ["gpipe", "1f1b", "interleaved", "kfkb", "chimera", "zb-h1", "zb-v", "dualpipe-v"]


def time_schedules(p, m, repeats, seq, d_model, mb_size):
    import keras
    from terra.pipeline import calibrate, stage
    from terra.pipeline.executor import PipelineTrainer, make_schedule
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * p)
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    rng = np.random.default_rng(0)
    x = rng.integers(0, 64, (m * mb_size, seq)).astype("int32")
    y = rng.integers(0, 64, (m * mb_size, seq)).astype("int32")
    rows = []
    runs = [(name, balance, True) for name in SCHEDULES for balance in (None, "bpipe")]
    runs.insert(4, ("1f1b", "bpipe", False))                 # BPipe with synchronous transfers
    trainers = []
    for name, balance, overlap in runs:
        sch = make_schedule(name, p, m)
        nparts = sch.pipe_depth
        parts = stage.tiny_gpt(nparts, seq=seq, d_model=d_model,
                               devices=[devices[sch.stage_ranks[k]] for k in range(nparts)])
        reps = stage.tiny_gpt(nparts, seq=seq, d_model=d_model, devices=devices[::-1]) if name == "chimera" else None
        tr = PipelineTrainer(parts, lambda: keras.optimizers.Adam(1e-3), devices=devices, schedule=name,
                             balance=balance, microbatches=m, replica_stages=reps, overlap=overlap)
        tr.step(x, y)  # build + warm up (the optimizer update is compiled on the second step)
        tr.step(x, y)
        tr.ledger.reset_peaks()
        trainers.append(tr)
    # Round-robin repeats, so load from other processes on the machine hits every run alike.
    times = [[] for _ in runs]
    xfer = [[] for _ in runs]
    for _ in range(repeats):
        for k, tr in enumerate(trainers):
            tr.step(x, y)
            times[k].append(tr.last_step_seconds)
            xfer[k].append(sum(tr.transfer_seconds))
    for (name, balance, overlap), tr, ts, xs in zip(runs, trainers, times, xfer):
        mem = tr.memory_report()
        pred = calibrate.predict(tr, repeats=5)
        shared = calibrate.predict(tr, parallel=1, costs=pred.costs)   # ranks share the cores
        moves = sum(1 for _, _, a in tr.schedule.actions() if a.kind.name in ("EVICT", "LOAD"))
        rows.append({"schedule": name, "balance": (balance or "none") + ("" if overlap else "+sync"),
                     "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts),
                     "transfer_s_median": statistics.median(xs), "transfers": moves,
                     "ledger_peak_packs": [r["peak_packs"] for r in mem],
                     "ledger_peak_activation": [r["peak_activation"] for r in mem],
                     "ledger_peak_total": [r["peak_total"] for r in mem],
                     "predicted_s": pred.step_time, "predicted_bubble": pred.bubble,
                     "predicted_shared_s": shared.step_time,
                     "predicted_peak_total": list(pred.peak_bytes),
                     "stage_costs_s": {"F": list(pred.costs.F), "B": list(pred.costs.B), "W": list(pred.costs.W)}})
        tr.close()
        print(f"{name:12s} {rows[-1]['balance']:11s} median {rows[-1]['median_s'] * 1e3:7.1f} ms "
              f"packs {rows[-1]['ledger_peak_packs']}", flush=True)
    return rows


def markdown(report):
    overhead = ""
    rows = {(r["schedule"], r["balance"]): r for r in report["in_process"]}
    base, bal, sync = (rows[("1f1b", k)]["median_s"] for k in ("none", "bpipe", "bpipe+sync"))
    overhead = (f"BPipe overhead on 1F1B (in-process): {100 * (bal / base - 1):+.1f}% with overlapped "
                f"transfers, {100 * (sync / base - 1):+.1f}% with synchronous transfers.")
    if report.get("cluster"):
        c = report["cluster"]["runs"]
        overhead += (f" Cluster: {100 * (c['1f1b+bpipe']['seconds'] / c['1f1b']['seconds'] - 1):+.1f}% "
                     f"overlapped, {100 * (c['1f1b+bpipe+sync']['seconds'] / c['1f1b']['seconds'] - 1):+.1f}% synchronous.")
    lines = [f"# Pipeline schedules, {report['stages']} stages, {report['microbatches']} micro-batches",
             "", f"Machine: {report['machine']}. Times: median of {report['repeats']} steps "
             "(min-max), in-process logical CPUs.", "", overhead, "",
             "Predicted: `terra.pipeline.calibrate.predict`, the simulator fed each stage's F/B/W timed "
             "alone on its device and the built packs. With a device per rank it assumes what "
             f"{report['stages']} ranks on {os.cpu_count()} cores do not have; `shared` models the ranks "
             "sharing the machine (`parallel=1`: an action timed alone already used every core, so "
             "n running actions progress at 1/n each). Predicted peaks use the ledger's rules and equal "
             "its peaks ([plot](pipeline_prediction.png)).", "",
             "| schedule | balance | step ms (min-max) | predicted ms (device per rank) | measured / predicted | predicted ms (shared) | measured / shared | bubble (predicted) | transfer ms | EVICT+LOAD | ledger peak packs / rank | ledger peak activation KiB / rank | predicted peak = ledger |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["in_process"]:
        same = "yes" if r["predicted_peak_total"] == r["ledger_peak_total"] else f"no: {r['predicted_peak_total']}"
        lines.append(f"| {r['schedule']} | {r['balance']} | {r['median_s'] * 1e3:.1f} ({r['min_s'] * 1e3:.1f}-"
                     f"{r['max_s'] * 1e3:.1f}) | {r['predicted_s'] * 1e3:.1f} | {r['median_s'] / r['predicted_s']:.2f} | "
                     f"{r['predicted_shared_s'] * 1e3:.1f} | {r['median_s'] / r['predicted_shared_s']:.2f} | "
                     f"{r['predicted_bubble']:.2f} | {r['transfer_s_median'] * 1e3:.1f} | {r['transfers']} | "
                     f"{r['ledger_peak_packs']} | {[round(b / 1024) for b in r['ledger_peak_activation']]} | {same} |")
    if report.get("cluster"):
        lines += ["", "## Cluster mode (one TF server process per stage, BFC allocator per worker)", "",
                  "Predicted as in-process, each stage timed alone on its worker (`calibrate.predict`); "
                  "predicted peaks add each worker's measured backward working set (its allocator's peak "
                  "during the stage's backward, or the accumulation's two copies of the weights) to the "
                  "simulated ledger peak, beside the worker's allocator peak over the timed step (steps run "
                  "without applying the update: gradients are compared with one device's).", "",
                  "| run | step ms (median) | predicted ms (device per rank) | predicted ms (shared) | measured / shared | bubble (predicted) | grad err vs single device | ledger peak packs | predicted peak KiB / worker | allocator peak KiB / worker | peak error (worst) | transfer ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, r in report["cluster"]["runs"].items():
            predicted, peak = r.get("predicted_peak"), r["allocator_peak"]
            if predicted:
                errors = [(a - b) / b for a, b in zip(predicted, peak)]
                worst = max(errors, key=abs)
                cols = (f"{r['predicted_s'] * 1e3:.0f} | {r['predicted_shared_s'] * 1e3:.0f} | "
                        f"{r['seconds'] / r['predicted_shared_s']:.2f} | {r['predicted_bubble']:.2f}")
                pk = f"{[round(b / 1024) for b in predicted]} | {[round(b / 1024) for b in peak]} | {worst:+.1%}"
            else:
                cols, pk = "- | - | - | -", f"- | {[round(b / 1024) for b in peak]} | -"
            lines.append(f"| {name} | {r['seconds'] * 1e3:.0f} | {cols} | {r['grad_err']:.1e} | {r['ledger_peak_packs']} | "
                         f"{pk} | {sum(r['transfer_seconds']) * 1e3:.0f} |")
    if report.get("cluster_keras"):
        k = report["cluster_keras"]
        lines += ["", "## A plain-Keras GPT cut by the planner, on the cluster workers", "",
                  "`python -m terra.pipeline.cluster keras`: profiled on worker 0 (its allocator measures each "
                  "call's backward working set), planned, trained; per worker the plan's total (ledger terms "
                  "plus temporaries) beside the allocator peak, and per part the predicted forward + backward "
                  "beside the part run alone (median of 5 runs, their range in brackets). A part's share is its "
                  "F+B over the sum of the parts' (what the planner balances; a machine slower at check time "
                  "than while profiling leaves the shares as they were).", "", "```", k["plan"], "```", "",
                  "| worker | predicted peak KiB | allocator peak KiB | error | ledger peak KiB (= predicted in its terms) | part F+B ms predicted | measured (range) | error | share error |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for i, (r, part) in enumerate(zip(k["ranks"], k["parts"])):
            lo, hi = part.get("fb_spread", (0.0, 0.0))
            lines.append(f"| {i} | {r['predicted_peak'] // 1024} | {r['allocator_peak'] // 1024} | {r['peak_error']:+.1%} | "
                         f"{r['ledger_peak'] // 1024} ({'=' if r['ledger_peak'] == r['predicted_ledger_peak'] else '!='}) | "
                         f"{(part['forward_s_predicted'] + part['backward_s_predicted']) * 1e3:.2f} | "
                         f"{(part['forward_s'] + part['backward_s']) * 1e3:.2f} ({lo * 1e3:.1f}-{hi * 1e3:.1f}) | "
                         f"{part.get('fb_error', 0.0):+.1%} | {part.get('share_error', 0.0):+.1%} |")
    return "\n".join(lines) + "\n"


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = {(r["schedule"], r["balance"]): r for r in report["in_process"]}
    p = report["stages"]
    panels = [("1F1B ledger (in-process)", [rows[("1f1b", "none")]["ledger_peak_total"],
                                            rows[("1f1b", "bpipe")]["ledger_peak_total"]])]
    if report.get("cluster"):
        runs = report["cluster"]["runs"]
        panels.append(("1F1B allocator peak (cluster workers)",
                       [runs["1f1b"]["allocator_peak"], runs["1f1b+bpipe"]["allocator_peak"]]))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5))
    axes = np.atleast_1d(axes)
    for ax, (title, (base, bal)) in zip(axes, panels):
        idx = np.arange(p)
        ax.bar(idx - 0.2, np.array(base) / 2**20, 0.4, label="w/o activation balancing")
        ax.bar(idx + 0.2, np.array(bal) / 2**20, 0.4, label="BPipe")
        ax.set_xlabel("pipeline stage")
        ax.set_ylabel("peak memory (MiB)")
        ax.set_title(title)
        ax.set_xticks(idx)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_prediction(report, path):
    """Predicted against measured: step time per schedule (in-process) and per-rank peak bytes
    (ledger in-process; allocator for the planner-cut Keras model on the cluster)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report["in_process"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ax = axes[0]
    for r in rows:
        ax.plot(r["predicted_s"] * 1e3, r["median_s"] * 1e3, "o", markersize=4)
        ax.annotate(f"{r['schedule']}/{r['balance']}", (r["predicted_s"] * 1e3, r["median_s"] * 1e3), fontsize=6)
    top = max(r["median_s"] for r in rows) * 1e3 * 1.1
    ax.plot([0, top], [0, top], "k--", linewidth=0.7, label="measured = predicted")
    ax.set_xlabel("predicted step (ms, a core per rank)")
    ax.set_ylabel("measured step (ms, median)")
    ax.set_title(f"step time, {report['stages']} ranks on {os.cpu_count()} cores", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    pred = [b / 2**20 for r in rows for b in r["predicted_peak_total"]]
    meas = [b / 2**20 for r in rows for b in r["ledger_peak_total"]]
    ax.plot(pred, meas, "o", markersize=3, label="ledger, every schedule and rank")
    if report.get("cluster_keras"):
        k = report["cluster_keras"]["ranks"]
        ax.plot([r["predicted_peak"] / 2**20 for r in k], [r["allocator_peak"] / 2**20 for r in k], "s",
                markersize=5, label="allocator, planner-cut Keras GPT (cluster)")
    top = max(pred + meas + [r["allocator_peak"] / 2**20 for r in report.get("cluster_keras", {}).get("ranks", [])]) * 1.1
    ax.plot([0, top], [0, top], "k--", linewidth=0.7)
    ax.set_xlabel("predicted peak (MiB)")
    ax.set_ylabel("measured peak (MiB)")
    ax.set_title("peak memory per rank", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--mb-size", type=int, default=4)
    parser.add_argument("--no-cluster", action="store_true")
    args = parser.parse_args()
    report = {"stages": args.stages, "microbatches": args.microbatches, "repeats": args.repeats,
              "machine": f"{os.cpu_count()} CPU cores, TF {tf.__version__}",
              "model": {"seq": args.seq, "d_model": args.d_model, "microbatch_size": args.mb_size}}
    if not args.no_cluster:
        from terra.pipeline import cluster
        report["cluster"] = cluster.run_isolated(
            ["demo", "--workers", str(args.stages), "--microbatches", str(args.microbatches),
             "--schedules", "1f1b,1f1b+bpipe,1f1b+bpipe+sync,gpipe,interleaved,kfkb,chimera,zb-h1,zb-v,dualpipe-v",
             "--repeats", str(args.repeats),
             "--seq", str(args.seq), "--d-model", str(args.d_model), "--mb-size", str(args.mb_size)], timeout=900)
        report["cluster_keras"] = cluster.run_isolated(["keras", "--workers", str(args.stages)], timeout=400)
    report["in_process"] = time_schedules(args.stages, args.microbatches, args.repeats, args.seq,
                                          args.d_model, args.mb_size)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "pipeline.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(RESULTS, "pipeline.md"), "w") as f:
        f.write(markdown(report))
    plot(report, os.path.join(RESULTS, "pipeline_memory.png"))
    plot_prediction(report, os.path.join(RESULTS, "pipeline_prediction.png"))
    print(markdown(report))


if __name__ == "__main__":
    main()
