from benchmarks import collect


def test_collect_nests_reports_and_lists_missing(tmp_path):
    (tmp_path / "results.md").write_text("# Benchmark results\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (tmp_path / "pipeline.md").write_text("# Pipeline\n\n## Cluster mode\ntext\n")
    text = collect.collect(str(tmp_path))
    assert "## Benchmark results" in text and "### Cluster mode" in text
    assert "| 1 | 2 |" in text
    assert text.index("## Benchmark results") < text.index("## Pipeline")
    assert "`coexec.md`: not run yet" in text and "`hook_overhead.md`: not run yet" in text
    assert "`results.md`: not run yet" not in text
