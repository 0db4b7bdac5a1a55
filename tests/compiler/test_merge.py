import random

import pytest

from terra.compiler.case_assignment import assign_cases, path_choices
from terra.compiler.merge import covers, merge
from terra.ir import verify as verify_mod
from terra.ir.records import (ConstRef, FeedRef, Fetch, Location, LoopIter, OpRecord, OutputRef,
                              TensorSpec, Trace, VariableRef)
from terra.ir.trace_graph import LOOP, Carried, FetchPoint, IterFeed, NodeOut, Phi, Prev
from terra.ir.verify import verify

F32 = (("T", "float32"),)


def loc(line, *loops):
    return Location(("train.py:step@1", f"model.py:f@{line}"),
                    tuple(LoopIter(f"model.py:f@{l}", i) for l, i in loops))


def trace(*ops, fetches=()):
    """ops: (op_type, inputs, location[, attrs]) -> a Trace with records indexed in order."""
    recs = [OpRecord(k, op[0], op[3] if len(op) > 3 else F32, tuple(op[1]),
                     (TensorSpec("float32", (2,)),), op[2]) for k, op in enumerate(ops)]
    return Trace("train.py:step@1", recs, fetches=list(fetches))


def ops_of(g):
    return sorted((n.op.op_type, n.id) for n in g.op_nodes if n.kind != LOOP)


def node(g, op_type, which=0):
    return [n for n in g.op_nodes if n.op is not None and n.op.op_type == op_type][which]


@pytest.fixture(autouse=True)
def _debug_verify(monkeypatch):
    monkeypatch.setattr(verify_mod, "DEBUG", True)  # every merge result is verified


# ------------------------------------------------------------------------------ linear traces
def test_first_trace_is_a_chain_with_translated_inputs():
    t = trace(("Read", [VariableRef(3)], loc(1)), ("Mul", [OutputRef(0), FeedRef(0)], loc(2)),
              ("Add", [OutputRef(1), ConstRef(1.0, "float32")], loc(3)),
              ("ConcatV2", [(OutputRef(1), OutputRef(2)), ConstRef(0, "int32")], loc(4)))
    g = merge(None, t)
    r, m, a, c = (node(g, k) for k in ("Read", "Mul", "Add", "ConcatV2"))
    assert g.edges == ((0, r.id), (r.id, m.id), (m.id, a.id), (a.id, c.id), (c.id, 1))
    assert m.inputs == (NodeOut(r.id), FeedRef(0))
    assert a.inputs == (NodeOut(m.id), ConstRef(1.0, "float32"))
    assert c.inputs == ((NodeOut(m.id), NodeOut(a.id)), ConstRef(0, "int32"))
    assert m.feeds == (FeedRef(0),) and r.feeds == ()
    assert [n.seen for n in (r, m, a, c)] == [{0: (0,)}, {0: (1,)}, {0: (2,)}, {0: (3,)}]
    assert g.path(0) == (0, r.id, m.id, a.id, c.id, 1)
    assert g.num_traces == 1


def test_same_trace_again_is_covered_and_input_graph_is_not_mutated():
    t = trace(("Read", [VariableRef(3)], loc(1)), ("Neg", [OutputRef(0)], loc(2)))
    g1 = merge(None, t)
    before = (dict(g1.nodes), g1.edges, {k: dict(n.seen) for k, n in g1.nodes.items()})
    assert covers(g1, t)
    g2 = merge(g1, t)
    assert (dict(g1.nodes), g1.edges, {k: dict(n.seen) for k, n in g1.nodes.items()}) == before
    assert g2.edges == g1.edges and g2.num_traces == 2
    assert node(g2, "Neg").seen == {0: (1,), 1: (1,)}
    assert not covers(None, t)


@pytest.mark.parametrize("change", [
    lambda r: ("MatMul", r[1], r[2], (("transpose_a", True),)),     # attribute
    lambda r: ("MatMul", r[1], loc(9)),                             # location
    lambda r: ("BatchMatMul", r[1], r[2]),                          # type
    lambda r: ("MatMul", [VariableRef(8)], r[2]),                   # variable
    lambda r: ("MatMul", [FeedRef(1)], r[2]),                       # feed slot
    lambda r: ("MatMul", [ConstRef(2.0, "float32")], r[2]),         # constant value
])
def test_any_difference_makes_a_branch(change):
    base = ("MatMul", [VariableRef(7)], loc(1))
    other = change(base)
    t1 = trace(base, ("Neg", [OutputRef(0)], loc(2)))
    t2 = trace(other, ("Neg", [OutputRef(0)], loc(2)))
    if other[1] == [FeedRef(1)]:
        t2.feeds = [None, None]
    g = merge(merge(None, t1), t2)
    a, b = (n for n in g.op_nodes if n.op.op_type in ("MatMul", "BatchMatMul"))
    neg = node(g, "Neg")
    assert g.successors(0) == (a.id, b.id)
    assert neg.inputs == (Phi(neg.inputs[0].options),)          # merged back, with a phi
    assert [o.source for o in neg.inputs[0].options] == [NodeOut(a.id), NodeOut(b.id)]
    assert [o.traces for o in neg.inputs[0].options] == [{0}, {1}]
    assert not covers(merge(None, t1), t2) and covers(g, t1) and covers(g, t2)


# ----------------------------------------------------------------- Figure 3.2: branch, merge
def fig32(true_path, iters):
    ops = [("Op1", [FeedRef(0)], loc(5)), ("Op2", [OutputRef(0)], loc(6))] if true_path else \
          [("Op2", [VariableRef(0)], loc(8))]
    k = len(ops)
    ops.append(("Op3", [OutputRef(k - 1)], loc(10)))
    for i in range(iters):
        ops.append(("Op4", [OutputRef(len(ops) - 1)], loc(13, (12, i))))
    return trace(*ops, fetches=[Fetch(OutputRef(k), k + 1)])


def test_figure_3_2_branch_merge_back_and_loop():
    g = merge(merge(None, fig32(True, 2)), fig32(False, 3))
    op1, op2t, op2f, op3 = node(g, "Op1"), node(g, "Op2", 0), node(g, "Op2", 1), node(g, "Op3")
    loops = [n for n in g.op_nodes if n.kind == LOOP]
    assert len(loops) == 1
    lp = loops[0]
    assert set(g.edges) == {(0, op1.id), (op1.id, op2t.id), (0, op2f.id), (op2t.id, op3.id),
                            (op2f.id, op3.id), (op3.id, lp.id), (lp.id, 1)}
    assert op3.inputs[0].options[0].source == NodeOut(op2t.id)
    assert op3.fetches == {FetchPoint(0, "numpy", op3.id)}
    body = lp.loop.body
    (op4,) = body.op_nodes
    assert op4.inputs == (Carried(NodeOut(op3.id), Prev(op4.id)),)
    assert op4.seen == {0: (3, 4), 1: (2, 3, 4)}
    assert lp.loop.trip_counts == {0: (2,), 1: (3,)}
    assert body.edges == ((body.start, op4.id), (op4.id, body.end))
    assert covers(g, fig32(True, 7)) and not covers(g, fig32(True, 7), exact_trip_counts=True)
    assert covers(g, fig32(False, 2), exact_trip_counts=True)


# ------------------------------------------------------------------------------- data flow
def test_phi_resolves_to_the_last_producer_on_the_path():
    a = ("A", [VariableRef(0)], loc(1))
    b = ("B", [OutputRef(0)], loc(2))
    t1 = trace(a, ("D", [OutputRef(0)], loc(3)))
    t2 = trace(a, b, ("D", [OutputRef(1)], loc(3)))           # x = b(x) on this path
    t3 = trace(a, b, ("D", [OutputRef(0)], loc(3)))           # b ran, but d reads a
    g = merge(merge(None, t1), t2)
    (d,) = [n for n in g.op_nodes if n.op.op_type == "D"]
    assert [o.source for o in d.inputs[0].options] == [NodeOut(node(g, "A").id),
                                                       NodeOut(node(g, "B").id)]
    assert covers(g, t1) and covers(g, t2) and not covers(g, t3)
    g3 = merge(g, t3)
    assert len([n for n in g3.op_nodes if n.op.op_type == "D"]) == 2   # t3 could not reuse d


def test_merge_back_never_targets_an_ancestor():
    a, b = ("A", [VariableRef(0)], loc(1)), ("B", [OutputRef(0)], loc(2))
    g = merge(merge(None, trace(a, b)), trace(a, b, a))
    assert len([n for n in g.op_nodes if n.op.op_type == "A"]) == 2
    verify(g)


def test_fetch_points_annotate_the_producer():
    t = trace(("A", [FeedRef(0)], loc(1)), ("B", [OutputRef(0)], loc(2)),
              fetches=[Fetch(OutputRef(0), 2, "bool")])
    g = merge(None, t)
    assert node(g, "A").fetches == {FetchPoint(0, "bool", node(g, "B").id)}
    t2 = trace(("A", [FeedRef(0)], loc(1)), ("B", [OutputRef(0)], loc(2)))
    assert not covers(merge(None, t2), t)                     # a new fetch point is new


# ----------------------------------------------------------------------------------- loops
def rnn(n, first_line=20):
    """h = tanh(h @ w + x_i) for n steps; x_i is a new feed each step; loss(h) after."""
    ops = [("Zeros", [ConstRef(0.0, "float32")], loc(first_line))]
    h = 0
    for i in range(n):
        ops.append(("MatMul", [OutputRef(h), VariableRef(1)], loc(22, (21, i))))
        ops.append(("Add", [OutputRef(len(ops) - 1), FeedRef(i)], loc(23, (21, i))))
        ops.append(("Tanh", [OutputRef(len(ops) - 1)], loc(24, (21, i))))
        h = len(ops) - 1
    ops.append(("Loss", [OutputRef(h)], loc(30)))
    t = trace(*ops)
    t.feeds = list(range(n))
    return t


def test_uniform_loop_folds_with_carried_value_iter_feeds_and_outputs():
    g = merge(merge(None, rnn(3)), rnn(5))
    zeros, loss = node(g, "Zeros"), node(g, "Loss")
    (lp,) = [n for n in g.op_nodes if n.kind == LOOP]
    body = lp.loop.body
    mm, add, tanh = (node(body, k) for k in ("MatMul", "Add", "Tanh"))
    assert mm.inputs == (Carried(NodeOut(zeros.id), Prev(tanh.id)), VariableRef(1))
    assert add.inputs == (NodeOut(mm.id), IterFeed(0))
    assert lp.loop.outputs == (NodeOut(tanh.id),)
    assert loss.inputs == (NodeOut(lp.id, 0),)
    assert lp.loop.seen_trip_counts == {3, 5}
    assert g.size() == {"nodes": 6, "edges": 4 + 4}
    assert covers(g, rnn(11))


def test_loop_over_variables_is_unrolled():
    ops = [("Grad", [FeedRef(0)], loc(1))]
    for i in range(4):
        ops.append(("ApplySGD", [VariableRef(i), OutputRef(0)], loc(41, (40, i))))
    g = merge(None, trace(*ops))
    assert not [n for n in g.op_nodes if n.kind == LOOP]
    applies = [n for n in g.op_nodes if n.op.op_type == "ApplySGD"]
    assert [n.inputs[0] for n in applies] == [VariableRef(i) for i in range(4)]
    assert [n.op.location.loops[0].iteration for n in applies] == [0, 1, 2, 3]


def test_loop_with_a_branch_inside_folds():
    ops = [("Init", [VariableRef(0)], loc(1))]
    for i in range(4):
        ops.append(("Even" if i % 2 == 0 else "Odd", [OutputRef(len(ops) - 1)],
                    loc(52 if i % 2 == 0 else 54, (50, i))))
    g = merge(None, trace(*ops))
    (lp,) = [n for n in g.op_nodes if n.kind == LOOP]
    body = lp.loop.body
    even, odd = node(body, "Even"), node(body, "Odd")
    assert set(body.edges) == {(body.start, even.id), (body.start, odd.id), (even.id, body.end),
                               (odd.id, body.end)}
    assert even.inputs == (Carried(NodeOut(node(g, "Init").id), Prev(odd.id)),)
    assert odd.inputs == (Prev(even.id),)
    assert [c.block for s in assign_cases(body) for c in s.cases] == [(even.id,), (odd.id,)]


@pytest.mark.parametrize("shape", ["skip_iteration", "use_non_last_after"])
def test_non_uniform_data_flow_is_unrolled(shape):
    ops = [("Init", [VariableRef(0)], loc(1))]
    for i in range(3):
        src = OutputRef(max(len(ops) - 2, 0)) if shape == "skip_iteration" and i == 2 else \
              OutputRef(len(ops) - 1)
        ops.append(("Step", [src], loc(61, (60, i))))
    if shape == "use_non_last_after":
        ops.append(("Pack", [(OutputRef(1), OutputRef(2), OutputRef(3))], loc(70)))
    g = merge(None, trace(*ops))
    assert not [n for n in g.op_nodes if n.kind == LOOP]
    assert len([n for n in g.op_nodes if n.op.op_type == "Step"]) == 3


def _early_exit(passes):
    """h = step(h) for `passes` passes of a loop, then a backward-like op reading every pass's
    value (which keeps a run of two or more passes from folding)."""
    ops = [("Init", [VariableRef(0)], loc(1))]
    for i in range(passes):
        ops.append(("Step", [OutputRef(len(ops) - 1)], loc(61, (60, i))))
    ops.append(("Pack", [tuple(OutputRef(k) for k in range(1, passes + 1))], loc(70)))
    return trace(*ops)


@pytest.mark.parametrize("order", ["unrolled_first", "one_pass_first"])
def test_a_one_pass_run_stays_in_line_beside_an_unrolled_run(order):
    four, one = _early_exit(4), _early_exit(1)
    first, second = (four, one) if order == "unrolled_first" else (one, four)
    g = merge(merge(None, first), second)
    loops = [n for n in g.op_nodes if n.kind == LOOP]
    steps = [n for n in g.op_nodes if n.op is not None and n.op.op_type == "Step"]
    if order == "unrolled_first":
        # the one-pass run shares the four-pass run's first Step: the paths part after it
        assert not loops and len(steps) == 4, g
        first_step = [n for n in steps if n.op.location.loops[0].iteration == 0]
        assert len(first_step) == 1 and set(first_step[0].seen) == {0, 1}
    else:
        # nothing was in line when the one-pass run came first: it made a loop node (as
        # before), and the four-pass run, which cannot fold, is unrolled beside it
        assert len(loops) == 1 and len(steps) == 4, g
    assert covers(g, one) and covers(g, four)


def test_nested_loops_fold_recursively():
    ops = [("Init", [VariableRef(0)], loc(1))]
    for i in range(2):
        ops.append(("Outer", [OutputRef(len(ops) - 1)], loc(81, (80, i))))
        for j in range(3):
            ops.append(("Inner", [OutputRef(len(ops) - 1)], loc(83, (80, i), (82, j))))
    ops.append(("Out", [OutputRef(len(ops) - 1)], loc(90)))
    g = merge(None, trace(*ops))
    (outer,) = [n for n in g.op_nodes if n.kind == LOOP]
    ob = outer.loop.body
    o = node(ob, "Outer")
    (inner,) = [n for n in ob.op_nodes if n.kind == LOOP]
    (inn,) = inner.loop.body.op_nodes
    assert o.inputs == (Carried(NodeOut(node(g, "Init").id), Prev(inner.id)),)
    assert inn.inputs == (Carried(NodeOut(o.id), Prev(inn.id)),)
    assert inner.loop.trip_counts == {0: (3, 3)}
    assert node(g, "Out").inputs == (NodeOut(outer.id, 0),)
    assert outer.loop.outputs == (NodeOut(inner.id, 0),) and inner.loop.outputs == (NodeOut(inn.id),)


def test_empty_trace_is_a_start_end_edge():
    g = merge(None, trace())
    assert g.edges == ((0, 1),) and g.path(0) == (0, 1) and covers(g, trace())
    assert path_choices(assign_cases(g), g.path(0)) == []
    g2 = merge(g, trace(("A", [VariableRef(0)], loc(1))))
    assert set(g2.edges) == {(0, 1), (0, 2), (2, 1)}
    assert not covers(g, trace(("A", [VariableRef(0)], loc(1))))


# ---------------------------------------------------------------------------------- errors
def test_bad_input_is_rejected_clearly():
    with pytest.raises(TypeError, match="Trace"):
        merge(None, [1, 2])
    with pytest.raises(TypeError, match="TraceGraph"):
        merge("graph", trace())
    t = trace(("A", [VariableRef(0)], loc(1)))
    t.unsupported = ["PyFunc"]
    with pytest.raises(ValueError, match="PyFunc"):
        merge(None, t)
    with pytest.raises(ValueError, match="%1"):
        merge(None, trace(("A", [OutputRef(1)], loc(1)), ("B", [], loc(2))))


# ---------------------------------------------------------------------- random programs
def random_program(rng, sites=8):
    """A program as a function rng -> trace: ops at fixed sites, with branches chosen per run."""
    plan = [(k, rng.random() < 0.5, rng.choice(["var", "prev", "feed", "const"]))
            for k in range(sites)]

    def run(r):
        ops, last = [], None
        for k, optional, src in plan:
            if optional and r.random() < 0.5:
                continue
            if src == "prev" and last is not None:
                inp = OutputRef(last)
            elif src == "var" or (src == "prev" and last is None):
                inp = VariableRef(k % 3)
            elif src == "feed":
                inp = FeedRef(0)
            else:
                inp = ConstRef(float(k), "float32")
            ops.append(("Op%d" % (k % 3), [inp], loc(100 + k)))
            last = len(ops) - 1
        t = trace(*ops)
        t.feeds = [None]
        return t
    return run


def renamed_slots(replayed, recorded):
    """`replayed` with its graph feed slots renamed to the trace's, if one one-to-one renaming
    makes every feed input agree (the merge maps each trace's slots one-to-one onto the
    graph's); else `replayed` as it is (then it differs from `recorded`)."""
    fwd, back = {}, {}

    def walk(a, b):
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
            return all(walk(x, y) for x, y in zip(a, b))
        if isinstance(a, FeedRef) and isinstance(b, FeedRef):
            if fwd.setdefault(a.slot, b.slot) != b.slot or back.setdefault(b.slot, a.slot) != \
                    a.slot:
                return False
        return True
    if not walk(replayed, recorded):
        return replayed

    def ren(a):
        if isinstance(a, (tuple, list)):
            return type(a)(ren(x) for x in a)
        return FeedRef(fwd[a.slot]) if isinstance(a, FeedRef) else a
    return ren(replayed)


def replay_sources(g, tid, t):
    """Recover each record's inputs from the graph along the trace's path (phis resolved to the
    last producer that ran), as refs of the trace: must equal the recorded inputs, once the
    graph's feed slots are renamed to the trace's (`renamed_slots`)."""
    path = g.path(tid)[1:-1]
    pos = {nid: g.nodes[nid].seen[tid][0] for nid in path}
    out = []
    for nid in path:
        n = g.nodes[nid]
        ins = []
        for s in n.inputs:
            if isinstance(s, Phi):
                ran = [o.source for o in s.options if pos.get(o.source.node, 1 << 30) < pos[nid]]
                s = max(ran, key=lambda o: pos[o.node])
            ins.append(OutputRef(pos[s.node], s.index) if isinstance(s, NodeOut) else s)
        out.append((n.op.op_type, tuple(ins)))
    return out


def test_random_programs_embed_every_trace():
    rng = random.Random(7)
    for prog in range(60):
        run = random_program(rng)
        g, traces = None, []
        for k in range(8):
            t = run(rng)
            traces.append(t)
            g = merge(g, t)
        for tid, t in enumerate(traces):
            assert covers(g, t), (prog, tid)
            recorded = [(r.op_type, r.inputs) for r in t.records]
            assert renamed_slots(replay_sources(g, tid, t), recorded) == recorded
        sc = assign_cases(g)
        for tid in range(len(traces)):
            path = g.path(tid)
            choices = path_choices(sc, path)
            blocks = [n for k, s in zip(choices, sc) if k < len(s.cases) for n in s.cases[k].block]
            assert tuple(blocks) == path[1:-1]


# ------------------------------------------------- random programs with loops: data-flow replay
def random_loop_program(rng):
    """Pre op, a loop (trip count chosen per run, ops optional per iteration, an inner loop
    sometimes), a post op. Sources mix same-iteration, previous-iteration, outer values, per-step
    feeds and (rarely) per-iteration variables or reads of a non-last iteration after the loop."""
    body = [(k, rng.random() < 0.4, rng.choice(["chain", "chain", "outer", "feed", "prev"]))
            for k in range(rng.randrange(1, 4))]
    per_iter_var = rng.random() < 0.15
    read_first_after = rng.random() < 0.15
    inner = rng.random() < 0.3

    def run(r):
        ops, feeds = [("Pre", [FeedRef(0)], loc(1))], 1
        prev_last, first_of_loop = None, None
        for i in range(r.randrange(0, 5)):
            last = None
            for k, optional, src in body:
                if optional and r.random() < 0.5:
                    continue
                if src == "feed":
                    inp = [FeedRef(feeds)]
                    feeds += 1
                elif src == "outer" or (last is None and prev_last is None):
                    inp = [OutputRef(0)]
                elif src == "prev" and prev_last is not None:
                    inp = [OutputRef(prev_last)]
                else:
                    inp = [OutputRef(last if last is not None else prev_last)]
                if per_iter_var:
                    inp.append(VariableRef(i))
                ops.append(("B%d" % k, inp, loc(200 + k, (199, i))))
                last = len(ops) - 1
                if first_of_loop is None:
                    first_of_loop = last
            if inner and last is not None:
                for j in range(r.randrange(1, 3)):
                    ops.append(("In", [OutputRef(len(ops) - 1)], loc(211, (199, i), (210, j))))
                last = len(ops) - 1
            prev_last = last if last is not None else prev_last
        src = first_of_loop if read_first_after and first_of_loop is not None else prev_last
        ops.append(("Post", [OutputRef(src if src is not None else 0)], loc(300)))
        t = trace(*ops)
        t.feeds = list(range(feeds))
        return t
    return run


def replay(g, tid, t):
    """Rebuild every record's inputs from the graph alone (nodes the trace visited, phis,
    Prev/Carried, loop outputs, iteration feeds): must equal the recorded inputs."""
    node_of, owner = {}, {}

    def index(level, loop_node):
        for n in level.nodes.values():
            if n.kind == "op":
                for i in n.seen.get(tid, ()):
                    node_of[i], owner[n.id] = n, loop_node
            elif n.kind == LOOP:
                index(n.loop.body, n)
    index(g, None)
    all_nodes = {}

    def collect(level):
        for n in level.nodes.values():
            all_nodes[n.id] = n
            if n.kind == LOOP:
                collect(n.loop.body)
    collect(g)
    recs = t.records

    def iteration(r, depth):
        """(first, last) record index of r's iteration of the loop at `depth`."""
        key = recs[r].location.loops[:depth + 1]
        a = b = r
        while a > 0 and recs[a - 1].location.loops[:depth + 1] == key:
            a -= 1
        while b + 1 < len(recs) and recs[b + 1].location.loops[:depth + 1] == key:
            b += 1
        return a, b

    def latest(nid, before):
        return max(i for i in all_nodes[nid].seen[tid] if i < before)

    def value(s, r):
        n = node_of[r]
        depth = max(n.folded) if n.folded else None
        if isinstance(s, tuple):
            return tuple(value(x, r) for x in s)
        if isinstance(s, Phi):
            s = max((o.source for o in s.options if any(i < r for i in
                     all_nodes[o.source.node].seen.get(tid, ()))),
                    key=lambda o: latest(o.node, r))
        if isinstance(s, Carried):
            first = recs[r].location.loops[depth].iteration == 0
            return value(s.init if first else s.update, r)
        if isinstance(s, Prev):
            return produced(NodeOut(s.node, s.index), iteration(r, depth)[0])
        if isinstance(s, IterFeed):
            a, b = iteration(r, depth)
            slots = []
            for k in range(a, b + 1):
                for ref in recs[k].inputs:
                    if isinstance(ref, FeedRef) and ref.slot not in slots:
                        slots.append(ref.slot)
            return FeedRef(slots[s.ordinal])
        if isinstance(s, NodeOut):
            return produced(s, r)
        return s

    def produced(s, before):
        m = all_nodes[s.node]
        while m.kind == LOOP:  # a loop's output: its body value, last iteration
            s = m.loop.outputs[s.index]
            m = all_nodes[s.node]
        return OutputRef(latest(m.id, before), s.index)
    return [tuple(value(s, r.index) for s in node_of[r.index].inputs) for r in recs]


def test_random_loop_programs_replay_exactly():
    rng = random.Random(11)
    folded = unrolled = 0
    for prog in range(80):
        run = random_loop_program(rng)
        g, traces = None, []
        for k in range(6):
            traces.append(run(rng))
            g = merge(g, traces[-1])
        for tid, t in enumerate(traces):
            assert covers(g, t), (prog, tid)
            recorded = [r.inputs for r in t.records]
            assert renamed_slots(replay(g, tid, t), recorded) == recorded, (prog, tid)
        loops = [n for n in g.op_nodes if n.kind == LOOP]
        folded += bool(loops)
        unrolled += any(n.op is not None and n.op.location.loops and not n.folded
                        for n in g.op_nodes)
    assert folded > 20 and unrolled > 5   # both outcomes are exercised


# ------------------------------------------------------------ cost on optimizer-style loops
def optimizer_like(n_vars, chain):
    """A chain of `chain` ops, then a loop over `n_vars` variables as optimizers run it: each
    iteration reads its variable in a nested one-iteration loop (a tensor conversion), does
    arithmetic and updates that variable. Such loops cannot fold (rule 2): they unroll."""
    ops = [("Read", [FeedRef(0)], loc(1))]
    for k in range(chain):
        ops.append(("Op%d" % (k % 7), [OutputRef(len(ops) - 1)], loc(10 + k)))
    x = len(ops) - 1
    for v in range(n_vars):
        ops.append(("ReadVariableOp", [VariableRef(v)], loc(2000, (1999, v), (1998, 0))))
        ops.append(("Mul", [OutputRef(len(ops) - 1), ConstRef(0.9, "float32")], loc(2001, (1999, v))))
        ops.append(("AddV2", [OutputRef(len(ops) - 1), OutputRef(x)], loc(2002, (1999, v))))
        ops.append(("AssignVariableOp", [VariableRef(v), OutputRef(len(ops) - 1)],
                    loc(2003, (1999, v))))
    t = trace(*ops)
    t.feeds = [None]
    return t


def test_loop_over_variables_is_rejected_without_a_fold_attempt(monkeypatch):
    import terra.compiler.merge as merge_mod
    calls = []
    fold = merge_mod._Merger.fold
    monkeypatch.setattr(merge_mod._Merger, "fold", lambda self, *a: calls.append(a) or fold(self, *a))
    t = optimizer_like(4, 3)
    g = merge(None, t)
    outer = [inst for _, inst, _ in calls if inst.loop == "model.py:f@1999"]
    assert outer == []  # its variables differ per iteration: known before any attempt
    assert len(calls) == 4  # the conversion loops are attempted (and fold)
    # the outer loop is unrolled; each one-iteration conversion loop on its own folds
    assert [n.loop.key[0] for n in g.op_nodes if n.kind == LOOP] == ["model.py:f@1998"] * 4
    assert sorted(n.op.op_type for n in g.op_nodes if n.kind != LOOP).count("Mul") == 4
    assert covers(g, t)


def test_long_trace_with_optimizer_loop_merges_fast():
    import time
    t = optimizer_like(60, 800)  # ~1000 ops; snapshot copies per fold attempt took ~50 s
    t0 = time.perf_counter()
    g = merge(None, t)
    g = merge(g, t)
    assert covers(g, t)
    assert time.perf_counter() - t0 < 5.0
    assert g.size()["nodes"] == len(t.records) + 60 - 1 + 1  # 60 folded conversion loops


# ------------------------------------------------------------------- aligning repeated code
def _resized_at(point, blocks=6):
    """A backward pass of repeated blocks whose ops share one location each (gradient functions
    called from one TF frame): an extra op at `point`, and a count constant that is smaller past
    it (the feature map is smaller there)."""
    ops = []
    prev = FeedRef(0)
    for k in range(blocks):
        if k == point:
            ops.append(("ResizeGrad", [prev], loc(9)))
            prev = OutputRef(len(ops) - 1)
        ops.append(("RealDiv", [prev, ConstRef(4.0 if k >= point else 16.0, "float32")], loc(10)))
        ops.append(("Mul", [OutputRef(len(ops) - 1), ConstRef(2.0, "float32")], loc(11)))
        prev = OutputRef(len(ops) - 1)
    return trace(*ops)


@pytest.mark.parametrize("first,second", [(4, 1), (1, 4)])
def test_an_op_inserted_elsewhere_in_repeated_code_adds_only_the_ops_that_differ(first, second):
    """Each op merges into the node of the op it aligns with in the earlier trace: the second
    path adds its extra op and the three divisions whose constants differ, nothing else. (Taking
    the first node of the right key that keeps the graph a DAG, a division merged into another
    block's division and two more nodes came in; on a residual CNN's two paths, 578 nodes on one
    path only against 34.)"""
    a, b = _resized_at(first), _resized_at(second)
    g = merge(merge(None, a), b)
    assert len(a.records) == len(b.records) == 13
    assert len(list(g.op_nodes)) == 13 + 1 + 3
    assert covers(g, a) and covers(g, b)
    shared = [n for n in g.op_nodes if set(n.seen) == {0, 1}]
    assert sorted(n.op.op_type for n in shared) == ["Mul"] * 6 + ["RealDiv"] * 3


def _model_call(site, weights, start, first_input):
    """Records of a call, from call site `site`, of a function whose loop at offset 266 (one
    pass per call) runs an inner loop at 290 over its layers, one per weight: a MatMul by the
    weight (a variable), then a Tanh."""
    recs, prev = [], first_input
    for p, w in enumerate(weights):
        for op_type in ("MatMul", "Tanh"):
            where = Location((site, "functional.py:run@300", f"layers.py:{op_type}@1"),
                             (LoopIter("functional.py:run@266", 0),
                              LoopIter("functional.py:run@290", p)))
            k = start + len(recs)
            inputs = (prev, VariableRef(w)) if op_type == "MatMul" else (prev,)
            recs.append(OpRecord(k, op_type, F32, inputs, (TensorSpec("float32", (2,)),), where))
            prev = OutputRef(k)
    return recs


def _trunk_then_head(head):
    recs = _model_call("train.py:step@10", (1, 2), 0, FeedRef(0))
    recs += _model_call("train.py:step@20", head, len(recs), OutputRef(len(recs) - 1))
    recs.append(OpRecord(len(recs), "Sum", F32, (OutputRef(len(recs) - 1),),
                         (TensorSpec("float32", ()),), loc(30)))
    return Trace("train.py:step@1", recs, fetches=[Fetch(OutputRef(len(recs) - 1), len(recs),
                                                         "numpy")])


def test_two_calls_of_one_looping_function_are_two_loop_runs():
    """A Keras trunk then one of two heads, both functional models whose call loops over its
    layers: each call starts that loop at pass 0. Split by call site, the trunk is one loop run
    that both traces share, and the paths part at the head; as one run (the trunk's and the
    head's ops one pass of it) they parted at the first op."""
    a, b = _trunk_then_head((10, 11)), _trunk_then_head((20, 21))  # (two heads' weights)
    g = merge(merge(None, a), b)
    starts = [e for e in g.edges if e[0] == g.start]
    assert len(starts) == 1, g.edges
    shared = g.nodes[starts[0][1]]
    assert shared.kind == LOOP and set(shared.seen) == {0, 1}
    assert shared.loop.trip_counts == {0: (1,), 1: (1,)}  # (the loop at 266: one pass)

    def alone(level, tid):  # op types of the nodes only trace `tid` passes
        out = []
        for n in level.op_nodes:
            if n.kind == LOOP:
                out += alone(n.loop.body, tid)
            elif set(n.seen) == {tid}:
                out.append(n.op.op_type)
        return sorted(out)
    assert alone(g, 0) == alone(g, 1) == ["MatMul", "MatMul", "Tanh", "Tanh"]  # the heads
    assert covers(g, _trunk_then_head((20, 21)))
