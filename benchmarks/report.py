"""Summaries of raw results, and the JSON and markdown outputs.

A result set is plain data: ``{"meta": {...}, "schedule": {...}, "programs": {name: {"modes":
{mode: <measure result>}}}}``. Everything here is a pure function of it, so reports can be
regenerated from a stored ``results.json``."""
import json
import math
import os
import re

import numpy as np

from . import modes as modes_mod

STATUS_TEXT = {"ok": "ok", "wrong": "WRONG", "failed": "FAILED", "unavailable": "n/a", "unchecked": "unchecked"}
BREAKDOWN = (("python_exec_s", "PythonRunner exec"), ("python_stall_s", "PythonRunner stall"),
             ("graph_exec_s", "GraphRunner exec"), ("graph_stall_s", "GraphRunner stall"))


def timing(result, eager_median=None):
    """Median and spread of the timed steps, and speed-up over eager (eager median / this median;
    its spread uses this mode's p75 and p25)."""
    s = result.get("step_s") or []
    if not s:
        return None
    p25, med, p75 = (float(x) for x in np.percentile(s, [25, 50, 75]))
    out = {"n": len(s), "median_s": med, "p25_s": p25, "p75_s": p75, "min_s": min(s), "max_s": max(s),
           "warmup_s": float(sum(result.get("warmup_s") or [])),
           "first_step_s": (result.get("warmup_s") or [None])[0]}
    if eager_median:
        out.update(speedup=eager_median / med, speedup_p25=eager_median / p75, speedup_p75=eager_median / p25)
    return out


def summarize(results):
    """{program: {mode: timing or None}}."""
    out = {}
    for prog, pr in results["programs"].items():
        ms = pr["modes"]
        eager = timing(ms["eager"]) if "eager" in ms else None
        em = eager["median_s"] if eager and ms["eager"]["status"] == "ok" else None
        out[prog] = {m: timing(r, em) for m, r in ms.items()}
    return out


def mode_names(results):
    seen = []
    for pr in results["programs"].values():
        for m in pr["modes"]:
            if m not in seen:
                seen.append(m)
    return sorted(seen, key=lambda m: list(modes_mod.MODES).index(m) if m in modes_mod.MODES else 99)


# The Terra paper's Table 3.3 (collected traces, fallbacks) for the programs ours stand in for.
PAPER_TABLE_3_3 = {"resnet50": (2, 0), "bert_qa": (2, 0), "yolov3_like": (2, 0), "dcgan": (2, 0),
                   "gpt2": (2, 0), "bert_cls": (2, 0), "dropblock": (3, 0), "sdpoint": (4, 1),
                   "fasterrcnn_like": (2, 0), "music_transformer": (2, 0)}


def step_timeline(result):
    """[(step, seconds)] of every step a mode ran, warm-up included, in step order."""
    w, s = result.get("warmup_s") or [], result.get("step_s") or []
    return list(enumerate(list(w) + list(s)))


def terra_per_step(result, key):
    st = (result or {}).get("terra_stats")
    if not st or not st.get("timed_steps") or key not in st["timed"]:
        return None
    return st["timed"][key] / st["timed_steps"]


def terra_count(result, key):
    st = (result or {}).get("terra_stats")
    if not st:
        return None
    if key not in st["warmup"] and key not in st["timed"]:
        return "n/a"  # (a run from before Terra counted it)
    return int(round(st["warmup"].get(key, 0) + st["timed"].get(key, 0)))


def write_json(results, path):
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=False, allow_nan=True)
        f.write("\n")


def _fmt_speedup(r, t):
    if r["status"] in ("failed", "unavailable"):
        return STATUS_TEXT[r["status"]]
    if not t or "speedup" not in t:
        return STATUS_TEXT.get(r["status"], r["status"])
    s = f"x{t['speedup']:.2f} [{t['speedup_p25']:.2f}-{t['speedup_p75']:.2f}]"
    return s if r["status"] == "ok" else f"{STATUS_TEXT[r['status']]} ({s})"


def _cell(text):
    text = re.sub(r"\[[^\]]{40,}\]", "", str(text))  # long TF attribute lists, as in check.first_line
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(results):
    meta, summ, modes = results.get("meta", {}), summarize(results), mode_names(results)
    others = [m for m in modes if m != "eager"]
    progs = list(results["programs"])
    label = lambda m: modes_mod.MODES[m].label if m in modes_mod.MODES else m
    md = ["# Benchmark results", ""]
    md.append(f"{meta.get('date', '?')} · TF {meta.get('tensorflow', '?')} · Keras {meta.get('keras', '?')} · "
              f"commit {meta.get('git_commit', '?')} · {meta.get('machine', '?')} · schedule {results.get('schedule', {})}")
    md += ["", "Speed-up = eager median step time / mode median step time; brackets: from the mode's "
           "p75 and p25 step times. WRONG = ran, but the loss or the update of a checked warm-up step, "
           "run from eager's state, differs from eager's (timing in parentheses is not a valid speed-up); "
           "FAILED = raised; n/a = unavailable.", ""]
    md += ["## Speed-up over eager (Figure 3.10)", ""]
    rows = []
    for p in progs:
        ms, t = results["programs"][p]["modes"], summ[p]
        e = t.get("eager")
        rows.append([p, f"{e['median_s'] * 1e3:.0f}" if e else STATUS_TEXT[ms["eager"]["status"]]]
                    + [_fmt_speedup(ms[m], t[m]) if m in ms else "" for m in others])
    md += [_table(["program", "eager ms/step"] + [label(m) for m in others], rows), ""]
    md += ["## Step time and warm-up", "",
           "Median [p25-p75] ms per timed step; warm-up = sum of the warm-up steps (tracing, compilation), s.", ""]
    rows = []
    for p in progs:
        row = [p]
        for m in modes:
            t = summ[p].get(m)
            row.append(f"{t['median_s'] * 1e3:.0f} [{t['p25_s'] * 1e3:.0f}-{t['p75_s'] * 1e3:.0f}]; {t['warmup_s']:.1f}s"
                       if t else "")
        rows.append(row)
    md += [_table(["program"] + [label(m) for m in modes], rows), ""]
    md += terra_against_autograph(results, summ, progs)
    fn_modes = [m for m in ("function", "function_xla") if m in modes]
    md += ["## AutoGraph coverage (Table 3.1)", ""]
    rows = []
    for p in progs:
        ms = results["programs"][p]["modes"]
        reasons, seen = [], []
        for m in fn_modes:
            r = ms.get(m) or {}
            key = (r.get("status"), (r.get("reason") or "")[:28])
            if r.get("reason") and key not in seen:
                reasons.append(f"{label(m)}: {r['reason']}")
                seen.append(key)
        reasons = "; ".join(reasons)
        drift = [ms[m].get("max_rel_loss_diff") for m in fn_modes if m in ms and ms[m]["status"] == "ok"]
        drift = [d for d in drift if d is not None]
        rows.append([p] + [STATUS_TEXT.get(ms[m]["status"], ms[m]["status"]) if m in ms else "" for m in fn_modes]
                    + [reasons or "-", f"{max(drift):.1e}" if drift else ""])
    md += [_table(["program"] + [label(m) for m in fn_modes] + ["reason", "drift"], rows), "",
           "drift: largest relative loss difference from eager over the free-running timed steps of the "
           "modes that passed (rounding amplified by training; recorded, not judged).", ""]
    md += terra_sections(results, summ, progs)
    return "\n".join(md) + "\n"


def terra_against_autograph(results, summ, progs):
    """Terra's median step over AutoGraph's, from the same run's interleaved rounds, where
    AutoGraph ran correctly, and the same ratio of their p25 and of their p75 step times."""
    rows = []
    for p in progs:
        ms, t = results["programs"][p]["modes"], summ[p]
        if "terra" not in ms or "function" not in ms:
            continue
        a, b = t.get("terra"), t.get("function")
        if ms["function"]["status"] != "ok":
            rows.append([p, f"AutoGraph {STATUS_TEXT[ms['function']['status']]}", "", ""])
        elif a and b and ms["terra"]["status"] == "ok":
            rows.append([p, f"{a['median_s'] / b['median_s']:.2f}",
                         f"{a['p25_s'] / b['p25_s']:.2f}", f"{a['p75_s'] / b['p75_s']:.2f}"])
        else:
            rows.append([p, f"Terra {STATUS_TEXT[ms['terra']['status']]}", "", ""])
    if not rows:
        return []
    return ["## Terra against AutoGraph", "",
            "Terra's median step time over AutoGraph's (tf.function) in this run, and the same "
            "ratio of their p25 and of their p75 step times (how much it moves with the step "
            "chosen; no interval).", "",
            _table(["program", "median", "p25", "p75"], rows), ""]


def terra_sections(results, summ, progs):
    md = ["## Terra traces and fallbacks (Table 3.3)", ""]
    t_modes = [m for m in mode_names(results) if m in modes_mod.MODES and modes_mod.MODES[m].is_terra]
    if not t_modes:
        return md + ["Terra modes were not run.", ""]
    runs = [pr["modes"][m] for pr in results["programs"].values() for m in t_modes if m in pr["modes"]]
    if runs and all(r["status"] == "unavailable" for r in runs):
        note = f"Unavailable: {runs[0]['reason']}. Tables 3.2 and 3.3 and Figure 3.11 fill in once it is."
        return md + [note, "", "## Terra with and without co-execution (Table 3.2)", "", note, "",
                     "## Per-step breakdown of Terra (Figure 3.11)", "", note, ""]
    rows = []
    for p in progs:
        r = results["programs"][p]["modes"].get("terra")
        if r is None or r["status"] == "unavailable" or not r.get("terra_stats"):
            rows.append([p, "", "", "", (r or {}).get("reason") or "no terra.stats()"])
            continue
        paper = PAPER_TABLE_3_3.get(p)
        rows.append([p, terra_count(r, "traces"), terra_count(r, "new_paths"), terra_count(r, "fallbacks"),
                     terra_count(r, "graph_builds"), f"{paper[0]} / {paper[1]}" if paper else "-",
                     STATUS_TEXT[r["status"]] + (f": {r['reason']}" if r["reason"] else "")])
    md += ["Counted over the whole run, warm-up included; the paper's column is its Table 3.3 "
           "(traces / fallbacks) for the program each one stands in for. paths: the distinct paths "
           "the run met (the first iteration's, which makes the optimizer's state, among them); "
           "each is traced before a graph can run it, so traces are at least as many.", "",
           _table(["program", "traces", "paths", "fallbacks", "graph builds", "paper", "status"], rows), ""]
    md += ["## Terra with and without co-execution (Table 3.2)", ""]
    rows = []
    for p in progs:
        ms = results["programs"][p]["modes"]
        rows.append([p] + [_fmt_speedup(ms[m], summ[p][m]) if m in ms else "" for m in ("terra", "terra_lazy")])
    md += [_table(["program", "Terra", "Terra LazyEval"], rows), ""]
    md += ["## Per-step breakdown of Terra (Figure 3.11), ms per timed step", ""]
    rows = []
    for p in progs:
        r = results["programs"][p]["modes"].get("terra")
        vals = [terra_per_step(r, k) for k, _ in BREAKDOWN]
        rows.append([p] + [f"{v * 1e3:.1f}" if v is not None else "n/a" for v in vals])
    md += [_table(["program"] + [n for _, n in BREAKDOWN], rows), ""]
    return md


def write_all(results, out_dir, charts=True):
    """results.json, results.md and (if matplotlib works) the PNG charts; returns the paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "results.json"), os.path.join(out_dir, "results.md")]
    write_json(results, paths[0])
    with open(paths[1], "w") as f:
        f.write(markdown(results))
    if charts:
        from . import charts as charts_mod
        paths += charts_mod.write_charts(results, out_dir)
    return paths


def finite(x):
    return x is not None and not (isinstance(x, float) and math.isnan(x))
