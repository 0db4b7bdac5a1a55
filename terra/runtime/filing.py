"""Filing a finished trace: which path of its site it belongs to (its signature, after
generalizing constants that changed between traces of one path into feeds), whether that
path's graph is built now (policy.due), and whether the site gives up (policy.GIVE_UP).

Why a separate room: this is the one decision the session makes per traced iteration, and it
reads only the site's data and the rules; the session hands in what it acts through.
"""
from __future__ import annotations

import functools

from terra import _tf_private as tfp
from terra.config import CONFIG
from terra.runtime import policy
from terra.runtime.explain import EventKind
from terra.runtime.generalize import generalize, read_changed_spans
from terra.runtime.held import held_refs
from terra.runtime.path_view import PathView
from terra.runtime.sites import (KNOWN_FALLBACK_GAP, KNOWN_REUSE_GAP, Path, borrowed_units, cut_trace,
                                 path_signature, reads_feed_values, state_tail, uncompilable,
                                 units_for)


class Filing:
    """Files traces for the session: `builds` (builds.py), the session's `counters`,
    `event(kind, site, number, detail)` and `go_eager(site, number, reason)`."""

    def __init__(self, *, builds, counters, event, go_eager):
        self._builds, self._counters = builds, counters
        self._event, self._go_eager = event, go_eager

    def file(self, it, last: bool = False) -> None:
        """File the trace `it` recorded (its recorder has stopped or is stopped here). `last`:
        no next iteration is known to come; what follows the filing waits for one."""
        rec = it.recorder
        trace = rec.stop()
        shape_reads = trace.shape_reads  # (a generalized trace below is made anew)
        live = held_refs(rec)
        rec.release()  # (the step's tensors: nothing reads them through the recorder now)
        self._counters.traces += 1
        site = it.site
        if not trace.records:
            # no TF op ran (the program raised, or skipped the step, before its first op): no
            # evidence about the site's paths, so nothing is filed and nothing counts against it
            self._event(EventKind.TRACE, site, it.number, "empty iteration (no TF op ran): not filed")
            return
        site.traces += 1
        units = units_for(trace, rec.units)
        why = uncompilable(trace, units)
        tail = ""
        cut = state_tail(trace, units) if why is not None else None
        if cut is not None:  # the program's work after the step (the next epoch's iterator)
            tail = f"; from op #{cut} ({trace.records[cut].op_type}) on, after the step: cut off"
            live = {r for r in live if r.record < cut} | \
                {f.ref for f in trace.fetches if f.ref.record < cut <= f.after_record}
            trace = cut_trace(trace, cut)
            shape_reads = trace.shape_reads
            units = {s: u for s, u in units.items() if u.end <= cut}
            why = uncompilable(trace, units)
        extra = borrowed_units(trace, units, site.paths.values())
        if extra:
            units = {**units, **units_for(trace, extra)}
            why = uncompilable(trace, units)
        sig = path_signature(trace, units)
        path = site.paths.get(sig)
        if path is None and why is None and not reads_feed_values(units):
            # the most general path first: its generalization keeps what it already feeds
            for other in sorted(site.paths.values(), key=lambda p: -len(p.trace.feeds)):
                if other.signature[2] != sig[2] or other.why_uncompilable() or \
                        reads_feed_values(other.units):
                    continue
                g = generalize(other.trace, trace, read_changed_spans(units, other.units))
                if g is not None:
                    trace = g
                    units = units_for(g, rec.units)
                    sig = path_signature(g, units)
                    path = site.paths.get(sig)
                    if path is None:
                        path = Path(sig, trace, units, id=site.new_path_id(), count=other.count,
                                    first_seen=other.first_seen, liveouts=set(other.liveouts),
                                    fetch_points=dict(other.fetch_points),
                                    outside_reads=set(other.outside_reads))
                        site.paths[sig] = path
                        self._event(EventKind.TRACE, site, it.number, f"path p{other.id} generalized "
                                    f"to p{path.id}: changing Python values become feeds")
                    break
        new = path is None
        if new:
            self._counters.new_paths += 1
            path = Path(sig, trace, units, id=site.new_path_id(), first_seen=it.number,
                        late=any(p.graph is not None for p in site.paths.values()))
            site.paths[sig] = path
        elif path.by_role:
            # predicted over new variables, now traced: its units' guards are this trace's (a
            # unit guarded on an object made anew with the variables, such as a task's optimizer)
            path.units, path.by_role, path.view = units, False, None
        path.absorb(trace, live, trace.fetches, site.seen_objects, shape_reads)
        path.last_seen = it.number
        for v in trace.feed_values:  # tensors seen as feeds: a unit may rely on TF's cached ones
            if isinstance(v, tfp.EagerTensorBase) and v.shape.num_elements() <= 64:
                site.seen_objects[id(v)] = v
        detail = (f"new path p{path.id} ({len(trace.records)} ops, {len(trace.feeds)} feeds)"
                  if new else f"path p{path.id} seen {path.count} times")
        detail += tail
        if why:
            detail += f"; not compilable: {why}"
        building = self._builds.builder.building(path)
        if building and it.fallback_gap is not None:
            # its graph is being built: the fallback is the cost of not waiting for it
            site.known_fallbacks += 1
            detail += "; its graph is being built: not held against max_fallbacks"
        elif not new and it.fallback_gap is not None and it.fallback_gap >= KNOWN_FALLBACK_GAP:
            # a path seen before, reached after a run of compiled iterations (an epoch's end):
            # a known, bounded cost per occurrence, so it does not count towards max_fallbacks
            site.known_fallbacks += 1
            detail += "; a known path after compiled iterations: not held against max_fallbacks"
        if last:
            detail += "; what follows its filing (its graph) waits for the site's next iteration"
        self._event(EventKind.TRACE, site, it.number, detail, "")
        decide = functools.partial(self._decide, site, path, fallback_gap=it.fallback_gap,
                                   new=new, why=why)
        if last:
            # no next iteration is known to come (`terra.end_iteration()`, `reset()`, the
            # owner thread's exit): a graph built now may never run (a training loop's last
            # step, which diverged into the program's reads after the loop). The decisions
            # wait for the site's next iteration, which makes them before predicting its path.
            site.deferred.append(decide)
            return
        decide(it.number)

    def _decide(self, site, path, number, *, fallback_gap, new, why) -> None:
        """After filing `path`: join a shape group, build its graph (policy.due), rebuild
        stale paths, note the path in the site's history, and decide whether the site gives up.
        `number`: the iteration deciding (the one that filed it, or the site's next one)."""
        if new and why is None and CONFIG.shape_groups and \
                self._builds.join_group(site, path, number) == "reuse" and \
                fallback_gap is not None:
            # a new shape on a group's graph costs this trace and no build: bounded per shape
            # (a site whose shapes never repeat gives up through the churn rule below)
            site.known_fallbacks += 1
        if why is None and path.stale and (path.count >= 2 or policy.compiled(site)):
            # a path not yet due for a build still takes another path's graph over its own
            # variables at once (no build: a task's model made anew); a compiled path that
            # learned a fetch is rebuilt at once
            due = path.graph is not None or policy.due(site, path, number)
            self._builds.build(site, path, number, reuse_only=not due)
            if new and path.rebound is not None and fallback_gap is not None and \
                    fallback_gap >= KNOWN_REUSE_GAP:
                site.known_fallbacks += 1  # a bounded cost per occurrence: see KNOWN_REUSE_GAP
        elif path.view is None and path.graph is not None:
            path.view = PathView(path.trace, path.usable_units(), site.key, site.caller_step_try,
                                 path.wanted())
        for other in list(site.paths.values()):
            # a compiled path that learned a fetch in this iteration (Iteration.get: a value
            # Python read where the path's graph did not fetch it) is rebuilt now: a stale path
            # is never predicted, and might never be traced again to be rebuilt
            if other is not path and other.graph is not None and other.stale:
                self._builds.build(site, other, number)
        if path.graph is not None:
            site.last_path = path
        site.note_path(path)
        if why is not None and path.count >= 2 and site.eager_reason is None and \
                site.predict() is None:
            self._go_eager(site, number, f"a repeating path cannot be compiled: {why}")
        if site.eager_reason is None and site.predict() is None and \
                site.traces >= CONFIG.max_traces and \
                id(site) not in self._builds.builder.sites_building():
            self._go_eager(site, number, f"{site.traces} traces without a compilable repeat"
                           + (f" (last: {why})" if why else ""))
        verdict = policy.give_up(policy.Tally.of(site, CONFIG.max_traces, CONFIG.max_fallbacks))
        if verdict is not None and site.eager_reason is None:
            self._go_eager(site, number, verdict[1])


__all__ = ["Filing"]
