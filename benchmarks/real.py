"""Run the real programs (benchmarks/programs/real/) eagerly, under Terra and as tf.function, and
report for each: equal to eager, compiled or eager (and why), traces / fallbacks / builds, step
time against eager and tf.function, and whole-run time.

    python -m benchmarks.real [--programs a,b] [--steps 200] [--rounds 2] [--size bench|tiny]

Each program runs in its own process; its modes run there interleaved by round (eager, terra,
function, then again), so a shared machine's noise hits all modes alike. Per round and mode:
the whole-run time (Terra's tracing and graph builds included) and every step's time; reported
are medians over the steady state (the second half of each run's steps) with p25 / p75, and the
median whole-run time. Terra's results are compared with eager's of the same round: losses and
every variable, exactly and as the largest relative difference.
Writes benchmarks/results/real.json and real.md (quick runs: benchmarks/results/quick/).
"""
import argparse
import json
import os
import re
import sys
import time

import numpy as np

from .programs import real as real_mod
from .run import metadata, run_worker

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")
MODES = ("eager", "terra", "function")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.real", description=__doc__.splitlines()[0])
    ap.add_argument("--programs", help="comma-separated (default: all)")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode, interleaved (default 2)")
    ap.add_argument("--size", choices=("bench", "tiny"), default="bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 30 steps, 1 round")
    ap.add_argument("--out", help="output folder (default benchmarks/results, quick: .../quick)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per program process")
    ap.add_argument("--update", action="store_true",
                    help="rerun only --programs and keep the other programs' rows of the existing "
                         "real.json (each row names the run it comes from)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    names = [x.strip() for x in (a.programs or "").split(",") if x.strip()] or list(real_mod.PROGRAMS)
    bad = [n for n in names if n not in real_mod.PROGRAMS]
    if bad:
        ap.error(f"unknown program(s) {bad}; choose from {', '.join(real_mod.PROGRAMS)}")
    a.programs = names
    if a.quick:
        a.size, a.steps, a.rounds = "tiny", 30, 1
    if a.steps < 4 or a.rounds < 1:
        ap.error("--steps must be at least 4 and --rounds at least 1")
    a.out = a.out or (os.path.join(DEFAULT_OUT, "quick") if a.quick else DEFAULT_OUT)
    return a


# ------------------------------------------------------------------------------------ one program
def compare(eager: dict, other: dict) -> dict:
    """Equality of two runs' losses and variables: exact, and the largest normwise relative
    difference (max |a - b| / max |a|, over the loss sequence and each variable)."""
    la, lb = np.asarray(eager["losses"], np.float64), np.asarray(other["losses"], np.float64)
    same_len = la.shape == lb.shape and len(eager["variables"]) == len(other["variables"])
    exact = same_len and np.array_equal(la, lb, equal_nan=True) and all(
        np.array_equal(x, y, equal_nan=True) for x, y in zip(eager["variables"], other["variables"]))
    worst = 0.0
    if same_len:
        pairs = [(la, lb)] + [(np.asarray(x, np.float64), np.asarray(y, np.float64))
                              for x, y in zip(eager["variables"], other["variables"])
                              if np.asarray(x).dtype.kind in "fc"]
        for x, y in pairs:
            if x.shape != y.shape:
                return {"exact": False, "max_rel_diff": None}
            if x.size:  # normwise: elementwise ratios blow up at entries that are ~0
                scale = max(float(np.nanmax(np.abs(x))), 1e-12)
                worst = max(worst, float(np.nanmax(np.abs(x - y))) / scale)
    return {"exact": bool(exact), "max_rel_diff": worst if same_len else None}


def site_states(explain: str) -> dict:
    """`site label -> state` from explain()'s closing lines ("coexecution", "tracing", or
    "eager (reason)")."""
    out = {}
    for line in explain.splitlines():
        m = re.match(r"site (\S+): .*?fallbacks, (.*?)(, site graph over \d+ paths)?"
                     r"(, \d+ restarts after a read \(.*\))?$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _timed_run(mod, mode, a):
    import tensorflow as tf
    import terra
    stamps = []
    kwargs = dict(seed=a.seed, size=a.size, on_step=lambda i: stamps.append(time.perf_counter()))
    if mode == "function":
        kwargs["decorate"] = tf.function
    tape = tf.TerraGradientTape if mode == "terra" else tf.GradientTape
    if mode == "terra":
        terra.reset()
    t0 = time.perf_counter()
    res = mod.run(tape, a.steps, **kwargs)
    if mode == "terra":
        terra.end_iteration()
    total = time.perf_counter() - t0
    steps = np.diff([t0] + stamps).tolist()
    out = {"total_s": total, "step_s": steps, "result": res}
    if mode == "terra":
        out["stats"] = {k: v for k, v in terra.stats().items() if not isinstance(v, str)}
        out["explain"] = terra.explain()
    return out


def _summary(runs):
    steady = [s for r in runs for s in r["step_s"][len(r["step_s"]) // 2:]]
    if not steady:
        return None
    return {"median_ms": 1e3 * float(np.median(steady)), "p25_ms": 1e3 * float(np.percentile(steady, 25)),
            "p75_ms": 1e3 * float(np.percentile(steady, 75)),
            "total_s": float(np.median([r["total_s"] for r in runs])),
            "totals_s": [r["total_s"] for r in runs]}


def run_program(name, a, log=print) -> dict:
    mod = real_mod.load(name)
    runs = {m: [] for m in MODES}
    equal, errors = [], {}
    for rnd in range(a.rounds):
        eager = None
        for mode in MODES:
            if mode in errors:
                continue
            try:
                r = _timed_run(mod, mode, a)
            except Exception as e:  # noqa: BLE001 - tf.function fails on some programs: say so
                errors[mode] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
                log(f"  {name} {mode}: {errors[mode]}")
                continue
            if mode == "eager":
                eager = r["result"]
            elif eager is not None:
                c = compare(eager, r["result"])
                r["equal"] = c
                if mode == "terra":
                    equal.append(c)
            r.pop("result")
            runs[mode].append(r)
            log(f"  {name} round {rnd} {mode}: {r['total_s']:.2f} s")
    terra_runs = runs["terra"]
    last = terra_runs[-1] if terra_runs else {}
    states = site_states(last.get("explain", ""))
    eager_sites = {k: v for k, v in states.items() if v.startswith("eager")}
    stats = last.get("stats", {})
    compiled = bool(stats.get("graph_builds")) and not eager_sites
    reasons = sorted({line.split("site stays eager: ", 1)[1] for line in last.get("explain", "").splitlines()
                      if "site stays eager: " in line})
    summary = {m: _summary(runs[m]) for m in MODES}
    e = summary["eager"]

    def ratio(m):
        s = summary[m]
        return None if not (s and e) else e["median_ms"] / s["median_ms"]
    return {
        "program": name, "source": mod.SOURCE, "license": mod.LICENSE, "trait": mod.TRAIT,
        "equal": {"exact": all(c["exact"] for c in equal) if equal else None,
                  "max_rel_diff": max((c["max_rel_diff"] or 0.0) for c in equal) if equal else None},
        "compiled": compiled, "sites": states, "eager_reasons": reasons,
        "stats": {k: stats.get(k) for k in ("traces", "fallbacks", "graph_builds", "path_switches",
                                             "iterations", "overlapped_iterations")},
        "modes": summary, "errors": errors,
        "speedup_vs_eager": ratio("terra"), "function_speedup_vs_eager": ratio("function"),
        "terra_vs_function": (summary["function"]["median_ms"] / summary["terra"]["median_ms"]
                              if summary["function"] and summary["terra"] else None),
        "whole_run_vs_eager": (e["total_s"] / summary["terra"]["total_s"]
                               if e and summary["terra"] else None),
        "explain_tail": last.get("explain", "").splitlines()[-12:],
    }


# ------------------------------------------------------------------------------------ report
def _fmt(x, spec="{:.2f}"):
    return "-" if x is None else spec.format(x)


def markdown(results: dict) -> str:
    meta = results["meta"]
    lines = [f"# Real programs: eager, Terra, tf.function",
             "",
             f"{meta['date']}, {meta['machine']}, TF {meta['tensorflow']}, commit {meta['git_commit']}; "
             f"size {results['size']}, {results['steps']} steps per run, {results['rounds']} round(s) per mode, "
             f"interleaved. Step times: medians over the second half of each run's steps [p25-p75]; "
             f"whole run: tracing and graph builds included (median over rounds). Equal to eager: "
             f"bit-identical, or the largest normwise difference max|a-b|/max|a| over the losses and "
             f"each variable (Grappler and graph kernels round some float ops differently from eager's, "
             f"and training carries a last-bit difference on; GANs amplify it most).",
             "",
             "| program | equal to eager | compiled | traces / fallbacks / builds | eager ms | Terra ms | tf.function ms | Terra vs eager | Terra vs tf.function | whole run vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    runs = {r.get("run") for r in results["programs"]}
    if len(runs) > 1:  # rows kept from earlier runs (--update): each says which run it is from
        lines[2] = lines[2].replace(f"{meta['date']}, ", "", 1).replace(
            f"commit {meta['git_commit']}; ", "", 1)
        lines.insert(3, "")
        lines.insert(4, "Rows from several runs: " + "; ".join(
            f"{', '.join(r['program'] for r in results['programs'] if r.get('run') == run)}: {run}"
            for run in sorted(runs, key=str)) + ".")
    for r in results["programs"]:
        m = r["modes"]
        eq = r["equal"]
        eq_s = "-" if eq["exact"] is None else ("bit-identical" if eq["exact"] else
                                                f"max normwise diff {_fmt(eq['max_rel_diff'], '{:.1e}')}")
        comp = "yes" if r["compiled"] else "**eager**"
        s = r["stats"]
        cnt = f"{s.get('traces')} / {s.get('fallbacks')} / {s.get('graph_builds')}" if s.get("traces") is not None else "-"

        def ms(mode):
            v = m.get(mode)
            if v is None:
                return "fails: " + r["errors"].get(mode, "?")[:60] if mode in r["errors"] else "-"
            return f"{v['median_ms']:.1f} [{v['p25_ms']:.1f}-{v['p75_ms']:.1f}]"
        lines.append(f"| {r['program']} | {eq_s} | {comp} | {cnt} | {ms('eager')} | {ms('terra')} | "
                     f"{ms('function')} | x{_fmt(r['speedup_vs_eager'])} | x{_fmt(r['terra_vs_function'])} | "
                     f"x{_fmt(r['whole_run_vs_eager'])} |")
    lines += ["", "Why a program stays eager (from `terra.explain()`), and sources:", ""]
    for r in results["programs"]:
        why = "; ".join(r["eager_reasons"]) or ("compiled" if r["compiled"] else
                                               ", ".join(f"{k}: {v}" for k, v in r["sites"].items()))
        lines.append(f"- **{r['program']}** ({r['trait']}): {why}. Source: {r['source']} ({r['license']}).")
    return "\n".join(lines) + "\n"


def worker(a):
    log = lambda s: print(s, file=sys.stderr, flush=True)
    res = run_program(a.worker, a, log=log)
    with open(a.worker_out, "w") as f:
        json.dump(res, f)


def run_one(name, a):
    result, why = run_worker("benchmarks.real", name, [
        "--steps", str(a.steps), "--rounds", str(a.rounds), "--size", a.size,
        "--seed", str(a.seed)], a.timeout)
    if result is not None:
        return result
    mod = real_mod.load(name)
    return {"program": name, "source": mod.SOURCE, "license": mod.LICENSE, "trait": mod.TRAIT,
            "equal": {"exact": None, "max_rel_diff": None}, "compiled": False, "sites": {},
            "eager_reasons": [f"harness: {why}"], "stats": {}, "modes": {m: None for m in MODES},
            "errors": {"terra": why}, "speedup_vs_eager": None, "function_speedup_vs_eager": None,
            "terra_vs_function": None, "whole_run_vs_eager": None, "explain_tail": []}


def _run_label(meta) -> str:
    return f"{meta['date']}, commit {meta['git_commit']}"


def _merged(path, new) -> dict:
    """`new`'s rows in place of the same programs' rows of the results at `path` (the others
    kept, each labelled with the run it comes from); the settings must agree."""
    with open(path) as f:
        old = json.load(f)
    if (old["size"], old["steps"], old["rounds"]) != (new["size"], new["steps"], new["rounds"]):
        raise SystemExit(f"--update: {path} was run with other settings")
    rows = {r["program"]: r for r in new["programs"]}
    merged = []
    for r in old["programs"]:
        r.setdefault("run", _run_label(old["meta"]))
        merged.append(rows.pop(r["program"], r))
    return dict(new, programs=merged + list(rows.values()))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    results = {"meta": metadata(argv), "size": a.size, "steps": a.steps, "rounds": a.rounds,
               "programs": []}
    for name in a.programs:
        print(f"{name} ...", flush=True)
        row = run_one(name, a)
        row["run"] = _run_label(results["meta"])
        results["programs"].append(row)
    if a.update:
        results = _merged(os.path.join(a.out, "real.json"), results)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "real.json"), "w") as f:
        json.dump(results, f, indent=1)
    md = markdown(results)
    with open(os.path.join(a.out, "real.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
