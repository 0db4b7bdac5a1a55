"""The events `terra.explain()` lists, and the one-screen `terra.summary()`."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class EventKind(str, enum.Enum):
    """What an `Event` reports (a str: `event.kind == "fallback"` holds)."""
    TRACE = "trace"
    GRAPH_BUILD = "graph_build"
    GRAPH_REUSE = "graph_reuse"
    FALLBACK = "fallback"
    EAGER = "eager"
    SWITCH = "switch"
    CASE_SWITCH = "case_switch"
    HOLD = "hold"
    END = "end"

    def __str__(self):
        return self.value


@dataclass
class Counters:
    """What the session counts, one field per `terra.stats()` key (times in seconds)."""
    traces: int = 0
    new_paths: int = 0         # distinct paths first seen (each is traced before it can compile)
    fallbacks: int = 0
    graph_builds: int = 0
    graph_reuses: int = 0      # paths that run another path's graph over their own variables
    speculations: int = 0      # paths built as a shape group of one (shape_groups.speculate)
    speculation_hits: int = 0  # of those groups, joined by a second path with no build
    role_renames: int = 0      # of those, predicted over variables made anew (roles.py)
    path_switches: int = 0
    case_switches: int = 0
    held_iterations: int = 0   # compiled iterations whose run waited until their path was certain
    held_switches: int = 0     # path switches made before the run started: nothing to restart
    pure_tails: int = 0
    young_collections: int = 0  # young collections between co-executed iterations (COLLECT_EVERY)
    eager_twins: int = 0       # values skip mode computed eagerly as well (PathView.twins)
    twin_units: int = 0        # of the API calls making them, those run from the trace (twin_unit)
    verdicts_kept: int = 0     # traced user-layer calls not watched again (known_verdict)
    overlapped_iterations: int = 0
    commit_snapshots: int = 0  # snapshots a read of a written value took mid-iteration (commit)
    static_reads: int = 0
    iterations: int = 0
    python_exec_s: float = 0.0
    python_stall_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Event:
    """One line of `terra.explain()`."""
    kind: EventKind
    site: str
    iteration: int
    detail: str
    where: str
    reason: str = ""   # a fallback's: `Divergence.reason` (the summary counts them by it)

    def __str__(self):
        return f"[{self.kind}] {self.site} iteration {self.iteration}: {self.detail} ({self.where})"


def render(events, sites, site_graph_on: bool) -> str:
    """`terra.explain()`: every event, then one line per site."""
    lines = [str(e) for e in events]
    for site in sites:
        state = f"eager ({site.eager_reason})" if site.eager_reason else site.phase
        lines.append(f"site {site.label}: {site.traces} traces, {len(site.paths)} paths, "
                     f"{site.fallbacks} fallbacks, {state}" +
                     (f", site graph over {len(site.site_graph.paths)} paths"
                      if site.site_graph is not None and site_graph_on else "") +
                     (f", {site.read_restarts} restarts after a read "
                      f"({site.read_restart_s:.2f} s of graph thrown away)"
                      if site.read_restarts else ""))
    return "\n".join(lines) if lines else "terra: nothing has run yet"


def summary(stats: dict, sites, events, max_sites: int = 8) -> str:
    """One screen: totals, time in Python and in the graph, each site's state, what stayed
    eager and why, fallbacks grouped by reason."""
    sites = list(sites)
    lines = [f"terra: {stats['iterations']} iterations at {len(sites)} site(s): "
             f"{stats['traces']} traces, {stats['graph_builds']} graph builds, "
             f"{stats['fallbacks']} fallbacks, {stats['path_switches']} path switches",
             f"  time: Python {stats['python_exec_s']:.2f} s, and waiting for the graph "
             f"{stats['python_stall_s']:.2f} s; graph {stats['graph_exec_s']:.2f} s "
             f"(of it waiting for Python {stats['graph_stall_s']:.2f} s)"]
    for site in sites[:max_sites]:
        state = "eager" if site.eager_reason else site.phase
        lines.append(f"  site {site.label}: {state}; {site.traces} traces, "
                     f"{len(site.paths)} paths, {site.fallbacks} fallbacks")
    if len(sites) > max_sites:
        lines.append(f"  ... and {len(sites) - max_sites} more sites")
    eager = [site for site in sites if site.eager_reason]
    if eager:
        lines.append("  stayed eager:")
        lines += [f"    {site.label}: {site.eager_reason}" for site in eager[:max_sites]]
    reasons: dict = {}
    for e in events:
        if e.kind == "fallback":
            reasons[e.reason] = reasons.get(e.reason, 0) + 1
    if reasons:
        lines.append("  fallbacks by reason:")
        lines += [f"    {n} x {why}" for why, n in
                  sorted(reasons.items(), key=lambda kv: -kv[1])[:max_sites]]
    lines.append("  (terra.explain() lists every trace, build and fallback with its line)")
    return "\n".join(lines)
