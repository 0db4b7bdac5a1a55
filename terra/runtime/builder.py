"""Graph builds off the critical path (setting `background_builds`).

A path's graph (lowering, tracing its concrete function), a path's speculative shape group's
(a group of one, `speculation`), or a site's one graph over its paths (`site_graph`), is built
on one builder thread while the program goes on; the session installs a finished build at the
next iteration boundary (`Builds.install_finished`, builds.py), so no iteration sees a graph
appear under it. Until then the path's iterations run as they would have before it was
compiled: traced eagerly, or falling back from another path's graph. A shape group of two or
more members is built on the program's thread; a group of one still being built when a second
member joins it is dropped when done.

A build reads a copy of what the graph depends on (`BuildInputs`): the main thread goes on
filing traces into the path meanwhile, and a path that learned a fetch since its build was
submitted is built again when that build is installed. The hook intercepts only the thread that
runs the iterations, so the builder's own TF calls are never recorded.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from terra.config import CONFIG
from terra.tracing.gc_window import widened

__all__ = ["BuildInputs", "Builder", "Job"]


class BuildInputs:
    """What a path's graph is built from (`PathGraph` reads these and only these), copied from
    the path when its build is submitted. `PathGraph` may add fetch points (the values a unit's
    shape check reads); `Job.merge_into` hands them back to the path."""

    def __init__(self, path):
        self.trace = path.trace
        self.view = path.view
        self.units = dict(path.units)
        self.verified = set(path.verified)
        self.fetch_points = dict(path.fetch_points)
        self.outside_reads = set(path.outside_reads)
        self.shape_reads = dict(path.shape_reads)
        self.liveouts = set(path.liveouts)
        self.twin_misses = set(path.twin_misses)
        self.static = path.static
        self.id = path.id

    def usable_units(self) -> dict:
        return {s: u for s, u in self.units.items() if not u.feeds or s in self.verified}

    def build_key(self) -> tuple:
        return (frozenset(self.liveouts), frozenset(self.fetch_points),
                frozenset(self.outside_reads), frozenset(self.twin_misses))


@dataclass
class Job:
    """One submitted build: `future` gives the graph (or raises what the build raised)."""
    site: object
    path: object
    inputs: BuildInputs
    number: int                 # the iteration after which it was submitted
    future: Future
    submitted: float = field(default_factory=time.perf_counter)
    seconds: float = 0.0        # the build's own time on the builder thread
    key: tuple = ()             # a site graph's job (path None): what it was built for
    group: object = None        # a shape group's job (path its group's Path): the group
    member_keys: dict = field(default_factory=dict)  # its members' build keys when submitted

    def merge_into(self, path) -> None:
        """The fetch points the build added (reads of shapes the graph does not know)."""
        for ref, after in self.inputs.fetch_points.items():
            path.fetch_points.setdefault(ref, after)
        path.outside_reads |= self.inputs.outside_reads


class Builder:
    """One thread that builds graphs in submission order. Its thread is joined at interpreter
    exit (ThreadPoolExecutor's exit hook) before TF is torn down."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self.jobs: list[Job] = []   # submitted, not yet installed (submission order)

    def submit(self, site, path, number, build: Callable) -> Job:
        """Build `build(inputs)` for `path` on the builder thread."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="terra-builder")
        inputs = BuildInputs(path) if path is not None else None
        job = Job(site, path, inputs, number, Future())
        young = CONFIG.tracing_gc_threshold

        def work():
            t = time.perf_counter()
            try:
                with widened(young):
                    return build(inputs)
            finally:
                job.seconds = time.perf_counter() - t

        job.future = self._pool.submit(work)
        self.jobs.append(job)
        return job

    def submit_site(self, site, number, key, build: Callable) -> Job:
        """Build `build()` (a site's SiteGraph, over traces copied at submission) on the
        builder thread; `key` is what it was built for (`SiteGraph.key_of`)."""
        job = self.submit(site, None, number, lambda _inputs: build())
        job.key = key
        return job

    def building(self, path) -> bool:
        """Whether `path`'s graph is being built: its own, or its shape group's."""
        group = getattr(path, "group", None)
        mine = group.path if group is not None else path
        return any(j.path is path or j.path is mine for j in self.jobs)

    def building_site_graph(self, site) -> bool:
        return any(j.path is None and j.site is site for j in self.jobs)

    def sites_building(self) -> set:
        return {id(j.site) for j in self.jobs}

    def finished(self) -> list[Job]:
        """The jobs whose builds have ended (taken out of `jobs`), oldest first."""
        done = [j for j in self.jobs if j.future.done()]
        for j in done:
            self.jobs.remove(j)
        return done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every submitted build has ended; False if `timeout` passed first."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        for j in list(self.jobs):
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            try:
                j.future.exception(timeout=left)
            except TimeoutError:
                return False
        return True

    def shutdown(self) -> None:
        """Let the running build end, drop the queued ones, stop the thread."""
        for j in self.jobs:
            j.future.cancel()
        self.jobs = []
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
