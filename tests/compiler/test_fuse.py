"""compiler/fuse.py: which top-level switch-cases become one `switch_case` (pure function)."""
import pytest

from terra.compiler.case_assignment import Case, SwitchCase
from terra.compiler.fuse import Run, case_for, fused_runs
from terra.compiler.lower import TOP, LevelPlan


def _plan(spec, default=()):
    """spec: per switch-case, an int n (an op with n one-node cases) or a list (an inline block
    of those node ids)."""
    scs, has_op, nid = [], [], 100
    for item in spec:
        if isinstance(item, list):
            scs.append(SwitchCase((Case(tuple(item), ()),)))
            has_op.append(False)
        else:
            scs.append(SwitchCase(tuple(Case((nid + c,), ()) for c in range(item))))
            nid += item
            has_op.append(True)
    dflt = tuple(k in default for k in range(len(spec)))
    return LevelPlan(TOP, tuple(scs), tuple(has_op), dflt, {})


def _size(plan, loops=()):
    def size_of(k):
        block = plan.switch_cases[k].cases[0].block
        return None if set(block) & set(loops) else len(block)
    return size_of


def test_members_on_one_driver_fuse_across_small_shared_blocks():
    plan = _plan([3, [1, 2], 3, [3], 3])
    derived = {(TOP, 2): (0, (2, 0, 1)), (TOP, 4): (0, (0, 0, 1))}
    (run,) = fused_runs(plan, derived, TOP, _size(plan), 2)
    assert run == Run(0, (0, 1, 2, 3, 4), 3)
    # branch 0 runs case 0 of s1, the shared block, case 2 of s3, the shared one, case 0 of s5
    assert [case_for(plan, derived, TOP, 0, k, 0) for k in run.members] == [0, 0, 2, 0, 0]
    assert [case_for(plan, derived, TOP, 0, k, 2) for k in run.members] == [2, 0, 1, 0, 1]


def test_a_shared_block_over_the_limit_or_holding_a_loop_ends_the_run():
    plan = _plan([2, [1], 2, [2, 3, 4], 2, [5], 2])
    derived = {(TOP, k): (0, (0, 1)) for k in (2, 4, 6)}
    assert fused_runs(plan, derived, TOP, _size(plan), 2) == (Run(0, (0, 1, 2), 2),
                                                              Run(0, (4, 5, 6), 2))
    assert fused_runs(plan, derived, TOP, _size(plan), 3) == (Run(0, tuple(range(7)), 2),)
    # a loop is never copied: only s3..s5 (around the block of three) fuse
    assert fused_runs(plan, derived, TOP, _size(plan, loops=(1, 5)), 3) == (Run(0, (2, 3, 4), 2),)
    assert fused_runs(plan, derived, TOP, _size(plan), 0) == ()


def test_another_driver_starts_a_new_run_and_a_lone_op_is_no_run():
    plan = _plan([2, 2, [1], 2, 2, [2], 2])
    derived = {(TOP, 1): (0, (1, 0)), (TOP, 4): (3, (0, 1)), (TOP, 6): (0, (0, 1))}
    # s7 follows s1 but s4, s5 (another driver) stand between: it is a run of its own, not one
    assert fused_runs(plan, derived, TOP, _size(plan), 4) == (Run(0, (0, 1), 2),
                                                              Run(3, (3, 4), 2))


def test_a_run_after_its_driver_and_the_default_branch():
    plan = _plan([3, [1], 2, [2], 2], default=(0, 2, 4))
    derived = {(TOP, 2): (0, (0, 1, 1, 2)), (TOP, 4): (0, (1, 0, 0, 2))}
    (run,) = fused_runs(plan, derived, TOP, _size(plan), 1)
    assert run.width == 4 and run.members == (0, 1, 2, 3, 4)
    # select 3 is s1's default (the path ended before it): no member runs a case
    assert [case_for(plan, derived, TOP, 0, k, 3) for k in (0, 2, 4)] == [None, None, None]
    # a run whose driver is before it (s1 apart, over the limit) still reads s1's select
    plan = _plan([3, [1, 2, 3], 2, [4], 2], default=(0, 2, 4))
    (run,) = fused_runs(plan, derived, TOP, _size(plan), 1)
    assert run == Run(0, (2, 3, 4), 4)


@pytest.mark.parametrize("limit", [1, 16])
def test_fusion_never_crosses_an_unfusable_switch_case(limit):
    plan = _plan([2, 2, 2])
    assert fused_runs(plan, {}, TOP, _size(plan), limit) == ()


def test_a_gated_run_never_joins_writes_with_ops_that_can_fail():
    plan = _plan([2, [1], 2, [2], 2, [3], 2])
    derived = {(TOP, k): (0, (0, 1)) for k in (2, 4, 6)}
    kinds = {0: (False, False), 1: (False, False), 2: (False, True), 3: (False, False),
             4: (True, False), 5: (False, False), 6: (True, False)}
    # s5 writes after s3 may fail: s1..s3 and s5..s7 are two `switch_case` ops
    assert fused_runs(plan, derived, TOP, _size(plan), 4, kinds.get) == (
        Run(0, (0, 1, 2), 2), Run(0, (4, 5, 6), 2))
    assert fused_runs(plan, derived, TOP, _size(plan), 4) == (Run(0, tuple(range(7)), 2),)
