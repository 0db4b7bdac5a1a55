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

import tensorflow as tf

from terra.compiler.shapes import unknown_shapes
from terra.config import CONFIG
from terra.tracing.gc_window import widened
from terra.runtime import policy
from terra.runtime.builder import Builder
from terra.runtime.fallback import Snapshot, written_variables
from terra.runtime.path_graph import PathGraph, skip_fetch_points
from terra.runtime.path_view import PathView
from terra.runtime.shape_groups import (Relaxed, ShapeGroup, covers_open, derive,
                                        member_values, relax, rules_hold, speculate)
from terra.runtime.site_graph import SiteGraph, joined_order, site_paths, site_trace
from terra.runtime.sites import (Path, reads_feed_values, renamed_path,
                                 variable_renaming)

__all__ = ["Builds"]


class Builds:
    def __init__(self, *, sites: dict, counters, graphs: list, event, internal, go_eager,
                 warm=None, tiers=None):
        self.sites = sites
        self.counters = counters
        self.graphs = graphs        # every graph built (drained after a failed run)
        self.event = event          # event(kind, site, iteration number, detail)
        self.internal = internal    # context: Terra's own TF calls, not intercepted
        self.go_eager = go_eager    # go_eager(site, iteration number, reason)
        self.builder = Builder()    # graphs built off the critical path
        # warm(fn, config): instantiate a new graph's function ahead of its first run
        # (GraphRunner.warm), while the program's thread goes on
        self.warm = warm
        self.tiers = tiers          # tiers.Tiers: first runs without Grappler (tiers.py)

    def build(self, site, path, number, reuse_only=False):
        """Give `path` a graph: another path's over its variables, or its own, built here or
        (`background_builds`) submitted to the builder; with `reuse_only`, only another's."""
        if path.group is not None:
            self.build_group(site, path.group, number)
            return
        if self.builder.building(path):  # installed (and built again if stale by then) later
            return
        t = time.perf_counter()
        shared_graph = False
        with self.internal(), widened(CONFIG.tracing_gc_threshold):
            shared = self.reuse(site, path)
            if shared is None and reuse_only:
                return
            if path.view is None:
                path.view = PathView(path.trace, path.usable_units(), site.key, site.caller_step_try,
                                     path.wanted())
            if path.snapshot is None:
                path.snapshot = Snapshot.of(written_variables(path.trace))
            if shared is not None:
                path.built_for = path.build_key()
                self.counters.graph_reuses += 1
                self.event("graph_reuse", site, number, f"path p{path.id} runs the graph of "
                           f"p{shared.id} over its own variables (the same ops on new "
                           f"variable objects), {time.perf_counter() - t:.3f} s")
                shared_graph = True
            if not shared_graph:
                if self._speculate(site, path, number):
                    return  # (its group's graph: built here, or submitted to the builder)
                if CONFIG.background_builds:
                    self.builder.submit(site, path, number, PathGraph)
                    return
                graph = PathGraph(path)
        if shared_graph:  # a path of the site graph too: its branch is its variables'
            self.site_graph(site, number)
            return
        self.install(site, path, graph, path.build_key(), number, time.perf_counter() - t)

    def by_role(self, site, path, number, roles):
        """`path`, or, where the program has made its variables anew since (a metric made every
        epoch: roles.py), `path` over the new ones running the same graph. Checked only when
        variables were made since `path` was last checked."""
        if path.roles_seen == roles.seq:
            return path
        path.roles_seen = roles.seq
        with self.internal():
            new = roles.superseding(path.trace.variables)
            if not new:
                return path
            q = renamed_path(path, new, id=site.new_path_id())
            known = site.paths.get(q.signature)
            if known is not None:
                return known if known.graph is not None and not known.stale else path
            q.roles_seen = roles.seq
            t = time.perf_counter()
            if path.graph is None or self.reuse(site, q) is None:
                return path
            q.view = PathView(q.trace, q.usable_units(), site.key, site.caller_step_try,
                              q.wanted())
            q.snapshot = Snapshot.of(written_variables(q.trace))
            q.built_for = q.build_key()
        site.paths[q.signature] = q
        if path.by_role:
            # the path two generations back: its variables are no longer the program's (the
            # previous generation stays, for a program that still uses it); filed, it would
            # keep them alive (one path per epoch)
            if path.parent is not None:
                site.paths.pop(path.parent.signature, None)
            path.parent, q.parent = None, path
        self.counters.graph_reuses += 1
        self.counters.role_renames += 1
        self.event("graph_reuse", site, number, f"path p{q.id} is p{path.id} over "
                    f"{len(new)} variable(s) made anew in the same place: predicted on the graph "
                    f"of p{path.id} before the iteration, {time.perf_counter() - t:.3f} s")
        return q

    # ------------------------------------------------------------------ shape groups
    def _speculate(self, site, path, number) -> bool:
        """Build `path`'s graph as a shape group of one (`speculation`, shape_groups.speculate):
        a path of a site that has taken another compilable path before (its steps vary), whose
        image size a later step may change too (a ratio drawn per step). The path with the
        other size then joins the group at its first trace with no build (`join_group`),
        instead of a group built for both then. A site with one path so far (a static resize)
        keeps its sizes constant in its graph."""
        if not (CONFIG.speculation and CONFIG.shape_groups) or \
                path.why_uncompilable() or reads_feed_values(path.units) or \
                not any(q is not path and not q.why_uncompilable()
                        for q in site.paths.values()):
            return False
        relaxed = speculate(path.trace)
        if relaxed is None:
            return False
        g = ShapeGroup(len(site.shape_groups), relaxed, Path(path.signature, relaxed.trace,
                       path.units, id=-1), frozenset(), speculative=True)
        site.shape_groups.append(g)
        self._add_member(g, path, member_values(relaxed, path.trace))
        path.built_count = path.built_count or path.count
        self.counters.speculations += 1
        self.event("trace", site, number, f"path p{path.id} resizes by a constant Python "
                   f"computed: its graph is shape group g{g.id}'s ({g.dims()}), built for "
                   f"the sizes a later path may take")
        self.build_group(site, g, number)
        return True

    def join_group(self, site, path, number) -> str | None:
        """File new path `path` in a shape group of `site` (shape_groups.py): one whose relaxed
        trace covers it runs it on the group's graph at once (no build); one it relaxes further
        is rebuilt; or a new group with another compilable path is built. Returns "reuse" or
        "build"; None if `path` differs from every other path in more than shapes."""
        if self.builder.building(path) or path.why_uncompilable() or \
                reads_feed_values(path.units):
            return None
        for g in site.shape_groups:
            relaxed = relax(g.relaxed, path.trace)
            values = None if relaxed is None else member_values(relaxed, path.trace)
            if values is None:
                continue
            # (a unit the graph gates must be one the member skips whole: it opens the gate)
            covered = (relaxed.trace.records == g.relaxed.trace.records and
                       [f.spec for f in relaxed.trace.feeds] ==
                       [f.spec for f in g.relaxed.trace.feeds] or
                       g.speculative and g.graph is not None and
                       covers_open(g.graph, g.relaxed, relaxed)) and \
                g.graph is not None and set(g.graph.gate_channels) <= set(path.usable_units()) \
                and rules_hold(g.derived, relaxed, path.trace)
            if covered and g.graph is not None and not self._group_stale(g):
                if g.speculative:  # a second member, which the graph runs: the group is real
                    g.relaxed, g.speculative = relaxed, False
                    g.path.trace = relaxed.trace
                    self.counters.speculation_hits += 1
                self._add_member(g, path, values)
                t = time.perf_counter()
                with self.internal():
                    self._attach(site, g, path)
                self.counters.graph_reuses += 1
                self.event("graph_reuse", site, number, f"path p{path.id} runs the graph of "
                           f"shape group g{g.id} ({g.dims()}): no build, "
                           f"{time.perf_counter() - t:.3f} s")
                return "reuse"
            g.relaxed, g.speculative = relaxed, False
            self._add_member(g, path, values)
            self.build_group(site, g, number)
            return "build"
        for q in site.paths.values():
            if q is path or q.group is not None or q.why_uncompilable() or \
                    reads_feed_values(q.units):
                continue
            relaxed = relax(Relaxed(q.trace, {}), path.trace)
            if relaxed is None:
                continue
            vq, vp = member_values(relaxed, q.trace), member_values(relaxed, path.trace)
            if vq is None or vp is None:
                continue
            t = time.perf_counter()
            with self.internal():
                own = q.graph if q.graph is not None and q.graph.path is q else None
                unknown = own.unknown_shapes if own is not None else unknown_shapes(q.trace)
            g = ShapeGroup(len(site.shape_groups), relaxed, Path(q.signature,
                           relaxed.trace, q.units, id=-1), unknown)
            site.shape_groups.append(g)
            self._add_member(g, q, vq)
            self._add_member(g, path, vp)
            self.event("trace", site, number, f"paths p{q.id} and p{path.id} differ only in "
                       f"shapes: shape group g{g.id} ({g.dims()}), shapes inferred in "
                       f"{time.perf_counter() - t:.2f} s")
            self.build_group(site, g, number)
            return "build"
        return None

    @staticmethod
    def _add_member(g, path, values) -> None:
        path.group, path.group_values = g, values
        if path not in g.members:
            g.members.append(path)
        for m in g.members:  # slots added since a member joined (the relaxed trace grew)
            if m is not path:
                m.group_values = member_values(g.relaxed, m.trace)

    @staticmethod
    def _group_stale(g) -> bool:
        return g.graph is None or any(m.built_for != m.build_key() for m in g.members)

    def _attach(self, site, g, m) -> None:
        if m.view is None:
            m.view = PathView(m.trace, m.usable_units(), site.key, site.caller_step_try,
                              m.wanted())
        if m.snapshot is None:
            m.snapshot = Snapshot.of(written_variables(m.trace))
        m.graph = g.graph
        m.rebound = None
        m.built_for = m.build_key()
        m.group_tensors = tuple(tf.constant(m.group_values[s]) for s in g.graph.bundled)

    def build_group(self, site, g, number) -> None:
        """(Re)build the graph of shape group `g` from its relaxed trace, fetching what any
        member reads, and put every member on it. A speculative group's first graph (one
        member, built at that path's first build) is submitted to the builder with
        `background_builds`; a group of two or more members is built here."""
        background = CONFIG.background_builds and g.speculative
        if background and self.builder.building(g.path):
            return  # (installed, and built again for members whose fetches grew, later)
        t = time.perf_counter()
        with self.internal(), widened(CONFIG.tracing_gc_threshold):
            gp = g.path
            gp.trace = g.relaxed.trace
            gp.__dict__["group_of"] = g  # (its name in a site graph's explain() line)
            gp.__dict__.pop("static", None)
            fetch_points, liveouts, shape_reads = {}, set(), {}
            for m in g.members:
                if m.view is None:
                    m.view = PathView(m.trace, m.usable_units(), site.key, site.caller_step_try,
                                      m.wanted())
                if m.static.unknown_pending():  # structural: the same for every member
                    m.static.assume_unknown(g.unknown)
                for ref, after in skip_fetch_points(m).items():
                    fetch_points[ref] = min(after, fetch_points.get(ref, after))
                liveouts |= m.liveouts
                for ref, after in m.shape_reads.items():
                    shape_reads[ref] = min(after, shape_reads.get(ref, after))
            # units every member skips whole: the graph may gate only those (a member that
            # matches a unit's ops one by one never opens its gate); a fallback inside a unit
            # leaves that unit out of its trace
            units = [m.usable_units() for m in g.members]
            gp.units = {s: u for s, u in units[0].items()
                        if all((o.get(s) or u).end == u.end and s in o for o in units[1:])}
            # (its view's eager twins come from what it wants: set that first)
            gp.fetch_points, gp.outside_reads, gp.liveouts = fetch_points, set(fetch_points), liveouts
            gp.shape_reads = shape_reads
            gp.twin_misses = {r for m in g.members for r in m.twin_misses}
            gp.view = PathView(gp.trace, gp.units, site.key, site.caller_step_try,
                               gp.wanted())
            # a value the graph leaves to an eager twin must be one every member's skip mode
            # runs as a twin (each member's view wants its own values): else that member's
            # read of it would find neither a twin's value nor a fetch
            for m in g.members:
                for r, after in m.fetch_points.items():
                    if r.record in gp.view.twins and any(
                            q.view is not None and r.record not in q.view.twins
                            for q in g.members):
                        gp.twin_misses.add(r)
                        gp.outside_reads.add(r)
                        fetch_points[r] = min(after, fetch_points.get(r, after))
            # constants the graph computes from the shapes it holds are put by no member (a
            # speculative group's one member puts all of its own: speculate)
            if not g.speculative:
                g.derived = derive(g.relaxed, [m.trace for m in g.members])
            bundled = sorted(set(g.relaxed.const_sites) - set(g.derived))
            if background:
                unknown, derived = g.unknown, g.derived
                job = self.builder.submit(site, gp, number, lambda inputs: PathGraph(
                    inputs, unknown=unknown, derived=derived, bundled=bundled))
                job.group = g
                job.member_keys = {id(m): m.build_key() for m in g.members}
                return
            graph = PathGraph(gp, unknown=g.unknown, derived=g.derived, bundled=bundled)
            graph.path = gp
            g.graph = gp.graph = graph
            for m in g.members:
                self._attach(site, g, m)
        graph.build_seconds = time.perf_counter() - t
        self._built(graph, site)
        self.counters.graph_builds += 1
        site.builds += 1
        self.event("graph_build", site, number,
                   f"graph for shape group g{g.id} (paths "
                   f"{', '.join(f'p{m.id}' for m in g.members)}; {g.dims()}): "
                   f"{len(gp.trace.records)} ops, {len(graph.feed_channels)} feeds, "
                   f"{len(graph.fetch_channels)} fetches, {time.perf_counter() - t:.2f} s")
        self.site_graph(site, number)

    def install(self, site, path, graph, key, number, seconds, where="") -> None:
        """`graph`, built for the path state `key`, becomes `path`'s."""
        graph.path = path
        graph.build_seconds = seconds
        path.graph = graph
        path.built_for = key
        path.built_count = path.built_count or path.count
        self._built(graph, site)
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

    def _built(self, graph, site) -> None:
        """Keep `graph` and have it instantiated ahead of its first run: a site's first graph
        with the configured rewrites; a later one (a new path of a site that runs graphs
        already, whose first run the program would wait for) quick, tiered up meanwhile
        (tiers.py). A static program's one graph is not tiered: on gpt2 the quick tier's run
        and the concurrent instantiation made its first compiled steps slower, not faster."""
        self.graphs.append(graph)
        if self.warm is not None:
            with self.internal():
                if self.tiers is not None and CONFIG.grappler and \
                        CONFIG.tiered_instantiation and site.builds:
                    self.tiers.start(graph)
                else:
                    self.warm(graph.concrete, graph.run_config)

    def install_finished(self) -> None:
        """Put the graphs the builder has finished in place (at an iteration boundary). A build
        that raised leaves its site eager, saying why."""
        for job in self.builder.finished():
            site, path = job.site, job.path
            if self.sites.get(site.key) is not site or site.eager_reason is not None:
                continue  # the session was reset, or the site has given up meanwhile
            if path is None:
                self._install_site_graph(site, job)
                continue
            if job.group is not None:
                self._install_group(site, job)
                continue
            error = job.future.exception()
            if error is not None:  # a build that fails is Terra's gap: the site runs eagerly
                self.go_eager(site, job.number, f"building the graph of path p{path.id} "
                              f"raised {type(error).__name__}: {error}")
                continue
            if path.group is not None:
                # it joined a shape group while its own graph was built: the group's graph
                # serves it (a member's runs put the group's constants, which its own graph lacks)
                self.event("graph_build", site, job.number, f"the graph built for path "
                           f"p{path.id} on the builder thread is dropped: the path has joined "
                           f"shape group g{path.group.id} meanwhile, whose graph runs it")
                continue
            graph = job.future.result()
            job.merge_into(path)
            self.install(site, path, graph, job.inputs.build_key(), job.number, job.seconds,
                         f" on the builder thread, installed at iteration "
                         f"{self.counters.iterations + 1}")
            if path.stale:  # it learned a fetch while its graph was being built
                self.build(site, path, self.counters.iterations)

    def _install_group(self, site, job) -> None:
        """Put a speculative group's graph, built on the builder thread, in place: unless a
        second member has made the group real meanwhile (its graph, rebuilt for both, serves
        them). A member whose fetches grew during the build is built again."""
        g = job.group
        error = job.future.exception()
        if error is not None:
            self.go_eager(site, job.number, f"building the graph of shape group g{g.id} "
                          f"raised {type(error).__name__}: {error}")
            return
        if not g.speculative or g.path.trace is not job.inputs.trace:
            self.event("graph_build", site, job.number, f"the graph built for shape group "
                       f"g{g.id} on the builder thread is dropped: the group has changed "
                       f"meanwhile, and the graph built for it since runs its paths")
            return
        graph = job.future.result()
        gp = g.path
        job.merge_into(gp)
        graph.path = gp
        graph.build_seconds = job.seconds
        with self.internal():
            g.graph = gp.graph = graph
            for m in g.members:
                self._attach(site, g, m)
                m.built_for = job.member_keys.get(id(m), m.built_for)
        self._built(graph, site)
        self.counters.graph_builds += 1
        site.builds += 1
        self.event("graph_build", site, job.number,
                   f"graph for shape group g{g.id} (paths "
                   f"{', '.join(f'p{m.id}' for m in g.members)}; {g.dims()}): "
                   f"{len(gp.trace.records)} ops, {len(graph.feed_channels)} feeds, "
                   f"{len(graph.fetch_channels)} fetches, {job.seconds:.2f} s on the builder "
                   f"thread, installed at iteration {self.counters.iterations + 1}")
        self.site_graph(site, job.number)
        for m in g.members:
            if m.stale:  # it learned a fetch while the graph was being built
                self.build(site, m, self.counters.iterations)

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
        if not (CONFIG.site_graph is True or CONFIG.site_graph == "auto" and
                site.wants_site_graph):
            return
        paths = joined_order(site_paths(site), site.site_graph)
        if len(paths) < 2:
            return
        key = SiteGraph.key_of(paths)
        if site.site_graph is not None and site.site_graph.built_for == key or \
                site.site_graph_failed == key:
            return
        if self._keeps_site_graph(site, number, key, paths):
            return
        gated = [p for p in paths if p.graph.gate_channels]
        if gated:  # the site graph's lowering has no gates: each path keeps its own graph
            site.site_graph, site.site_graph_failed = None, key
            self.event("graph_build", site, number, f"no site graph: path p{gated[0].id} "
                       "skips a unit only after checking a shape its graph does not know "
                       "(a gate the site graph lacks); paths switch by restarting")
            return
        if CONFIG.background_builds:
            if not self.builder.building_site_graph(site):  # (else looked at again when done)
                traces = [site_trace(p) for p in paths]  # what the paths are now
                previous = site.site_graph
                self.builder.submit_site(site, number, key, lambda: SiteGraph(
                    paths, previous=previous, traces=traces, key=key))
            return
        try:
            with self.internal(), widened(CONFIG.tracing_gc_threshold):
                sg = SiteGraph(paths, previous=site.site_graph)
        except Exception as e:  # noqa: BLE001 - the PathGraphs still run every path
            self._no_site_graph(site, number, key, len(paths), e)
            return
        self._use_site_graph(site, number, sg)

    def _keeps_site_graph(self, site, number, key, paths) -> bool:
        """With site_graph="auto", whether the site graph in place stays as it is although the
        site's compiled paths changed (`policy.rebuilds_site_graph`): the paths outside it run
        their own graphs, a switch to or from one of them a restart."""
        sg = site.site_graph
        if CONFIG.site_graph != "auto" or sg is None or policy.rebuilds_site_graph(
                site.outside_restarts, site.outside_restart_s, sg.build_seconds):
            return False
        if site.site_graph_kept != key:  # (said once per set of paths)
            site.site_graph_kept = key
            outside = [f"p{p.id}" for p in paths if sg.plan_of(p) is None]
            who = (f"{', '.join(outside)} run their own graphs" if len(outside) > 1 else
                   f"{outside[0] if outside else 'a changed path'} runs its own graph")
            self.event("graph_build", site, number, f"site graph kept over {len(sg.paths)} "
                       f"paths: {who} until restarts after a read involving paths outside it "
                       f"have thrown away as much graph time as a rebuild costs (about "
                       f"{policy.SITE_REBUILD_FACTOR * sg.build_seconds:.2f} s)")
        return True

    def _no_site_graph(self, site, number, key, n, error) -> None:
        site.site_graph_failed = key
        self.event("graph_build", site, number, f"no site graph for {n} paths: "
                   f"{type(error).__name__}: {str(error)[:200]}; paths switch by restarting")

    def _use_site_graph(self, site, number, sg, where="") -> None:
        site.site_graph = sg
        site.outside_restarts, site.outside_restart_s = 0, 0.0
        self._built(sg, site)
        self.counters.graph_builds += 1
        self.event("graph_build", site, number, f"site graph (switch_case / while_loop) for "
                   f"{sg.describe()}, {sg.build_seconds:.2f} s{where}; branches switch "
                   f"without a restart")

    def _install_site_graph(self, site, job) -> None:
        """A site graph built on the builder thread: in use from the next iteration if the
        site's paths are still those it was built for; else the current ones are built."""
        error = job.future.exception()
        if error is not None:
            self._no_site_graph(site, job.number, job.key, len(job.key), error)
            return
        sg = job.future.result()
        paths = joined_order(site_paths(site), site.site_graph)
        if SiteGraph.key_of(paths) == job.key:
            self._use_site_graph(site, job.number, sg, f" on the builder thread, in use from "
                                 f"iteration {self.counters.iterations + 1}")
        else:  # a path changed meanwhile: build for what the site has now
            self.site_graph(site, self.counters.iterations)
