"""Stage programs: residual packs owned by the caller, alias-aware pack plans, partitioning."""
import numpy as np
import pytest
import tensorflow as tf

from terra.pipeline import stage as st
from tests.pipeline._model import batch, max_err


def test_two_stage_programs_give_tape_gradients_and_survive_a_pack_round_trip():
    parts = st.tiny_gpt(2)
    x, y = batch(4)
    first = st.StageProgram(st.sequential(parts[0]), st.trainable_variables(parts[0]), tf.TensorSpec((4, 16), tf.int32))
    head = st.sequential(parts[1])
    last = st.StageProgram(lambda h, l: st.lm_loss(l, head(h)), st.trainable_variables(parts[1]),
                           first.output_spec, tf.TensorSpec((4, 16), tf.int32))
    h, pack0 = first.forward(x)
    loss, pack1 = last.forward(h, y)
    bases = pack0.split(first.plan)
    assert not pack0.resident and len(bases) == len(first.plan.moved)
    with pytest.raises(RuntimeError, match="evicted"):
        first.backward(pack0, h)
    pack0.restore(first.plan, [tf.identity(b) for b in bases])
    gh, g1 = last.backward(pack1, tf.constant(1.0))
    gx, g0 = first.backward(pack0, gh)
    variables = st.trainable_variables(parts[0]) + st.trainable_variables(parts[1])
    with tf.GradientTape() as tape:
        ref = st.lm_loss(y, head(st.sequential(parts[0])(x)))
    assert float(loss) == pytest.approx(float(ref), abs=1e-6)
    assert max_err(g0 + g1, tape.gradient(ref, variables)) < 1e-6
    assert gx is None  # integer token ids get no gradient
    # Variable reads are kept, never counted as activations.
    assert first.plan.kept and first.plan.moved_bytes > 0


def test_split_backward_equals_the_whole_backward_and_recomputes_nothing():
    """B (input half) then W (weight half) give the whole backward's gradients bit for bit; W
    starts from the gradients B saved (none of B's ops reachable from W's outputs)."""
    parts = st.tiny_gpt(3)
    x, y = batch(4)
    programs, spec = [], tf.TensorSpec((4, 16), tf.int32)
    for k, part in enumerate(parts):
        fn = st.sequential(part)
        last = k == len(parts) - 1
        programs.append(st.StageProgram((lambda h, l, fn=fn: st.lm_loss(l, fn(h))) if last else fn,
                                        st.trainable_variables(part), spec,
                                        tf.TensorSpec((4, 16), tf.int32) if last else None))
        spec = programs[-1].output_spec
    h, packs = x, []
    for k, prog in enumerate(programs):
        h, pack = prog.forward(h, y) if k == len(programs) - 1 else prog.forward(h)
        packs.append(pack)
    whole, split, g, g_split = [], [], tf.constant(1.0), tf.constant(1.0)
    residuals = []
    for prog, pack in zip(reversed(programs), reversed(packs)):
        g, grads = prog.backward(pack, g)
        whole = grads + whole
        g_split, residual = prog.backward_input(pack, g_split)
        residuals.insert(0, residual)
        if g is not None:
            assert max_err([g_split], [g]) == 0.0
    for prog, pack, residual in zip(programs, packs, residuals):  # Ws later, in any order
        split += prog.backward_weight(pack, residual)
    assert max_err(split, whole) == 0.0
    assert [prog.split.recomputed for prog in programs] == [0, 0, 0]
    # Stage 0's input is token ids (no gradient): its B has nothing to do and W does it all;
    # the others hand intermediate gradients from B to W.
    assert programs[0].split.num_saved == 0
    assert all(prog.split.num_saved > 0 for prog in programs[1:])


def test_split_backward_with_sparse_gradients_and_a_cond():
    """A gathered weight (IndexedSlices gradient) and a functional tf.cond: B and W still give
    the tape's gradients exactly, and the cut is clean."""
    emb = tf.Variable(tf.random.normal((10, 4), seed=1))
    w = tf.Variable(tf.random.normal((4, 3), seed=2))

    def f(h, ids):
        z = tf.matmul(h + tf.gather(emb, ids), w)
        z = tf.cond(tf.reduce_sum(z) > 0, lambda: tf.nn.relu(z), lambda: tf.tanh(z))
        return tf.reduce_sum(z * z)

    prog = st.StageProgram(f, [emb, w], tf.TensorSpec((5, 4)), tf.TensorSpec((5,), tf.int32))
    h, ids = tf.random.normal((5, 4), seed=3), tf.constant([1, 2, 2, 7, 0])
    _, pack = prog.forward(h, ids)
    gh, residual = prog.backward_input(pack, tf.constant(1.0))
    g_emb, g_w = prog.backward_weight(pack, residual)
    with tf.GradientTape() as tape:
        tape.watch(h)
        ref = f(h, ids)
    r_h, r_emb, r_w = tape.gradient(ref, [h, emb, w])
    assert max_err([gh, g_emb, g_w], [r_h, tf.convert_to_tensor(r_emb), r_w]) == 0.0
    assert prog.split.recomputed == 0 and prog.split.num_saved > 0


def test_pack_plan_keeps_variable_reads_and_rebuilds_views():
    w = tf.Variable(tf.ones((4, 8)))

    def f(x):
        h = tf.tanh(tf.matmul(x, w))
        return tf.reduce_sum(tf.reshape(h, [3, 2, 4]) * tf.reshape(h, [3, 2, 4]))

    prog = st.StageProgram(f, [w], tf.TensorSpec((3, 4)))
    graph = prog._pair.forward_graph
    kinds = {graph.outputs[k].op.type for k in prog.pack_sources}
    plan = prog.plan
    assert "ReadVariableOp" in kinds
    reads = [i for i, k in enumerate(prog.pack_sources) if graph.outputs[k].op.type == "ReadVariableOp"]
    assert set(reads) <= set(plan.kept)
    views = [i for i, k in enumerate(prog.pack_sources) if graph.outputs[k].op.type == "Reshape"]
    assert views and {v.slot for v in plan.views} == set(views)
    assert all(prog.pack_sources and v.base in plan.moved for v in plan.views)
    # moved bytes count the tanh base once, not its reshaped view again
    x = tf.random.normal((3, 4), seed=1)
    out, pack = prog.forward(x)
    bases = pack.split(plan)
    pack.restore(plan, [tf.identity(b) for b in bases])
    _, (gw,) = prog.backward(pack, tf.constant(1.0))
    with tf.GradientTape() as tape:
        ref = f(x)
    np.testing.assert_allclose(gw.numpy(), tape.gradient(ref, w).numpy(), rtol=1e-5)


def test_a_view_of_a_weight_stays_with_the_weight():
    """A reshaped weight read (Keras' EinsumDense kernel, a LayerNormalization scale) aliases the
    variable: evicting it would free nothing, so it is kept, not counted as an activation."""
    w = tf.Variable(tf.ones((4, 8)))

    def f(x):
        k = tf.reshape(w, [2, 2, 8])
        return tf.reduce_sum(tf.einsum("bi,ijk->bjk", x[:, :2] * x[:, 2:], k) ** 2)

    prog = st.StageProgram(f, [w], tf.TensorSpec((3, 4)))
    graph = prog._pair.forward_graph
    views = [i for i, k in enumerate(prog.pack_sources) if graph.outputs[k].op.type == "Reshape"
             and graph.outputs[k].op.inputs[0].op.type == "ReadVariableOp"]
    assert views and set(views) <= set(prog.plan.kept)
    moved = {graph.outputs[prog.pack_sources[i]].op.type for i in prog.plan.moved}
    assert "Reshape" not in moved
    assert prog.plan.moved_bytes == sum(st._nbytes(graph.outputs[prog.pack_sources[i]]) for i in prog.plan.moved)
    x = tf.random.normal((3, 4), seed=1)
    out, pack = prog.forward(x)
    bases = pack.split(prog.plan)
    pack.restore(prog.plan, [tf.identity(b) for b in bases])
    _, (gw,) = prog.backward(pack, tf.constant(1.0))
    with tf.GradientTape() as tape:
        ref = f(x)
    np.testing.assert_allclose(gw.numpy(), tape.gradient(ref, w).numpy(), rtol=1e-5)


def test_partition_and_errors():
    assert st.partition(list(range(5)), 2) == [[0, 1], [2, 3, 4]] or st.partition(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert sum(map(len, st.partition(list(range(8)), 4))) == 8
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        st.partition([1, 2], 3)
    with pytest.raises(ValueError, match="num_stages"):
        st.partition([1, 2], 0)
    with pytest.raises(ValueError, match="scalar loss"):
        st.StageProgram(lambda h, l: h, [], tf.TensorSpec((2,)), tf.TensorSpec((2,)))
    with pytest.raises(ValueError, match="d_model"):
        st.tiny_gpt(2, d_model=30, heads=4)


def test_a_stage_takes_and_returns_a_nested_structure():
    """A residual stream and an integer mask cross a cut together: the output keeps its
    structure, the backward takes the stream's gradient only (None for the mask) and returns the
    input gradient in the input's structure."""
    w = tf.Variable(tf.reshape(tf.range(16, dtype=tf.float32), (4, 4)) / 16.0)

    def f(inputs):
        h, mask = inputs["h"], inputs["mask"]
        return {"h": h + tf.tanh(tf.matmul(h, w)) * tf.cast(mask, tf.float32)[:, None], "mask": mask + 1}

    spec = {"h": tf.TensorSpec((3, 4)), "mask": tf.TensorSpec((3,), tf.int32)}
    prog = st.StageProgram(f, [w], spec)
    assert prog.output_spec == spec
    x = {"h": tf.random.normal((3, 4), seed=1), "mask": tf.constant([1, 0, 1])}
    out, pack = prog.forward(x)
    g = {"h": tf.ones((3, 4)), "mask": None}
    gx, (gw,) = prog.backward(pack, g)
    gx_split, residual = prog.backward_input(pack, g)
    (gw_split,) = prog.backward_weight(pack, residual)
    with tf.GradientTape() as tape:
        tape.watch(x["h"])
        ref = f(x)
    r_h, r_w = tape.gradient(ref["h"], [x["h"], w])
    np.testing.assert_array_equal(out["mask"].numpy(), [2, 1, 2])
    np.testing.assert_allclose(out["h"].numpy(), ref["h"].numpy(), atol=1e-6)
    assert gx["mask"] is None and gx_split["mask"] is None
    assert max_err([gx["h"], gw, gx_split["h"], gw_split], [r_h, r_w, r_h, r_w]) < 1e-6


def test_residual_bytes_are_what_the_input_half_hands_the_weight_half():
    w1, w2 = tf.Variable(tf.ones((4, 8))), tf.Variable(tf.ones((8, 2)))

    def f(x):
        return tf.tanh(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2))

    prog = st.StageProgram(f, [w1, w2], tf.TensorSpec((3, 4)))
    out, pack = prog.forward(tf.random.normal((3, 4), seed=2))
    gx, (grads_in, saved) = prog.backward_input(pack, tf.ones_like(out))
    held = sum(int(np.prod(t.shape)) * t.dtype.size for t in list(grads_in) + list(saved))
    assert saved and prog.residual_bytes == held
