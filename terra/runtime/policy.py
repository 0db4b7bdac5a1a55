"""When a site builds a path's graph, and when it gives up and stays eager.

Pure functions of a site's paths and counts (no TF, no session state): after filing a trace the
session asks `due` whether the path's graph is built now, and `give_up` whether the site stays
eager from now on; it acts on the answers. The rules weigh what a site costs against what its
graphs serve: a build and a graph's first run cost about as much as a few traces, a fallback
more than the eager iteration it replaces, and a compiled iteration less.

Building (`due`):
  - a site that has not compiled builds a path at its second sighting;
  - one that has builds a new path at once (a random branch among several: served from then on)
    while fewer than FIRST_SIGHT_UNUSED graphs so built were bad bets: unused
    FIRST_SIGHT_WINDOW iterations on (paths seen once: episodes of rare lengths), or first
    served more than RARE_GAP iterations after their path was first seen;
  - past that, at its second sighting if its sightings came at most RARE_GAP iterations apart
    on average, and otherwise (a rare path: its graph would serve few iterations) at its
    RARE_SIGHTINGS-th, when the traces it has cost amount to about one build.

A site graph (`takes_site_graph`, with `config.site_graph` "auto"): a restart that cancels a run
Python has read values of throws that graph work away (the restart runs the graph up to them
again). Once such restarts have thrown away (the cancelled runs' time, at least Python's waits
for the values) as much as the site graph would cost to build (SITE_BUILD_FACTOR times its paths' own builds), and at
least READ_RESTARTS of them, the site runs one graph for its compiled paths, where taking a
branch is a Case-Select put (a rent-or-buy rule: what restarts cost so far bounds what the build
can cost). A site whose restarts come before any read (Python ahead of the graph) loses little
to them and keeps its path graphs, with no site-wide rebuild per new path. Each later rebuild
(`rebuilds_site_graph`: a path compiled since, which runs its own graph meanwhile) is the same
bet, priced at what the last site graph cost (SITE_REBUILD_FACTOR times its lowering) and paid
by the restarts after a read that involved a path outside it: a site whose traces merge badly
(an unrolled episode of another length per path: thousands of switch-cases) stops rebuilding.

Giving up (`GIVE_UP`, first matching rule): the site's paths keep changing, so each iteration
costs a fallback and a build, more than running it eagerly; or it falls back more often than its
graphs serve iterations.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["BUILDS_PER_TRACE_LIMIT", "CHURN_PATHS", "FIRST_SIGHT_UNUSED", "FIRST_SIGHT_WINDOW",
           "GIVE_UP", "RARE_GAP", "RARE_SIGHTINGS", "Rule", "Tally", "due", "give_up",
           "late_once", "unused_once", "READ_RESTARTS", "SITE_BUILD_FACTOR",
           "SITE_REBUILD_FACTOR", "rebuilds_site_graph", "takes_site_graph"]

# a site stays eager after this many builds per `max_traces` while its builds are not
# outnumbered by the iterations its graphs served (a site whose common path runs most iterations
# affords a build for each rarer path it sees often)
BUILDS_PER_TRACE_LIMIT = 2
# ... or once this many paths first seen after it compiled were seen once while no graph of the
# site ever served an iteration (every episode of another length)
CHURN_PATHS = 4
FIRST_SIGHT_UNUSED = 2
FIRST_SIGHT_WINDOW = 2
RARE_GAP = 8
RARE_SIGHTINGS = 5
# "auto" site graphs: at least this many restarts after a read (one is no pattern yet), and a
# site graph's build estimated at this many times the lowering of its paths' own graphs (it
# lowers each path's ops again, and is instantiated whole: 0.8-2.8x on the programs measured)
READ_RESTARTS = 3
SITE_BUILD_FACTOR = 2.0
# a site graph's rebuild estimated at this many times the last one's lowering (its first
# instantiation added: 1.4-1.7x the lowering on sdpoint, benchmarks/results/site_build_growth.md)
SITE_REBUILD_FACTOR = 1.5


def takes_site_graph(read_restarts: int, wasted_s: float, path_builds_s: float) -> bool:
    """Whether a site with `site_graph="auto"` takes a site graph: `read_restarts` restarts after
    a read threw away `wasted_s` of graph time Python had waited for; its compiled paths' own
    graphs took `path_builds_s` to build."""
    return read_restarts >= READ_RESTARTS and wasted_s >= SITE_BUILD_FACTOR * path_builds_s


def rebuilds_site_graph(read_restarts: int, wasted_s: float, last_lowering_s: float) -> bool:
    """Whether an "auto" site graph is rebuilt over paths compiled since it was built: the
    `read_restarts` restarts after a read that involved a path outside it since then threw
    away `wasted_s` of graph time; the last site graph took `last_lowering_s` to lower."""
    return read_restarts >= READ_RESTARTS and \
        wasted_s >= SITE_REBUILD_FACTOR * last_lowering_s


def compiled(site) -> bool:
    return any(p.graph is not None for p in site.paths.values())


def _alone(path) -> bool:
    """Whether `path` runs a graph of its own: no shape group, or a speculative one that no
    second path has joined (shape_groups.speculate): a bet on it is a path graph's."""
    return path.group is None or path.group.speculative


def unused_once(site, number) -> int:
    """Graphs of the site built at their path's first sighting that were bad bets by iteration
    `number`: not served in the FIRST_SIGHT_WINDOW iterations since, or first served more than
    RARE_GAP iterations after the path was first seen (a bet that paid late stays counted)."""
    return sum(1 for p in site.paths.values()
               if p.built_count == 1 and _alone(p) and
               (number - p.first_seen >= FIRST_SIGHT_WINDOW if p.first_hit is None
                else p.first_hit - p.first_seen > RARE_GAP))


def late_once(site) -> int:
    """Paths first seen after the site compiled, seen once, never served (built or not)."""
    return sum(1 for p in site.paths.values()
               if p.late and p.count == 1 and not p.hits and _alone(p))


def due(site, path, number) -> bool:
    """Whether `path`, just filed at iteration `number`, has its graph built now."""
    if not compiled(site):
        return path.count >= 2
    if unused_once(site, number) < FIRST_SIGHT_UNUSED or path.count >= RARE_SIGHTINGS:
        return True
    return path.count >= 2 and path.last_seen - path.first_seen <= RARE_GAP * (path.count - 1)


@dataclass(frozen=True)
class Tally:
    """What the give-up rules weigh, counted once per filed trace."""
    builds: int
    hits: int               # iterations the site's graphs served
    fallbacks: int          # fallbacks held against max_fallbacks (not the known ones)
    late_once: int
    unused_members: int     # shapes traced once each on a shape group's graph, never served
    max_traces: int
    max_fallbacks: int

    @classmethod
    def of(cls, site, max_traces: int, max_fallbacks: int) -> "Tally":
        paths = site.paths.values()
        return cls(site.builds, sum(p.hits for p in paths),
                   site.fallbacks - site.known_fallbacks, late_once(site),
                   sum(1 for p in paths if not _alone(p) and p.count == 1 and not p.hits),
                   max_traces, max_fallbacks)


@dataclass(frozen=True)
class Rule:
    """One way a site gives up: `fires` on a tally, `says` why (a phrase of explain())."""
    name: str
    fires: Callable[[Tally], bool]
    says: Callable[[Tally], str]


_CHANGING = ": its paths keep changing"
GIVE_UP = (
    # paths seen once after the site compiled when no graph of it ever served an iteration say
    # early that its paths keep changing; paths seen twice (a few branches or lengths in turn)
    # do not count, nor does a site whose graphs run at times
    Rule("churn", lambda t: t.late_once >= CHURN_PATHS and not t.hits,
         lambda t: f"{t.builds} graph builds and {t.late_once} paths seen once since it "
                   f"compiled served no compiled iteration" + _CHANGING),
    # a shape group's member costs a trace, not a build: a few more lengths may come before the
    # first repeats (lengths drawn from a range), but never-repeating ones give up too
    Rule("shapes", lambda t: t.unused_members >= t.max_traces and not t.hits,
         lambda t: f"{t.unused_members} shapes traced once each on a shape group's graph "
                   f"served no compiled iteration" + _CHANGING),
    Rule("builds", lambda t: t.builds >= max(BUILDS_PER_TRACE_LIMIT * t.max_traces, t.hits + 1),
         lambda t: f"{t.builds} graph builds, the limit of {BUILDS_PER_TRACE_LIMIT} x "
                   f"max_traces, for {t.hits} compiled iterations" + _CHANGING),
    # while its graphs serve more iterations than it falls back, a site's fallbacks are the
    # price of its rarer paths, not a sign that compiling it does not pay
    Rule("fallbacks", lambda t: t.fallbacks >= max(t.max_fallbacks, t.hits),
         lambda t: f"{t.fallbacks} fallbacks"),
)


def give_up(tally: Tally) -> tuple[str, str] | None:
    """(rule name, why) of the first rule of GIVE_UP that fires, or None."""
    for rule in GIVE_UP:
        if rule.fires(tally):
            return rule.name, rule.says(tally)
    return None
