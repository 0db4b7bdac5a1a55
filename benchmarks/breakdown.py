"""Where a static program's Terra step goes, beside `tf.function`'s step and the physical limit.

    python -m benchmarks.breakdown [--programs cnn,transformer,resnet50,bert_qa] [--steps 20]

For each program, in one process, one after another: the `tf.function` step, the Terra step
(co-execution, defaults), and the **graph alone**: the very graph Terra generated for the
program's path, called back to back with every run's feeds queued before it starts and no
Python besides the call (the physical limit of co-execution on this machine; it includes the
channel ops inside the graph), run with Grappler as Terra runs it (no arithmetic rewrites, no
remapper: both change results against eager) and with TF's default Grappler (as tf.function),
in alternating rounds. A shape group's graph runs each member's feeds as often as the timed
Terra steps ran that member (gpt2: the batches' own sequence lengths in their proportions), so
its time is that of the same work. Then one more block of Terra steps under cProfile, whose own
time per function is summed into the skeleton's parts (op matching, placeholders, unit guards,
feed puts, fetch waits, Terra's hook, Keras' Python, TF's Python, eager op dispatch, thread
waits, ...), per step. cProfile slows Python (not the graph), so these are larger than the
unprofiled step's Python exec and stall times, printed beside them: read them as shares.

Medians over the timed steps with p10/p90. Writes benchmarks/results/breakdown.json and .md.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from tensorflow.core.protobuf import rewriter_config_pb2  # noqa: E402
from terra import _tf_private as tfp  # noqa: E402
from benchmarks import coexec  # noqa: E402
from benchmarks import programs as bench_programs  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# (part, predicate on (filename, function name)), first match wins: cProfile's own time of
# each function goes to one part
PARTS = (
    ("feed puts", lambda f, n: "terra/compiler/channels.py" in f and n in ("put", "_convert")),
    ("fetch waits", lambda f, n: "terra/compiler/channels.py" in f or
     "terra/runtime/graph_runner.py" in f),
    ("op matching", lambda f, n: "terra/runtime/python_runner.py" in f),
    ("placeholders", lambda f, n: "terra/runtime/placeholders.py" in f),
    ("unit guards", lambda f, n: "terra/runtime/units.py" in f),
    ("Terra hook", lambda f, n: "terra/tracing/" in f),
    ("Terra iteration", lambda f, n: "terra/runtime/" in f or "terra/" in f),
    ("Keras Python", lambda f, n: "/keras/" in f),
    ("optree / nest", lambda f, n: "optree" in f or "/util/nest" in f),
    ("TF Python", lambda f, n: "/tensorflow/" in f),
    ("thread waits", lambda f, n: f == "~" and ("acquire" in n or "wait" in n)),
    ("eager op dispatch (C++)", lambda f, n: f == "~" and ("TFE_" in n or "Execute" in n)),
    ("other builtins", lambda f, n: f == "~"),
    ("other Python", lambda f, n: True),
)


class Subject:
    """One program: `step()` runs one training step and returns the loss."""

    def __init__(self, name, tape_cls, compiled=False):
        self.name = name
        if name in coexec.PROGRAMS:
            model, (x, y) = coexec.PROGRAMS[name]()
            opt = keras.optimizers.Adam(1e-3)
            fn = coexec.make_step(model, opt, tape_cls)
            fn = tf.function(fn) if compiled else fn
            self.step = lambda: fn(x, y)
        else:
            program = bench_programs.build(name, tape_cls, seed=0, size="bench")
            if compiled:
                program.train_step = tf.function(program.train_step)
            self._i = 0

            def step():
                out = program.train_step(*program.batch(self._i))
                self._i += 1
                return out
            self.step = step


ALONE_ROUNDS = 3


def timed(step, steps):
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        float(step())
        times.append(time.perf_counter() - t)
    return times


def summary(times):
    ms = 1e3 * np.asarray(times)
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "n": len(times)}


def terra_grappler(config):
    """Grappler as Terra runs its graphs by default (config.arithmetic_optimizer and
    config.remapper off: their rewrites change results against eager)."""
    opts = config.graph_options.rewrite_options
    opts.arithmetic_optimization = rewriter_config_pb2.RewriterConfig.OFF
    opts.remapping = rewriter_config_pb2.RewriterConfig.OFF


def queue_runs(path, graph, n) -> None:
    """Put everything `n` runs of `graph` dequeue, as Python puts it for `path`: its feeds, its
    shape constants, and the tokens Python puts once it has checked a unit or ended the
    iteration (a run would wait for a missing one forever)."""
    for _ in range(n):
        for slot, ch in enumerate(graph.feed_channels):
            if slot not in graph.bundled and ch is not None:
                ch.put(path.trace.feed_values[slot])
        if graph.bundled:
            graph.feed_channels[graph.bundled[0]].put(path.group_tensors)
        for ch in (*graph.gate_channels.values(), graph.commit_channel):
            if ch is not None:
                ch.put(True)


def rotation(hits: dict, steps: int) -> list:
    """`steps` members in the proportions of `hits` (member -> runs it served), spread out
    (each next run goes to the member furthest behind its share): the timed steps' own mix of
    feed shapes, for a graph that serves several (a shape group's)."""
    total = sum(hits.values())
    done = {m: 0 for m in hits}
    order = []
    for i in range(steps):
        m = max(hits, key=lambda m: hits[m] * (i + 1) / total - done[m])
        done[m] += 1
        order.append(m)
    return order


def graph_alone(steps, mutate=None, hits=None):
    """Call the compiled path's generated graph `steps` times back to back, feeds pre-queued;
    `mutate` changes the ConfigProto of the calls (None: TF's default Grappler). A shape
    group's graph runs its members in the proportions of `hits` (path -> timed steps it served;
    None: the member that served most steps, every run)."""
    if mutate is not None:
        with tfp.function_call_config(mutate):
            return graph_alone(steps, hits=hits)
    session = terra._SESSION
    paths = [p for s in session.sites.values() for p in s.paths.values() if p.graph is not None]
    if len({id(p.graph) for p in paths}) != 1:
        return None
    graph = paths[0].graph
    hits = {p: n for p, n in (hits or {}).items() if n > 0 and p.graph is graph}
    if not hits:
        hits = {max(paths, key=lambda p: p.hits): 1}
    order = rotation(hits, steps + 1)
    for path in order:
        queue_runs(path, graph, 1)
    graph.function_for(order[0])()  # first call: any instantiation left
    times = []
    for path in order[1:]:
        fn = graph.function_for(path)
        t = time.perf_counter()
        out = fn()
        if out:
            _ = [o.numpy() for o in tf.nest.flatten(out)[:1]]
        times.append(time.perf_counter() - t)
    graph.drain()
    return times


def path_hits():
    return {p: p.hits for s in terra._SESSION.sites.values() for p in s.paths.values()}


def categorize(prof_stats):
    parts = {name: 0.0 for name, _ in PARTS}
    for (filename, _line, func), (_cc, _nc, tottime, _ct, _callers) in prof_stats.stats.items():
        f = filename.replace("\\", "/")
        for name, pred in PARTS:
            if pred(f, func):
                parts[name] += tottime
                break
    return parts


def run(name, steps, warmup):
    rec = {}
    terra.reset()
    fsub = Subject(name, tf.GradientTape, compiled=True)
    timed(fsub.step, warmup)
    rec["tf.function"] = summary(timed(fsub.step, steps))

    terra.reset()
    tsub = Subject(name, tf.TerraGradientTape)
    timed(tsub.step, warmup)
    before, hits0 = terra.stats(), path_hits()
    rec["terra"] = summary(timed(tsub.step, steps))
    after, hits = terra.stats(), path_hits()
    hits = {p: n - hits0.get(p, 0) for p, n in hits.items()}
    rec["graph_alone_members"] = sorted(n for n in hits.values() if n > 0)
    terra.end_iteration()
    per = {k: (after[k] - before[k]) / steps for k in
           ("python_exec_s", "python_stall_s", "graph_exec_s", "graph_stall_s")}
    rec["terra_counters_ms"] = {k: 1e3 * v for k, v in per.items()}
    rec["terra_stats"] = {k: after[k] for k in ("traces", "fallbacks", "graph_builds")}

    # the two Grapplers in alternating rounds: one after the other, a busy spell of the
    # machine moved one of them by up to 40%
    alone = {"graph_alone": [], "graph_alone_tf_grappler": []}
    for _ in range(ALONE_ROUNDS):
        for key, mutate in (("graph_alone", terra_grappler), ("graph_alone_tf_grappler", None)):
            t = graph_alone(max(1, steps // ALONE_ROUNDS), mutate, hits)
            alone[key] = None if t is None or alone[key] is None else alone[key] + t
    rec.update({k: summary(v) if v else None for k, v in alone.items()})

    prof = cProfile.Profile()
    n_prof = max(5, steps // 2)
    prof.enable()
    timed(tsub.step, n_prof)
    prof.disable()
    terra.end_iteration()
    st = pstats.Stats(prof)
    parts = categorize(st)
    rec["profiled_parts_ms"] = {k: 1e3 * v / n_prof for k, v in parts.items()}
    top = sorted(((v[2], fn) for (f, _l, fn), v in st.stats.items()), reverse=True)[:6]
    rec["top_functions_ms"] = [(fn, 1e3 * t / n_prof) for t, fn in top]
    return rec


def markdown(results, meta):
    lines = ["# Static programs: Terra's step against tf.function and the graph alone "
             "(benchmarks/breakdown.py)", "",
             f"{meta['machine']}; TF {meta['tf']}; {meta['steps']} timed steps after "
             f"{meta['warmup']} warm-up steps per variant, one process, variants one after another (the graph alone's two in alternating rounds).",
             "", "| program | tf.function ms | Terra ms | graph alone ms | graph alone, TF's "
             "Grappler, ms | Terra / tf.function | graph alone / tf.function | Python exec ms | "
             "Python stall ms | graph stall ms | skeleton / graph alone |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(m):
        return f"{m['median_ms']:.2f} ({m['p10_ms']:.2f}-{m['p90_ms']:.2f})" if m else "n/a"
    for name, r in results.items():
        f, t, g = r["tf.function"], r["terra"], r["graph_alone"]
        c = r["terra_counters_ms"]
        gm = g["median_ms"] if g else float("nan")
        lines.append(
            f"| {name} | {cell(f)} | {cell(t)} | {cell(g)} | "
            f"{cell(r['graph_alone_tf_grappler'])}"
            f" | {t['median_ms'] / f['median_ms']:.2f} | {gm / f['median_ms']:.2f} | "
            f"{c['python_exec_s']:.2f} | {c['python_stall_s']:.2f} | {c['graph_stall_s']:.2f} | "
            f"{c['python_exec_s'] / gm:.2f} |")
    names = [n for n, _ in PARTS]
    lines += ["", "The program's thread per Terra step under cProfile (its own time per function, "
              "summed by part), ms per profiled step; profiling inflates Python, so compare "
              "shares, not totals, with the unprofiled columns above:", "",
              "| program | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for name, r in results.items():
        p = r["profiled_parts_ms"]
        lines.append(f"| {name} | " + " | ".join(f"{p[n]:.2f}" for n in names) + " |")
    lines += ["", "Largest own times per profiled step (ms):", ""]
    for name, r in results.items():
        lines.append(f"- {name}: " + "; ".join(f"`{fn}` {ms:.2f}"
                                              for fn, ms in r["top_functions_ms"]))
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--programs", default="cnn,transformer,resnet50,bert_qa")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--out", default=RESULTS, help="folder for breakdown.json and .md")
    args = ap.parse_args(argv)
    results = {}
    for name in args.programs.split(","):
        results[name] = run(name, args.steps, args.warmup)
        r = results[name]
        print(f"{name:12s} tf.function {r['tf.function']['median_ms']:8.2f} ms  terra "
              f"{r['terra']['median_ms']:8.2f} ms  graph alone "
              f"{(r['graph_alone'] or {}).get('median_ms', float('nan')):8.2f} ms", flush=True)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "tf": tf.__version__,
            "steps": args.steps, "warmup": args.warmup}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "breakdown.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    md = markdown(results, meta)
    with open(os.path.join(args.out, "breakdown.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
