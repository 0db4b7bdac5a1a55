"""`CompileCounter`: what Terra did inside a block, as exact counts (in the spirit of
TorchDynamo's `torch._dynamo.testing.CompileCounter`).

    with CompileCounter() as c:
        run(tf.TerraGradientTape)
    c.assert_counts(traces=3, graph_builds=1, fallbacks=0)

The block's last iteration is ended on exit. A mismatch shows every differing count and
`terra.explain()`.
"""
import terra

COUNTED = ("iterations", "traces", "new_paths", "graph_builds", "graph_reuses", "role_renames", "fallbacks",
           "path_switches",
           "case_switches", "held_iterations", "held_switches", "pure_tails", "static_reads",
           "eager_twins", "twin_units", "verdicts_kept", "speculations", "speculation_hits")


class CompileCounter:
    def __enter__(self):
        self.before = terra.stats()
        return self

    def __exit__(self, *exc_info):
        if exc_info[0] is None:
            terra.end_iteration()
        self.after = terra.stats()
        return False

    def __getattr__(self, name):
        if name in COUNTED:
            return self.after[name] - self.before[name]
        raise AttributeError(name)

    def assert_counts(self, **expected):
        unknown = set(expected) - set(COUNTED)
        if unknown:
            raise ValueError(f"CompileCounter: not counted: {sorted(unknown)}")
        got = {k: getattr(self, k) for k in expected}
        if got != expected:
            diff = ", ".join(f"{k}: {got[k]} (expected {v})" for k, v in expected.items()
                             if got[k] != v)
            raise AssertionError(f"terra counts differ: {diff}\n{terra.explain()}")
