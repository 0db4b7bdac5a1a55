"""Interleaved measurement of all modes of one program in one process.

Every mode gets its own program instance built from the same seed. First come ``warmup`` steps
(tracing, XLA compilation, Terra's tracing phase; timed and reported apart), which double as the
correctness check: eager runs them first, and before each step ``i >= 1`` every other mode is
loaded with eager's variables from before step ``i``, so its loss and its update of step ``i``
are compared with eager's from identical states (see check.py for why not whole trajectories).
Then ``rounds`` rounds: in each, every live mode runs ``steps`` consecutive steps, the order of
modes rotating from round to round, so slow drifts of a shared, noisy machine hit all modes alike.
Step ``i`` is the same iteration (same data) for every mode. A mode whose step raises stops there
(``failed``); a mode whose checked loss or update differs from eager's is ``wrong``. How far the
free-running trajectories drift apart afterwards is recorded, not judged.
"""
import dataclasses
import time

from . import check
from . import modes as modes_mod


@dataclasses.dataclass(frozen=True)
class Schedule:
    warmup: int = 3
    rounds: int = 5
    steps: int = 4

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Schedule.{f.name} must be a positive int, got {v!r}")

    @property
    def total_steps(self):
        return self.warmup + self.rounds * self.steps


class _Run:
    """Mutable bookkeeping of one mode while the program runs."""

    def __init__(self, mode):
        self.mode = mode
        self.program = None
        self.status, self.reason = "ok", None
        self.build_s = None
        self.warmup_s, self.step_s = [], []
        self.losses = {}
        self.stats_warmup, self.stats_timed = {}, {}
        self.has_stats = False
        self.events = []     # [step, traces, graph builds, fallbacks] of each step that had any
        self.last = None     # (step, timed) of the latest step run
        self.variables = None

    def fail(self, status, reason):
        self.status, self.reason, self.program = status, reason, None


def _add(acc, before, after):
    if before is None or after is None:
        return False
    for k in after:
        acc[k] = acc.get(k, 0.0) + after[k] - before.get(k, 0.0)
    return True


_EVENT_KEYS = ("traces", "graph_builds", "fallbacks")


def _count(run, i, timed, before, after):
    """Attribute the counters' growth to step `i` (its phase's totals and its events)."""
    run.has_stats |= _add(run.stats_timed if timed else run.stats_warmup, before, after)
    if before is None or after is None:
        return
    d = [int(round(after.get(k, 0) - before.get(k, 0))) for k in _EVENT_KEYS]
    if any(d):
        if run.events and run.events[-1][0] == i:
            run.events[-1] = [i] + [a + b for a, b in zip(run.events[-1][1:], d)]
        else:
            run.events.append([i] + d)


def _one_step(run, i, timed):
    mode = run.mode
    before = modes_mod.read_stats(mode)
    t0 = time.perf_counter()
    try:
        loss = run.program.step(i)
    except Exception as e:  # noqa: BLE001 - any exception is the mode's failure, with its reason
        run.fail("failed", f"step {i}: {check.first_line(e)}")
        return
    dt = time.perf_counter() - t0
    _count(run, i, timed, before, modes_mod.read_stats(mode))
    (run.step_s if timed else run.warmup_s).append(dt)
    run.losses[i] = float(loss)
    run.last = (i, timed)


def _leave(run):
    """End the mode's block of steps (`modes.leave`). A Terra iteration is filed when it ends,
    so what ending it counts (the trace of the block's last step) belongs to that step."""
    before = modes_mod.read_stats(run.mode)
    modes_mod.leave(run.mode)
    if run.last is not None:
        _count(run, *run.last, before, modes_mod.read_stats(run.mode))


def run_program(build, mode_names, schedule=Schedule(), seed=0, size="bench", log=lambda s: None):
    """Run ``build`` (``build(tape_cls, seed, size) -> Program``) in every mode; eager is the
    reference and is added if missing. Returns a plain dict per mode (see ``_result``)."""
    names = list(dict.fromkeys(["eager", *mode_names]))
    runs = [_Run(modes_mod.get(n)) for n in names]
    for run in runs:
        t0 = time.perf_counter()
        try:
            run.program = modes_mod.prepare(run.mode, build, seed=seed, size=size)
        except modes_mod.Unavailable as e:
            run.fail("unavailable", str(e))
        except Exception as e:  # noqa: BLE001
            run.fail("failed", f"build: {check.first_line(e)}")
        run.build_s = time.perf_counter() - t0
    _checked_warmup(runs, schedule.warmup, log)
    for k in range(schedule.rounds):
        live = [r for r in runs if r.program is not None]
        if not live:
            break
        for run in live[k % len(live):] + live[:k % len(live)]:
            modes_mod.enter(run.mode)
            for j in range(schedule.steps):
                if run.program is not None:
                    _one_step(run, schedule.warmup + k * schedule.steps + j, timed=True)
            _leave(run)
    for run in runs:
        if run.program is not None:
            run.variables = [(getattr(v, "path", v.name), v.numpy()) for v in run.program.variables()]
            run.program = None
    _verdicts(runs)
    return {r.mode.name: _result(r) for r in runs}


def _values(program):
    return [(getattr(v, "path", v.name), v.numpy()) for v in program.variables()]


def _load(program, values):
    for v, (_, x) in zip(program.variables(), values):
        v.assign(x)


def _checked_warmup(runs, warmup, log):
    ref = runs[0]
    assert ref.mode.name == "eager"
    snapshots = []  # eager's variables before step i, and after the last warm-up step
    if ref.program is not None:
        for i in range(warmup):
            snapshots.append(_values(ref.program))
            _one_step(ref, i, timed=False)
            if ref.program is None:
                break
        else:
            snapshots.append(_values(ref.program))
    log(f"  {ref.mode.name:13s} warm-up {sum(ref.warmup_s):7.2f}s  {ref.status} {ref.reason or ''}")
    for run in runs[1:]:
        if run.program is None:
            continue
        modes_mod.enter(run.mode)
        m = run.mode
        for i in range(warmup):
            synced = 0 < i < len(snapshots) - 1
            if synced:
                if [x.shape for _, x in _values(run.program)] != [x.shape for _, x in snapshots[i]]:
                    run.fail("wrong", f"step {i}: variables differ in number or shape from eager's")
                    break
                _load(run.program, snapshots[i])
            _one_step(run, i, timed=False)
            _leave(run)
            if run.program is None:
                break
            if ref.status != "ok" or i not in ref.losses:
                continue
            reason = check.compare_losses({i: ref.losses[i]}, {i: run.losses[i]}, m.rtol, m.atol)
            if reason is None and synced:
                reason = check.compare_update(snapshots[i], snapshots[i + 1], _values(run.program), m.update_rtol, i)
            if reason is not None:
                run.status, run.reason = "wrong", reason
                break
        log(f"  {run.mode.name:13s} warm-up {sum(run.warmup_s):7.2f}s  {run.status} {run.reason or ''}")


def _verdicts(runs):
    """Statuses come from the checked warm-up; here only the drift of the free-running
    trajectories is measured, and a mode without a usable eager reference is ``unchecked``."""
    ref = runs[0]
    for run in runs[1:]:
        if run.status not in ("ok", "wrong"):
            continue
        if ref.status != "ok":
            run.status, run.reason = "unchecked", "eager reference failed"
            continue
        run.max_rel_loss_diff = check.max_rel_loss_diff(ref.losses, run.losses)
        if run.variables is not None and len(ref.variables) == len(run.variables):
            run.var_rel_diff = float(check.variable_diff(ref.variables, run.variables)[0])


def _result(run):
    return {
        "mode": run.mode.name,
        "label": run.mode.label,
        "status": run.status,
        "reason": run.reason,
        "build_s": run.build_s,
        "warmup_s": run.warmup_s,
        "step_s": run.step_s,
        "losses": [[i, run.losses[i]] for i in sorted(run.losses)],
        "max_rel_loss_diff": getattr(run, "max_rel_loss_diff", None),
        "var_rel_diff": getattr(run, "var_rel_diff", None),
        "terra_stats": ({"warmup": run.stats_warmup, "timed": run.stats_timed, "timed_steps": len(run.step_s),
                         "events": run.events}
                        if run.has_stats else None),
    }
