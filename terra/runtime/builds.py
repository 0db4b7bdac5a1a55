"""The graphs of compiled paths: build one (on the program's thread, or on the builder thread
with `background_builds`, builder.py), or run another path's graph over this path's variables;
install a finished build at an iteration boundary; and, with `site_graph`, the site's one
lowered graph over its compiled paths.

`Builds` is handed what it reports to (the session's counters, event log, list of graphs, its
table of sites, the way into Terra's own TF calls, and how a site gives up); it never reaches
back into the session.
"""
from __future__ import annotations

import time

from terra.config import CONFIG
from terra.runtime.builder import Builder
from terra.runtime.fallback import Snapshot, written_variables
from terra.runtime.path_graph import PathGraph
from terra.runtime.path_view import PathView
from terra.runtime.site_graph import SiteGraph
from terra.runtime.sites import variable_renaming

__all__ = ["Builds"]


class Builds:
    def __init__(self, *, sites: dict, counters, graphs: list, event, internal, go_eager):
        self.sites = sites
        self.counters = counters
        self.graphs = graphs        # every graph built (drained after a failed run)
        self.event = event          # event(kind, site, iteration number, detail)
        self.internal = internal    # context: Terra's own TF calls, not intercepted
        self.go_eager = go_eager    # go_eager(site, iteration number, reason)
        self.builder = Builder()    # graphs built off the critical path

    def build(self, site, path, number):
        """Give `path` a graph: another path's over its variables, or its own, built here or
        (`background_builds`) submitted to the builder."""
        if self.builder.building(path):  # installed (and built again if stale by then) later
            return
        t = time.perf_counter()
        with self.internal():
            if path.view is None:
                path.view = PathView(path.trace, path.usable_units(), site.key, site.caller_step_try)
            if path.snapshot is None:
                path.snapshot = Snapshot.of(written_variables(path.trace))
            shared = self.reuse(site, path)
            if shared is not None:
                path.built_for = path.build_key()
                self.counters.graph_reuses += 1
                self.event("graph_reuse", site, number, f"path p{path.id} runs the graph of "
                           f"p{shared.id} over its own variables (the same ops on new "
                           f"variable objects), {time.perf_counter() - t:.3f} s")
                return
            if CONFIG.background_builds:
                self.builder.submit(site, path, number, PathGraph)
                return
            graph = PathGraph(path)
        self.install(site, path, graph, path.build_key(), number, time.perf_counter() - t)

    def install(self, site, path, graph, key, number, seconds, where="") -> None:
        """`graph`, built for the path state `key`, becomes `path`'s."""
        graph.path = path
        path.graph = graph
        path.built_for = key
        self.graphs.append(graph)
        self.counters.graph_builds += 1
        site.builds += 1
        self.event("graph_build", site, number,
                   f"graph for path p{path.id}: {len(path.trace.records)} ops, "
                   f"{len(graph.feed_channels)} feeds, {len(graph.fetch_channels)} "
                   f"fetches, {len(graph.liveouts)} outputs, "
                   + (f"XLA scopes over {graph.xla_spans} compute spans, "
                      if graph.xla_spans else "")
                   + f"{seconds:.2f} s{where}")
        self.site_graph(site, number)

    def install_finished(self) -> None:
        """Put the graphs the builder has finished in place (at an iteration boundary). A build
        that raised leaves its site eager, saying why."""
        for job in self.builder.finished():
            site, path = job.site, job.path
            if self.sites.get(site.key) is not site or site.eager_reason is not None:
                continue  # the session was reset, or the site has given up meanwhile
            error = job.future.exception()
            if error is not None:  # a build that fails is Terra's gap: the site runs eagerly
                self.go_eager(site, job.number, f"building the graph of path p{path.id} "
                              f"raised {type(error).__name__}: {error}")
                continue
            graph = job.future.result()
            job.merge_into(path)
            self.install(site, path, graph, job.inputs.build_key(), job.number, job.seconds,
                         f" on the builder thread, installed at iteration "
                         f"{self.counters.iterations + 1}")
            if path.stale:  # it learned a fetch while its graph was being built
                self.build(site, path, self.counters.iterations)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the graphs being built and install them (see `terra.wait_builds`)."""
        done = self.builder.wait(timeout)
        with self.internal():
            self.install_finished()
        return done

    @staticmethod
    def reuse(site, path):
        """A compiled path of `site` whose graph `path` can run over its own variables
        (`variable_renaming`; the graph was built for the same fetches and outputs): bound to
        `path` and returned; None if there is none."""
        key = path.build_key()
        for q in site.paths.values():
            if q is path or q.graph is None or q.stale or q.graph.path is not q or \
                    q.built_for != key:
                continue
            renaming = variable_renaming(q.trace, path.trace)
            if renaming is not None and q.graph.bind(path, renaming):
                return q
        return None

    def site_graph(self, site, number) -> None:
        """(Re)build the site's SiteGraph over its compiled paths when there are two or more
        (one path keeps its cheaper PathGraph). A lowering that fails leaves the site on
        PathGraphs (said in explain())."""
        if not CONFIG.site_graph:
            return
        paths = [p for p in site.paths.values() if p.graph is not None and not p.stale and
                 p.view is not None]
        if len(paths) < 2:
            return
        key = SiteGraph.key_of(paths)
        if site.site_graph is not None and site.site_graph.built_for == key or \
                site.site_graph_failed == key:
            return
        gated = [p for p in paths if p.graph.gate_channels]
        if gated:  # the site graph's lowering has no gates: each path keeps its own graph
            site.site_graph, site.site_graph_failed = None, key
            self.event("graph_build", site, number, f"no site graph: path p{gated[0].id} "
                       "skips a unit only after checking a shape its graph does not know "
                       "(a gate the site graph lacks); paths switch by restarting")
            return
        try:
            with self.internal():
                sg = SiteGraph(paths)
        except Exception as e:  # noqa: BLE001 - the PathGraphs still run every path
            site.site_graph_failed = key
            self.event("graph_build", site, number, f"no site graph for {len(paths)} paths: "
                       f"{type(e).__name__}: {str(e)[:200]}; paths switch by restarting")
            return
        site.site_graph = sg
        self.graphs.append(sg)
        self.counters.graph_builds += 1
        self.event("graph_build", site, number, f"site graph (switch_case / while_loop) for "
                   f"{sg.describe()}, {sg.build_seconds:.2f} s; branches switch without a "
                   f"restart")
