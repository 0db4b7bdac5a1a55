"""Speculative shape groups (terra/runtime/shape_groups.py, `speculate`): a new path of a compiled
site that resizes an image to a size Python computed gets a shape group's graph of its own, the
size and the counts made from it put as constants; the path with another size joins it at its
first trace with no build. Every program equals eager (to the last-bit rounding of its graph
kernels, as in the e2e harness), with exact counts."""
import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.ir.records import ConstRef, FeedRef  # noqa: E402
from terra.runtime.session import SESSION  # noqa: E402
from terra.runtime.shape_groups import SHAPE_CONSTANT, speculate  # noqa: E402
from tests.counting import CompileCounter  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra", "speculation_restored")


@pytest.fixture
def speculation_restored():
    old = terra.config()["speculation"]
    yield
    terra.config(speculation=old)


def _net(Tape, ratios, hw=12, batch=4, on_step=None):
    """A small convnet whose forward pass resizes the feature map after its first block by
    `ratio` (None: no resize), one step per element of `ratios`; `on_step(i)` after step i."""
    keras.utils.set_random_seed(0)
    stem = keras.layers.Conv2D(4, 3, padding="same")
    block = keras.layers.Conv2D(6, 3, padding="same")
    bn = keras.layers.BatchNormalization()
    head = keras.layers.Dense(3)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(batch, hw, hw, 2)), tf.float32)
    y = tf.constant(rng.integers(0, 3, batch), tf.int32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(0.05)
    h = stem(x)
    head(tf.reduce_mean(bn(block(h)), axis=(1, 2)))
    params = stem.trainable_variables + block.trainable_variables + bn.trainable_variables + \
        head.trainable_variables
    opt.build(params)
    losses = []
    for ratio in ratios:
        with Tape() as tape:
            h = tf.nn.relu(stem(x))
            if ratio is not None:
                s = int(h.shape[1] * ratio)
                h = tf.image.resize(h, (s, s), method="bilinear")
            h = tf.nn.relu(bn(block(h), training=True))
            loss = loss_fn(y, head(tf.reduce_mean(h, axis=(1, 2))))
        opt.apply_gradients(zip(tape.gradient(loss, params), params))
        losses.append(float(loss))
        if on_step is not None:
            on_step(len(losses) - 1)
    terra.end_iteration()
    return losses, [v.numpy() for v in params + bn.non_trainable_variables + opt.variables]


def _assert_same(got, eager):
    """Equal to eager to the e2e harness's tolerance (tests/e2e/harness.py): this net's graph
    kernels (its convolutions and batch norm under TF's graph executor) round some sums in the
    last bit differently from eager's even on a plain path graph with no group
    (`test_a_site_of_one_path_builds_its_own_graph`), and training carries that on."""
    np.testing.assert_allclose(got[0], eager[0], rtol=1e-5, atol=1e-7)
    assert len(got[1]) == len(eager[1])
    for a, b in zip(got[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _groups():
    return [g for s in SESSION.sites.values() for g in s.shape_groups]


RATIOS = [None, None, 0.5, 0.75, None, 0.75, 0.5, 0.5, None, 0.75]


def test_the_other_size_joins_the_first_sizes_graph_with_no_build():
    eager = _net(tf.GradientTape, RATIOS)
    with CompileCounter() as c:
        got = _net(tf.TerraGradientTape, RATIOS)
    _assert_same(got, eager)
    # no resize: traced twice, built (the site compiles); ratio 0.5 falls back, is traced and
    # built as a group of one; ratio 0.75 falls back, is traced and runs that graph (no build);
    # every later step runs compiled
    c.assert_counts(traces=4, graph_builds=2, graph_reuses=1, fallbacks=2, speculations=1,
                    speculation_hits=1)
    (g,) = _groups()
    assert len(g.members) == 2 and not g.speculative and not g.derived
    sizes = sorted(tuple(m.group_values[min(g.relaxed.const_sites)].tolist()) for m in g.members)
    assert sizes == [(6, 6), (9, 9)]
    # the dimensions the sizes set are unknown in the relaxed trace, the batch's are not
    resize = g.relaxed.const_sites[min(g.relaxed.const_sites)][0]
    assert g.relaxed.trace.records[resize].outputs[0].shape == (4, None, None, 4)


def test_without_speculation_the_other_size_builds_the_group():
    eager = _net(tf.GradientTape, RATIOS)
    terra.config(speculation=False)
    with CompileCounter() as c:
        got = _net(tf.TerraGradientTape, RATIOS)
    _assert_same(got, eager)
    c.assert_counts(traces=4, graph_builds=3, graph_reuses=0, fallbacks=2, speculations=0,
                    speculation_hits=0)


def test_a_site_of_one_path_builds_its_own_graph():
    # a site that never took another path is not a bet on other sizes: a static resize stays
    # a constant of its graph
    ratios = [0.5] * 4
    eager = _net(tf.GradientTape, ratios)
    with CompileCounter() as c:
        got = _net(tf.TerraGradientTape, ratios)
    _assert_same(got, eager)
    c.assert_counts(traces=2, graph_builds=1, fallbacks=0, speculations=0)
    assert _groups() == []


def test_a_speculative_group_that_does_not_cover_a_path_is_rebuilt_for_both():
    # a third size after the group formed: its own trace, and a rebuild, never a wrong graph
    ratios = [None, None, 0.5, 0.75, 0.25, 0.5, 0.25, 0.75]
    eager = _net(tf.GradientTape, ratios)
    with CompileCounter() as c:
        got = _net(tf.TerraGradientTape, ratios)
    _assert_same(got, eager)
    (g,) = _groups()
    assert len(g.members) == 3
    assert c.speculations == 1 and c.speculation_hits == 1


@pytest.fixture
def background():
    old = terra.config(background_builds=True)
    yield
    terra.reset()  # (ends the builder thread before the setting goes back)
    terra.config(**old)


def test_with_background_builds_the_group_of_one_is_built_on_the_builder_thread(background):
    """Each step's builds are waited for after it (`wait_builds`), so the counts are exact
    whatever the machine's speed: p0 (no resize) is built when iteration 3 begins and installed
    after it; ratio 0.5 falls back at step 4, and its group of one is submitted when iteration
    6 begins (step 5 falls back onto it: it is being built) and installed after it; ratio 0.75
    falls back at step 7 and runs that graph from its first trace, no build. Without
    speculation on the builder thread p1 got a path graph and 0.75 a group built for both on
    the program's thread (3 builds)."""
    ratios = [None, None, None, None, 0.5, 0.5, 0.5, 0.75, 0.75, None, 0.5, 0.75]
    eager = _net(tf.GradientTape, ratios)
    with CompileCounter() as c:
        got = _net(tf.TerraGradientTape, ratios, on_step=lambda s: terra.wait_builds(60))
    _assert_same(got, eager)
    c.assert_counts(traces=6, fallbacks=3, graph_builds=2, graph_reuses=1, speculations=1,
                    speculation_hits=1)
    text = terra.explain()
    assert "graph for shape group g0 (paths p1; 5 shape constants fed): 174 ops" in text, text
    assert "on the builder thread, installed at iteration 7" in text, text
    assert "path p2 runs the graph of shape group g0" in text, text


def test_a_group_of_one_still_being_built_when_a_second_size_comes_is_dropped(
        background, monkeypatch):
    """The group of one (ratio 0.5) is submitted when iteration 6 begins and held on the
    builder thread; ratio 0.75, traced at step 5, makes the group real when iteration 7
    begins, and its graph, built on the program's thread for both, runs steps 6-11. The held
    build, let go after step 7, is dropped, never installed over the group of two."""
    from terra.runtime import builds as builds_module
    gate = threading.Event()
    real = builds_module.PathGraph

    def held(*args, **kwargs):
        if threading.current_thread().name.startswith("terra-builder") and \
                kwargs.get("bundled"):
            assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(builds_module, "PathGraph", held)

    def on_step(step):
        if step == 2:
            assert terra.wait_builds(60)   # p0's own graph (not held)
        if step == 7:
            gate.set()
            assert terra.wait_builds(60)

    ratios = [None, None, None, None, 0.5, 0.75, 0.5, 0.75, 0.5, 0.75, None, 0.5]
    eager = _net(tf.GradientTape, ratios)
    with CompileCounter() as c:
        got = _net(tf.TerraGradientTape, ratios, on_step=on_step)
    _assert_same(got, eager)
    c.assert_counts(traces=5, fallbacks=2, graph_builds=2, speculations=1, speculation_hits=0)
    text = terra.explain()
    assert "the graph built for shape group g0 on the builder thread is dropped" in text, text
    (g,) = _groups()
    assert len(g.members) == 2 and not g.speculative


def _trace_of(ratio):
    terra.config(speculation=False)
    _net(tf.TerraGradientTape, [None, None, ratio])
    site = next(iter(SESSION.sites.values()))
    return [p.trace for p in site.paths.values()
            if any(r.op_type == "ResizeBilinear" for r in p.trace.records)][0]


def test_speculate_feeds_the_size_and_the_constants_made_from_it():
    trace = _trace_of(0.5)
    relaxed = speculate(trace)
    assert relaxed is not None
    sites = relaxed.const_sites
    first = min(sites)
    rec, pos = sites[first]
    assert trace.records[rec].op_type == "ResizeBilinear" and pos == 1
    assert relaxed.trace.records[rec].input_refs()[1] == FeedRef(first)
    assert relaxed.trace.feeds[first].source == SHAPE_CONSTANT
    # every other one is downstream of the resize and held a product of its spatial lengths
    for slot, (r, p) in sites.items():
        assert r >= rec
        ref = trace.records[r].input_refs()[p]
        assert isinstance(ref, ConstRef)
    # the exact shapes are kept: nothing runs another shape before a second member joins
    assert [r.outputs for r in relaxed.trace.records] == [r.outputs for r in trace.records]


def test_speculate_leaves_a_trace_without_a_resize_alone():
    terra.config(speculation=False)
    _net(tf.TerraGradientTape, [None, None])
    site = next(iter(SESSION.sites.values()))
    assert all(speculate(p.trace) is None for p in site.paths.values())
