"""The graphs Terra builds die when nothing uses them: a reset leaves none of a site's graphs,
branch graphs or the constants and stand-in values memoized for them alive (a module-level
memo keyed weakly by graph, whose values held the graph's own tensors, kept every graph the
process had built, and each full collection walked all of their ops)."""
import gc
import os
import weakref

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402
from terra.compiler import fold  # noqa: E402
from terra.compiler import lower  # noqa: E402
from terra.compiler.graph_memo import memo  # noqa: E402
from tests.runtime.test_site_graph import random_branch  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_terra")


def _terra_graphs():
    from tensorflow.python.framework import ops
    return [o for o in gc.get_objects()
            if isinstance(o, ops.Graph) and str(getattr(o, "name", "")).startswith("terra_")]


def test_a_reset_leaves_no_graph_the_site_built():
    old = terra.config(site_graph=True)
    try:
        random_branch(tf.TerraGradientTape)
        terra.end_iteration()
        stats = terra.stats()
    finally:
        terra.config(**old)
    assert stats["graph_builds"] >= 2 and stats["case_switches"] > 0, stats  # a site graph ran
    assert _terra_graphs(), "the running site's graphs are alive before the reset"
    terra.reset()
    left = _terra_graphs()
    assert not left, f"{len(left)} graphs outlive the reset: {[g.name for g in left[:5]]}"


def test_a_graphs_memo_goes_with_the_graph():
    g = tf.Graph()
    with g.as_default():
        t = fold.graph_constant([1.0, 2.0], tf.float32)
        d = lower._dummy("float32", (3, None))
        assert fold.graph_constant([1.0, 2.0], tf.float32) is t  # one per value
        assert lower._dummy("float32", (3, None)) is d
        assert memo(g, "x", dict) is memo(g, "x", dict)
    ref = weakref.ref(g)
    del g, t, d
    gc.collect()
    assert ref() is None
