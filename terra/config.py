"""Terra's user-visible settings (`terra.config(...)`).

One process-wide `Config`; `configure(**changes)` validates and applies changes and returns the
settings in force before, so tests can restore them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class Config:
    """enabled: TerraGradientTape co-executes (False: it is a plain tf.GradientTape).
    coexecution: run the graph concurrently with Python (False: "lazy evaluation", the graph runs
      only when Python needs a value or the iteration ends, serialized with Python).
    overlap_iterations: with coexecution, Python starts the next iteration while the graph still
      runs the previous one (an op error after an iteration's last sync point then surfaces at
      the next sync point, as with TF's asynchronous execution; False: each iteration's graph
      ends before the next iteration begins).
    max_traces: distinct traces per iteration site before that site stays eager (one warning);
      a site also stays eager after 2 x max_traces graph builds (unless its graphs served more
      iterations than it built graphs), or once 4 paths first seen
      after it compiled were seen only once while none of its graphs ever served an iteration
      (its paths keep changing).
    max_fallbacks: fallbacks per site before it stays eager (or, once its graphs have served
      more iterations than that, as many fallbacks as they served). A fallback onto a path the site has
      seen before, after 8 or more iterations without one (an epoch's end: a new data iterator),
      is a known cost and does not count; nor is one onto new variables whose path then runs
      an earlier path's graph (a metric made every epoch), after 4 or more.
    xla: compile the compute between feed/fetch points of generated graphs with XLA (TF's
      explicit clustering; channel, random and XLA-less ops stay on TF's executor; results
      equal eager within XLA's rounding; on CPU not faster, measured in docs/usage.md).
    grappler: run generated graphs with Grappler (faster; results equal eager to about an ulp).
    arithmetic_optimizer: let Grappler's arithmetic optimizer rewrite generated graphs. Off by
      default: its rewrites change rounding, which training amplifies (ResNet-50's loss moved
      24% away from eager's in 14 steps with it; equal without, docs/usage.md).
    remapper: let Grappler's remapper fuse ops of generated graphs (MatMul / Conv2D + BiasAdd +
      activation into one kernel). Off by default: the fused kernels differ from eager's ops on
      NaN on some CPUs (a Dense layer's fused ReLU turned a NaN input into 0, so a NaN loss came
      out finite and a user's `isfinite` guard never fired; docs/usage.md).
    constant_folding: let Grappler fold constants in generated graphs. Off by default: besides
      folding, it rewrites arithmetic around constants, which changes rounding; the gradients of
      an Embedding + LayerNormalization model differed from eager's by an ulp from the first
      compiled step, and Adam amplified that past 1e-5 on directions the loss does not depend on
      (tests/fuzz seeds 776 and 891 of the slow sweep; equal without it). Integer shape
      arithmetic is folded either way, exactly, when the graph is built (compiler/fold.py).
    timeout_s: bound of every internal wait; reaching it raises TerraTimeoutError naming the op.
    verbose: 0 silent, 1 one line per trace/fallback/graph build, 2 also per iteration.
    max_trace_ops: recording stops (site treated as unsupported) beyond this many ops.
    tracing_gc_threshold: while an iteration is recorded, the garbage collector's young
      generation collects after at least this many allocations (Python's default is 700); the
      previous thresholds come back when recording stops. 0: the collector is left alone
      (terra/tracing/gc_window.py: a traced resnet50 step spent 320-560 ms collecting).
    coexec_gc_threshold: the same while an iteration co-executes (from its tape's entry to the
      next one): its placeholders and skeleton objects live until it ends, and with Python's
      default every one that a young collection met was promoted, until a full collection of
      the whole process (yolov3_like: 3-5 ms of collection per 35 ms step). 0: left alone.
    layer_units: match calls of Keras' built-in layers, loss objects and plain Sequential /
        functional models of built-in layers, and the `update_state` of Keras' averaging
        metrics (`Mean`, `Sum`, accuracies and errors), as one guarded unit each.
    user_layer_units: also match a call of a user-defined layer or model as one unit where its
        Python, watched while traced, only computed (terra/tracing/purity.py); needs
        `layer_units`.
    api_units: match a program's call of a composite TF function (`tfp.API_UNIT_FUNCTIONS`:
        the cross-entropies of `tf.nn`, ten ops of TF Python around each kernel; and
        `API_UNIT_METHODS`: tensor indexing) as one guarded unit, as a tf.function call is.
    background_builds: build a path's graph (and a site graph) on a builder thread while the
      program goes on (its iterations run as before it was compiled until the graph is
      installed, at the next iteration boundary). Off by default: graph construction is Python and holds the GIL, so
      on the 2-core machine measured the builder slowed the program's thread more than it
      saved (docs/usage.md, "Background builds").
    tiered_instantiation: a new graph's first runs skip Grappler (its instantiation is then
      a third as long) while a second thread instantiates it with Grappler, which the runs
      started after that use (runtime/tiers.py). Only with `grappler`, and only for a site's
      later graphs. Off by default: on the 2-core machine measured the second thread's
      instantiation took the CPU back from the program (docs/usage.md, "Tiered instantiation").
    site_graph: a site with two or more compiled paths runs one lowered graph for all of them
      (switch_case / while_loop): a branch Python takes is a Case-Select put, not a restart.
      True: at every such site. "auto" (the default): at a site whose restarts after a read
      (a random branch after a mid-step read: each restart runs the graph up to the read
      again) have thrown away as much graph time as the site graph would cost to build
      (runtime/policy.py, `takes_site_graph`; a path compiled later joins it once restarts
      involving it pay for the rebuild: `rebuilds_site_graph`); elsewhere paths switch by
      restarting, which costs no more per step where measured and needs no site-wide rebuild
      per new path (docs/usage.md, "Branches: the site graph"). False: never.
    shape_groups: paths that differ only in shapes (another batch size or sequence length) and
      in constants made from them share one graph whose differing dimensions are unknown and
      which computes those constants from the shapes it holds where the members show how: a
      new length runs on it untraced, or costs a trace and no build (docs/usage.md, "Varying
      shapes"). In a site graph, a group is one path (its members put their constants).
    speculation: a new path of a site that runs graphs already, which resizes an image to a
      size Python computed, gets a shape group's graph of its own, with that size put and the
      counts made from it computed (runtime/shape_groups.py, `speculate`): the path with
      another size joins it at its first trace with no build (docs/usage.md, "Varying
      shapes"). Needs `shape_groups`.
    commit_writes: a compiled path's variable writes wait until Python has ended the iteration
      on its path (or reads a value that depends on a write), and the graph's ops that can fail
      on their data run first: a run abandoned or failed before then has written nothing, so no
      variable snapshot is taken per run (one graph call and one copy of every written variable
      each step; terra/compiler/commit.py). False: snapshot before every run.
    """
    enabled: bool = True
    coexecution: bool = True
    overlap_iterations: bool = True
    max_traces: int = 8
    max_fallbacks: int = 20
    xla: bool = False
    grappler: bool = True
    arithmetic_optimizer: bool = False
    remapper: bool = False
    constant_folding: bool = False
    timeout_s: float = 120.0
    verbose: int = 0
    max_trace_ops: int = 50000
    tracing_gc_threshold: int = 50000
    coexec_gc_threshold: int = 50000
    layer_units: bool = True
    user_layer_units: bool = True
    api_units: bool = True
    site_graph: bool | str = "auto"
    background_builds: bool = False
    tiered_instantiation: bool = False
    shape_groups: bool = True
    speculation: bool = True
    commit_writes: bool = True


CONFIG = Config()

_CHECKS = {
    "enabled": (bool,), "coexecution": (bool,), "overlap_iterations": (bool,), "xla": (bool,), "grappler": (bool,),
    "arithmetic_optimizer": (bool,), "remapper": (bool,), "constant_folding": (bool,), "layer_units": (bool,),
    "user_layer_units": (bool,), "api_units": (bool,), "site_graph": (bool, str),
    "background_builds": (bool,), "tiered_instantiation": (bool,), "shape_groups": (bool,), "speculation": (bool,),
    "commit_writes": (bool,),
    "max_traces": (int,), "max_fallbacks": (int,), "verbose": (int,), "max_trace_ops": (int,),
    "tracing_gc_threshold": (int,), "coexec_gc_threshold": (int,),
    "timeout_s": (int, float),
}


def configure(**changes) -> dict:
    """Apply `changes` (see `Config`); returns the previous values of the changed settings."""
    old = {}
    for name, value in changes.items():
        types = _CHECKS.get(name)
        if types is None:
            raise ValueError(f"terra.config: unknown setting {name!r}; known: {sorted(_CHECKS)}")
        if name == "site_graph":
            if value not in (True, False, "auto") or type(value) not in (bool, str):
                raise TypeError(f"terra.config: site_graph must be True, False or 'auto', "
                                f"got {value!r}")
        elif not isinstance(value, types) or (types != (bool,) and isinstance(value, bool)):
            raise TypeError(f"terra.config: {name} must be {types[0].__name__}, got {value!r}")
        if name in ("max_traces", "max_fallbacks", "max_trace_ops") and value < 1:
            raise ValueError(f"terra.config: {name} must be >= 1, got {value!r}")
        if name in ("tracing_gc_threshold", "coexec_gc_threshold") and value < 0:
            raise ValueError(f"terra.config: {name} must be >= 0, got {value!r}")
        if name == "timeout_s" and value <= 0:
            raise ValueError(f"terra.config: timeout_s must be > 0, got {value!r}")
        old[name] = getattr(CONFIG, name)
    for name, value in changes.items():
        setattr(CONFIG, name, value)
    return old


def as_dict() -> dict:
    return dataclasses.asdict(CONFIG)
