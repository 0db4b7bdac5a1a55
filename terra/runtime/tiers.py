"""Two tiers of a new graph's instantiation: its first runs without Grappler, the rest with it.

A function's first call instantiates it, and with Grappler that is most of the cost: on
sdpoint's path graphs (1,350 ops) 120-210 ms against 45-85 ms without it. A new path's first
run waits for it on the program's critical path (the step after a fallback stalls on it). So a
new graph is first warmed, and run, with Grappler's meta optimizer off (`quick`), while a
second thread (`terra-tier-up`) instantiates it with the configured rewrites; runs started
after that use the optimized instantiation (TF keeps one per ConfigProto). Both tiers compute
what eager computes: Grappler off is the setting `grappler=False`, which the equality tests run
too. Off by default (`tiered_instantiation`): on 2 cores the second thread's instantiation
takes the CPU back from the program (docs/usage.md).

The tier-up thread only instantiates (under a manager already cancelled, as `GraphRunner.warm`
does: no op runs, nothing is consumed). It is joined at interpreter exit (ThreadPoolExecutor's
exit hook) and by `Session.reset`.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from terra import _tf_private as tfp

__all__ = ["Tiers"]


def quick(config):
    """`config` (a ConfigProto mutator or None) with Grappler's meta optimizer off."""
    def mutate(proto):
        if config is not None:
            config(proto)
        tfp.disable_grappler(proto)
    mutate.terra_quick_of = config
    return mutate


class Tiers:
    """Starts a graph on the quick tier and tiers it up in the background (module docstring)."""

    def __init__(self, runner, warm):
        self.runner = runner     # whose `_instantiate` does the optimized instantiation
        self.warm = warm         # runner.warm: queues an instantiation between runs
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.pending = 0         # graphs started quick, not yet tiered up
        self.tiered_up = 0

    def start(self, graph) -> None:
        """Warm `graph` quick on the runner and submit its optimized instantiation: its runs
        read `graph.run_config`, quick until that instantiation has finished."""
        optimized = graph.run_config
        graph.run_config = quick(optimized)
        self.warm(graph.concrete, graph.run_config)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="terra-tier-up")
            self.pending += 1
        self._pool.submit(self._tier_up, graph, optimized)

    def _tier_up(self, graph, optimized) -> None:
        try:
            self.runner.instantiate(graph.concrete, optimized)
            graph.run_config = optimized  # runs started from now on use it
            with self._lock:
                self.tiered_up += 1
        finally:
            with self._lock:
                self.pending -= 1

    def wait(self) -> None:
        """Wait until every submitted tier-up has ended (tests, benchmarks)."""
        with self._lock:
            pool = self._pool
        if pool is not None:
            pool.submit(lambda: None).result()

    def shutdown(self) -> None:
        """Let the instantiation in flight end, drop the queued ones (their graphs stay quick),
        stop the thread."""
        with self._lock:
            pool, self._pool = self._pool, None
            self.pending = 0
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
