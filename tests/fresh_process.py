"""Run one test in an interpreter of its own (`in_fresh_process`).

For the tests of Ctrl-C handling, which send a simulated SIGINT (`_thread.interrupt_main`) to
the main thread: in two of three full-suite runs on 2026-11-26 those interrupts stopped reaching
the main thread of the long-lived test process after the tests before them (Python's default
handler installed, yet never called; a fetch then waited out its 300 s bound), while every run
of the same tests alone, or after any subset of the suite tried, passed. The cause was not
found. A process of their own makes them independent of what earlier tests left behind.
"""
from __future__ import annotations

import os
import subprocess
import sys

_FLAG = "TERRA_TEST_FRESH_PROCESS"


def in_fresh_process(request) -> bool:
    """In the suite's process: run this test alone in a new `python -m pytest`, assert that it
    passed there, and return True (the caller returns). In that new process: return False (the
    caller runs the test's body)."""
    nodeid = request.node.nodeid
    if os.environ.get(_FLAG) == nodeid:
        return False
    env = dict(os.environ, **{_FLAG: nodeid})
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", nodeid],
                         cwd=str(request.config.rootpath), env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and "1 passed" in out.stdout, \
        f"{nodeid} in a fresh process:\n{out.stdout[-4000:]}\n{out.stderr[-2000:]}"
    return True
