"""Test driver: plays the PythonRunner's part for one iteration of a lowered graph.

    events = plan(lowered, trace)                  # what Python does (terra/compiler/plan.py)
    result = drive(lowered, trace, runner=runner)  # run the graph and play the events

`trace` is the trace an eager run of the same iteration produced (typically on a twin model, with
`remap_variables` applied so its variables are the graph's).

Fetch channels get one element per visit of the node; the driver discards the elements Python
does not read, and checks at the end that the graph enqueued exactly one element per visit and
dequeued every element Python put.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from terra import _tf_private as tfp
from terra.compiler.lower import Lowered, lower
from terra.compiler.merge import merge, shape_key
from terra.compiler.plan import Event, Planner, plan
from terra.ir.records import OpRecord, Trace, VariableRef
from terra.runtime.graph_runner import GraphRunner
from terra.tracing import Recorder

__all__ = ["Event", "plan", "drive", "DriveResult", "GraphRunnerNoGrappler", "remap_variables",
           "variable_keys", "twin_run", "TwinRun"]


@dataclass
class DriveResult:
    fetched: dict = field(default_factory=dict)   # (record, output index) -> np.ndarray
    events: list = field(default_factory=list)
    outputs: object = None


class GraphRunnerNoGrappler(GraphRunner):
    """A GraphRunner whose runs skip Grappler (bit-identical to eager, as replay does)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("grappler", False)
        super().__init__(*args, **kwargs)


# ----------------------------------------------------------------------------------- variables
def variable_keys(variables) -> list:
    """Trace keys (ids of resource handles) of tf / Keras variables, in order."""
    out = []
    for v in variables:
        v = getattr(v, "value", v) if not isinstance(v, tfp.BaseResourceVariable) else v
        out.append(id(v.handle))
    return out


def remap_variables(trace: Trace, mapping: dict) -> Trace:
    """A copy of `trace` whose VariableRef keys are renamed by `mapping` (twin model -> graph's)."""
    def ref(r):
        if isinstance(r, tuple):
            return tuple(map(ref, r))
        if isinstance(r, VariableRef):
            if r.key not in mapping:
                raise ValueError(f"remap_variables: no mapping for {r!r}")
            return VariableRef(mapping[r.key])
        return r
    records = [OpRecord(r.index, r.op_type, r.attrs, ref(r.inputs), r.outputs, r.location,
                        r.route, r.function, r.taped) for r in trace.records]
    return Trace(trace.site, records, list(trace.feeds), list(trace.feed_values),
                 list(trace.fetches), {mapping[k]: v for k, v in trace.variables.items()
                                       if k in mapping}, list(trace.unsupported),
                 dict(trace.functions), list(trace.unseeded_random), list(trace.fast_fallbacks))


# --------------------------------------------------------------------------------------- drive
def drive(lowered: Lowered, trace: Trace, *, runner: Optional[GraphRunner] = None,
          feed_values: Optional[dict] = None, delay: Optional[Callable] = None,
          timeout: float = 60.0, merged=None) -> DriveResult:
    """Run `lowered.function` for `trace`'s iteration and play the Python side.

    feed_values: slot -> value, or -> callable(fetched) computing it from the values fetched so
    far (for programs that feed back what they fetched); default: `trace.feed_values`.
    delay: called before every Python-side action (e.g. a random sleep, for stress tests).
    Every wait is bounded by `timeout` (TerraTimeoutError). `merged`: as for `plan`."""
    p = Planner(lowered, trace, merged)
    events = p.run()
    expected = {key: len(p.node[key[0]].seen.get(p.tid, ())) for key in lowered.fetches}
    runner = runner or GraphRunnerNoGrappler()
    feed_values = feed_values or {}
    res = DriveResult(events=events)
    got = {key: 0 for key in lowered.fetches}
    run = runner.start(lowered.function)
    try:
        for ev in events:
            if delay is not None:
                delay()
            if ev.kind == "get":
                ch = lowered.fetches[ev.key]
                while got[ev.key] <= ev.value:
                    value = runner.fetch(ch, timeout=timeout)
                    got[ev.key] += 1
                res.fetched[ev.ref] = np.asarray(value)
                continue
            if ev.kind == "select":
                ch, value = lowered.case_selects[ev.key], ev.value
            elif ev.kind == "cond":
                ch, value = lowered.loop_conds[ev.key], ev.value
            else:
                ch = lowered.feeds[ev.key]
                value = feed_values.get(ev.value, trace.feed_values[ev.value])
                if callable(value):
                    value = value(res.fetched)
            ch.put(value)
        res.outputs = runner.result(timeout=timeout)
    except BaseException:
        if not run.done:
            runner.cancel(timeout=timeout)
        lowered.drain()
        raise
    for key, ch in lowered.fetches.items():
        left = ch.drain()
        if got[key] + left != expected[key]:
            raise AssertionError(f"drive: fetch n{key[0]}:{key[1]} got {got[key]} + {left} left "
                                 f"elements, expected one per visit ({expected[key]})")
    for ch in lowered.feed_channels():
        if ch.size():
            raise AssertionError(f"drive: {ch!r} still holds {ch.size()} elements after the run")
    return res


# ----------------------------------------------------------------------------- twin-model runs
# Program A runs every iteration eagerly (recording it, so the driver knows what Python did).
# Program B is in the tracing phase until the TraceGraph covers its latest trace (each iteration
# recorded and merged), then the graph is lowered once and B's later iterations run the graph,
# driven with A's trace of the same iteration. An iteration the graph does not cover runs
# eagerly on B, is merged, and the graph is lowered again (what the runtime's fallback does).
# After every iteration the fetched loss and all variables of A and B are compared.


def all_variables(*objs):
    seen, out = set(), []
    for o in objs:
        for v in (o.variables if hasattr(o, "variables") else o):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out


def record(step, state, *args):
    with Recorder("step") as rec:
        out = step(state, *args)
    return rec.trace, out


def assert_same(a, b, rtol, what):
    if rtol is None:
        np.testing.assert_array_equal(a, b, err_msg=what)
    else:
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-7, err_msg=what)


@dataclass
class TwinRun:
    graph: object = None
    traces: list = field(default_factory=list)
    lowered: object = None
    lowerings: int = 0
    driven: int = 0
    eager_b: int = 0
    configs_driven: list = field(default_factory=list)
    fetched: list = field(default_factory=list)


def twin_run(build, step, configs, *, variables, loss_of=lambda out: out, rtol=None,
                feed_back=None, delay=None, timeout=30.0):
    """Run `step(state, *cfg)` for every cfg on two twins built by `build()`; see module doc.

    variables(state) -> list of every variable (same order on both twins). `loss_of(out)` is the
    value the step fetched (compared with what the graph fetched). `feed_back(trace, out)` ->
    {slot: callable(fetched)} for feeds Python computes from fetched values."""
    a, b = build(), build()
    vars_a, vars_b = variables(a), variables(b)
    assert len(vars_a) == len(vars_b)
    for x, y in zip(vars_a, vars_b):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    kmap = dict(zip(variable_keys(vars_a), variable_keys(vars_b)))
    run = TwinRun()
    for it, cfg in enumerate(configs):
        trace_a, out_a = record(step, a, *cfg)
        trace_a = remap_variables(trace_a, kmap)
        merged = run.lowered.match(trace_a) if run.lowered is not None else None
        if merged is not None:
            feeds = feed_back(trace_a, out_a) if feed_back else None
            res = drive(run.lowered, trace_a, feed_values=feeds, delay=delay, timeout=timeout,
                        merged=merged)
            run.driven += 1
            run.configs_driven.append(cfg)
            run.fetched.append(res.fetched)
            loss_a = np.asarray(loss_of(out_a))
            matches = [v for v in res.fetched.values() if v.shape == loss_a.shape
                       and np.array_equal(v, loss_a)]
            if rtol is not None and not matches:
                matches = [v for v in res.fetched.values() if v.shape == loss_a.shape
                           and np.allclose(v, loss_a, rtol=rtol, atol=1e-7)]
            assert matches, f"iteration {it}: loss {loss_a} not among fetched {res.fetched}"
        else:
            trace_b, _ = record(step, b, *cfg)
            run.eager_b += 1
            new = merge(run.graph, trace_b)
            covered = run.graph is not None and shape_key(new) == shape_key(run.graph)
            if not covered or run.lowered is not None:  # a new path, or a fallback: add it
                run.graph = new
                run.traces.append(trace_b)
            if covered or run.lowered is not None:
                run.lowered = lower(run.graph, run.traces)
                run.lowerings += 1
        for x, y in zip(vars_a, vars_b):
            assert_same(x.numpy(), y.numpy(), rtol, f"iteration {it} {cfg}: {x.name}")
    return run
