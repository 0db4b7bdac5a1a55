"""Switch-case fusion: neighbouring top-level switch-cases that one select drives become one.

The merge shares every op the paths agree on, so where the paths differ only in a few ops (the
variable reads and writes of one head's optimizer update, one resize among shared convolutions)
Algorithm 1 cuts the stretch into many switch-cases separated by short shared blocks: a random
head among three made 25 `Case` ops per step. When each of those switch-cases takes its case
from one select (its own, or `derived_selects`' table of it), the stretch from the first to the
last can be one `switch_case` on that select whose branch v runs, in order, each member's case
for v and a copy of each shared block between them (tail duplication). The copies cost graph
size only, so a shared block is copied only while it is small (`max_shared` nodes, a loop
counted with its body).
In a commit-gated graph a `Case` op that writes waits for the commit as a whole, so a run never
joins ops that write with ops that can fail (the graph would not be gated, compiler/commit.py)
or with fetches (Python's read would wait for the commit).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Run", "fused_runs", "case_for"]


@dataclass(frozen=True, slots=True)
class Run:
    """Top-level switch-cases `members` (indices, in order) emitted as one `switch_case` on the
    select of `driver` (a member or an earlier switch-case); `width` branches."""
    driver: int
    members: tuple
    width: int

    def __repr__(self) -> str:
        return (f"Run(s{self.members[0] + 1}..s{self.members[-1] + 1} on s{self.driver + 1}, "
                f"{self.width} branches)")


def case_for(plan, derived: dict, top, driver: int, k: int, v: int):
    """The case index switch-case `k` takes when `driver`'s select is `v` (a member without a
    switch-case op has one case), or None where it takes none (the default branch)."""
    n = len(plan.switch_cases[k].cases)
    if not plan.has_op[k]:
        return 0 if n else None
    c = v if k == driver else derived[(top, k)][1][v]
    return c if c < n else None


def fused_runs(plan, derived: dict, top, size_of, max_shared: int, kind_of=None) -> tuple:
    """The runs of two or more switch-case ops sharing a driver, separated only by inline
    switch-cases of at most `max_shared` nodes in all (`size_of(k)`: that many nodes, or None
    where the block must not be copied). `derived`: `derive_selects`' table.
    `kind_of(k)`: (writes, can fail or is fetched) of switch-case k's ops, where the graph is
    gated."""
    if max_shared <= 0:
        return ()

    def driver_of(k):
        d = derived.get((top, k))
        return k if d is None else d[0]

    def kind(ks):
        if kind_of is None:
            return False, False
        kinds = [kind_of(k) for k in ks]
        return any(w for w, _ in kinds), any(f for _, f in kinds)

    runs, cur, pending, shared = [], None, [], 0
    for k, has_op in enumerate(plan.has_op):
        if not has_op:
            size = size_of(k)
            if cur is not None:
                shared = shared + size if size is not None else max_shared + 1
                pending.append(k)
                if shared > max_shared:
                    runs.append(cur)
                    cur, pending, shared = None, [], 0
            continue
        d = driver_of(k)
        if cur is not None and cur[0] == d and kind(cur[1] + pending + [k]) != (True, True):
            cur[1].extend(pending + [k])
        else:
            if cur is not None:
                runs.append(cur)
            cur = (d, [k])
        pending, shared = [], 0
    if cur is not None:
        runs.append(cur)
    out = []
    for d, members in runs:
        if sum(plan.has_op[k] for k in members) >= 2:
            width = len(plan.switch_cases[d].cases) + (1 if plan.default[d] else 0)
            out.append(Run(d, tuple(members), width))
    return tuple(out)
