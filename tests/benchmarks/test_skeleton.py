"""benchmarks/skeleton.py: the program thread's CPU by step section (eager and Terra), the feed
puts' count, and a TF op's CPU after the thread slept."""
import pytest

from benchmarks import skeleton


def _run(sections_us, cpu, wall):
    return {"sections_us": dict(zip(skeleton.SECTIONS, sections_us)), "thread_cpu_us": cpu,
            "wall_ms": wall}


def test_markdown_takes_the_median_over_processes_and_multiplies_the_puts():
    res = {"machine": "m", "tf": "t", "date": "d", "steps": 2, "warmup": 1, "repeats": 3,
           "sections": {"cnn": {
               "eager": [_run([1, 2, 3, 4, 5, 6, 7], 30, 1.0),
                         _run([3, 4, 5, 6, 7, 8, 9], 50, 3.0),
                         _run([2, 3, 4, 5, 6, 7, 8], 40, 2.0)],
               "terra": [_run([10] * 7, 70, 0.5)] * 3}},
           "puts": {"cnn": {"puts_per_step": 3.0, "put_cpu_us": 100.0}},
           "after_wait": {"op": {str(s): 10.0 + s for s in skeleton.SLEEPS_MS}}}
    md = skeleton.to_markdown(res)
    assert "| cnn | eager | 2 | 3 | 4 | 5 | 6 | 7 | 8 | 40 | 2.00 |" in md
    assert "| cnn | terra | 10 | 10 | 10 | 10 | 10 | 10 | 10 | 70 | 0.50 |" in md
    assert "| cnn | 3.0 | 100 | 300 |" in md
    assert "| op | 10.0 | 10.5 | 11.0 | 12.0 | 15.0 |" in md


def test_after_wait_times_every_kind_of_work_at_every_sleep():
    out = skeleton._after_wait(reps=3)
    assert set(out) == {"FIFOQueue enqueue (a feed put)", "AddV2 of two scalars",
                        "40 NumPy adds", "Python loop (300 adds)"}
    for row in out.values():
        assert set(row) == {str(s) for s in skeleton.SLEEPS_MS}
        assert all(v > 0 for v in row.values())


@pytest.mark.slow  # (a benchmark's smoke test: builds a Keras model and compiles it)
@pytest.mark.usefixtures("fresh_terra")
def test_terra_sections_count_the_feed_puts_of_one_compiled_path():
    out = skeleton._sections("cnn", "terra", steps=3, warmup=4, instrument=True)
    assert set(out["sections_us"]) == set(skeleton.SECTIONS)
    # the coexec CNN: one path, compiled once; each step puts the batch, the labels and the
    # commit token
    assert out["counts"] == {"traces": 3, "fallbacks": 0, "graph_builds": 1}
    assert out["puts_per_step"] == 3.0
    assert out["thread_cpu_us"] >= sum(out["sections_us"].values()) * 0.99


def test_site_build_growth_lists_every_build_and_the_site_graphs_by_size():
    from benchmarks import site_build_growth
    res = {"size": "bench", "steps": 4, "wall_s": 3.0,
           "counts": {"traces": 3, "graph_builds": 3},
           "builds": [{"kind": "path graph", "paths": 1, "records": 10, "lower_s": 0.5,
                       "instantiate_s": 0.25},
                      {"kind": "path graph", "paths": 1, "records": 12, "lower_s": 0.25,
                       "instantiate_s": None},
                      {"kind": "site graph", "paths": 2, "records": 22, "lower_s": 1.5,
                       "instantiate_s": 0.5}]}
    md = site_build_growth.markdown(res, {"machine": "m", "tf": "t", "date": "d"})
    assert "| 1 | path graph | 1 | 10 | 0.50 | 0.25 | 0.75 |" in md
    assert "| 2 | path graph | 1 | 12 | 0.25 | n/a | 0.25 |" in md
    assert "| 3 | site graph | 2 | 22 | 1.50 | 0.50 | 2.00 |" in md
    assert "0.38 s on average over 2" in md and "2 paths 1.50 s" in md
