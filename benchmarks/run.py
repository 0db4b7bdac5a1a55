"""Run the bundled programs in every mode and write results, tables and charts.

    python -m benchmarks.run [--programs a,b] [--modes eager,function,...] [--steps N] [--quick]

Each program runs in its own process (a crash or a TF-global side effect of one program cannot
touch another); all modes of one program run in that process, interleaved (see measure.py).
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from . import modes as modes_mod
from . import programs as programs_mod

QUICK_PROGRAMS = ("dcgan", "dropblock", "sdpoint", "bert_cls", "fasterrcnn_like")
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results")


def _csv(kind, valid):
    def parse(s):
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {kind} {bad or s!r}; choose from {', '.join(valid)}")
        return items
    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    ap.add_argument("--programs", type=_csv("program", programs_mod.PROGRAMS), help="comma-separated (default: all)")
    ap.add_argument("--modes", type=_csv("mode", list(modes_mod.MODES)), default=list(modes_mod.DEFAULT_MODES),
                    help="comma-separated; eager is always added as the reference")
    ap.add_argument("--steps", type=int, help="timed steps per mode (default 20; quick 4)")
    ap.add_argument("--rounds", type=int, help="interleaving rounds (default 5; quick 2)")
    ap.add_argument("--warmup", type=int, help="warm-up steps per mode, checked against eager (default 3; quick 2)")
    ap.add_argument("--size", choices=programs_mod.SIZES, default="bench")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help=f"programs {','.join(QUICK_PROGRAMS)}, few steps")
    ap.add_argument("--out", help="output folder (default benchmarks/results, or benchmarks/results/quick)")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per program process")
    ap.add_argument("--no-charts", action="store_true")
    ap.add_argument("--report-only", metavar="RESULTS_JSON", help="rewrite tables and charts from a results.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.programs = a.programs or list(QUICK_PROGRAMS if a.quick else programs_mod.PROGRAMS)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 3)
    a.steps = a.steps or (4 if a.quick else 20)
    a.rounds = min(a.rounds or (2 if a.quick else 5), a.steps)
    if a.warmup < 2:
        ap.error(f"--warmup must be at least 2 (the warm-up steps are the steps checked against eager), got {a.warmup}")
    if a.steps % a.rounds:
        ap.error(f"--steps {a.steps} must be a multiple of --rounds {a.rounds}")
    a.out = a.out or (os.path.join(DEFAULT_OUT, "quick") if a.quick else DEFAULT_OUT)
    return a


def schedule_of(a):
    from .measure import Schedule
    return Schedule(warmup=a.warmup, rounds=a.rounds, steps=a.steps // a.rounds)


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(argv):
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=HERE, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", "benchmarks", ":!benchmarks/results"):
        commit += "+dirty"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores".replace("  ", " "),
        "platform": platform.platform(), "python": platform.python_version(),
        "tensorflow": _version("tensorflow"), "keras": _version("keras"), "numpy": _version("numpy"),
        "git_commit": commit, "argv": argv,
    }


def worker(a):
    """Runs in the child process: all modes of one program, result as JSON to --worker-out."""
    from . import measure
    log = lambda s: print(s, file=sys.stderr, flush=True)
    res = measure.run_program(programs_mod.load(a.worker).build, a.modes, schedule_of(a),
                              seed=a.seed, size=a.size, log=log)
    with open(a.worker_out, "w") as f:
        json.dump({"size": a.size, "modes": res}, f)


def run_worker(module, name, args, timeout):
    """Run `python -m module --worker name --worker-out FILE *args` in its own process (from the
    repository root); echo its progress lines (stderr lines starting with two spaces). Returns
    (the JSON it wrote, None) or (None, why it gave none)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, "-m", module, "--worker", name, "--worker-out", out, *args]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
                   PYTHONWARNINGS="ignore")
        try:
            proc = subprocess.run(cmd, cwd=os.path.dirname(HERE), env=env, timeout=timeout,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        except subprocess.TimeoutExpired:
            return None, f"program process exceeded {timeout}s"
        for line in proc.stderr.splitlines():
            if line.startswith("  "):
                print(line, flush=True)
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f), None
        last = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        return None, f"program process exited with {proc.returncode}: {last}"


def run_one(name, a):
    result, why = run_worker("benchmarks.run", name, [
        "--modes", ",".join(a.modes), "--steps", str(a.steps), "--rounds", str(a.rounds),
        "--warmup", str(a.warmup), "--size", a.size, "--seed", str(a.seed)], a.timeout)
    if result is not None:
        return result
    names = list(dict.fromkeys(["eager", *a.modes]))
    return {"size": a.size, "modes": {m: {"mode": m, "label": modes_mod.get(m).label, "status": "failed", "reason": why,
                                          "build_s": None, "warmup_s": [], "step_s": [], "losses": [],
                                          "max_rel_loss_diff": None, "terra_stats": None} for m in names}}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    from . import report
    if a.report_only:
        with open(a.report_only) as f:
            results = json.load(f)
        out = os.path.dirname(os.path.abspath(a.report_only))
    else:
        results = {"meta": metadata(argv), "schedule": vars(schedule_of(a)) | {"size": a.size, "seed": a.seed},
                   "programs": {}}
        t0 = time.time()
        for name in a.programs:
            print(f"{name} ({time.time() - t0:.0f}s elapsed)", flush=True)
            results["programs"][name] = run_one(name, a)
            report.write_json(results, os.path.join(a.out, "results.json")) if os.path.isdir(a.out) else None
        results["meta"]["total_s"] = round(time.time() - t0, 1)
        out = a.out
    paths = report.write_all(results, out, charts=not a.no_charts)
    print(report.markdown(results))
    print("wrote " + ", ".join(os.path.relpath(p) for p in paths))


if __name__ == "__main__":
    main()
