"""Random eager training programs, as source text, from a seed.

`generate(seed, exclude=())` returns the text of a standalone Python script. Its `program(Tape, R)`
is a small eager training loop written as a user would write it (Keras layers, an optimizer, a
Python loop over steps with `with Tape() as tape:`), made of features drawn from the seed:

- layers: Dense with a random activation, Activation, Dropout (a fixed seed, training=True or
  False), LayerNormalization, BatchNormalization, Embedding; a regression or a classifier head
- Python branches on Python-random values and on fetched values (`float(loss) > t`, `.numpy()`)
- a Python loop of random length inside the tape (a residual block applied 1-3 times)
- NaN / Inf in one step's data, with or without the user's `isfinite` guard
- Python exceptions raised in the tape and caught by the user; an uncaught one that ends the
  program; a TF op error (out-of-range gather) caught by the user
- early exit (`break`) on a step or on a fetched value
- values kept across iterations (`total += loss`, a list of losses or gradients, read later)
- Python state on an object mutated every step and used as a Python float in the loss
- gradient clipping, a `tf.function` penalty, a learning-rate assign, a smaller last batch
- gradient accumulation (`gradient_accumulation_steps`), `LossScaleOptimizer`, a `tf.range`
  whose shape depends on a value, a branch on a `tf.Variable` counter, random noise on the
  input (a `tf.random.Generator` or stateful `tf.random.normal` under the global seed), the
  optimizer built before the loop or on its first step, a persistent tape with a second
  gradient, a second tape and optimizer in the step (as in a GAN), an op inside
  `tape.stop_recording()` at random steps only (the same op, recorded otherwise), a batch size
  drawn per step from three (shape groups)
- added later (`EXTENDED`, drawn after the above): two epochs, a generator of batches, a user
  layer with Python state, a sequence of a length drawn per step (with a causal mask of it), an
  image resized to a size Python computes, rows chosen by value (a data-dependent shape), a Keras
  metric, recursion, a hand-updated variable, `tf.cond`, NumPy batches, a layer frozen mid-run,
  `tf.py_function`, a `tf.data` loop, a branch on `optimizer.iterations`; and `fit`: the
  program as `keras.Model.fit(run_eagerly=True)` over a custom `train_step` (`_fit_program`)

The script's harness (`run_both`) runs the program eagerly (`tf.GradientTape`) and then under
Terra (`tf.TerraGradientTape`, after `terra.reset()`, with a short `timeout_s`), and compares
everything: per-step losses, printed lines, the program's log of Python side effects, final
model and optimizer variables, `optimizer.iterations`, and the exception (type, step, line).
`python script.py` runs it and exits 1 when Terra differs from eager.

Every random choice is drawn in a fixed order whether or not a feature is excluded, so excluding
a feature (see `KNOWN_GAPS` in tests/fuzz/runner.py) leaves the seed's other choices unchanged.
"""
from __future__ import annotations

import contextlib
import random
from contextlib import contextmanager

# Every feature the generator can put in a program; `exclude` takes names from this list.
FEATURES = (
    "dropout", "layernorm", "batchnorm", "embedding", "classifier",
    "inner_loop", "py_branch", "value_branch", "numpy_scalar", "state_scale",
    "nan", "nan_unguarded", "raise_caught", "raise_uncaught", "op_error",
    "break_step", "break_value", "keep_total", "keep_list", "keep_grads",
    "print", "fetch_each_step", "clip", "tf_function", "lr_assign", "small_last_batch",
    "end_iteration", "grad_accum", "loss_scale", "value_shape", "var_counter", "noise",
    "opt_build", "persistent", "second_tape", "stop_recording", "varying_batch",
    # drawn after all of the above (`EXTENDED`): the programs of earlier seeds keep their choices
    "epochs", "generator", "user_layer", "sequence", "resize", "mask", "metric",
    "recursion", "manual_update", "tf_cond", "numpy_batch",
    "freeze", "py_function", "tf_data", "iterations_branch", "fit",
)
#: Features added later than the others: off for a regression seed, whose program stays the one
#: that found its bug (tests/fuzz/test_fuzz.py).
EXTENDED = ("epochs", "generator", "user_layer", "sequence", "resize", "mask", "metric",
            "recursion", "manual_update", "tf_cond", "numpy_batch",
            "freeze", "py_function", "tf_data", "iterations_branch", "fit")


class _Src:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, *lines: str) -> None:
        for text in lines:
            self.lines.append("    " * self.depth + text if text else "")

    @contextmanager
    def block(self, header: str):
        self(header)
        self.depth += 1
        yield
        self.depth -= 1


def choose(seed: int, exclude=()) -> dict:
    """The seed's choices: which features are on, and their parameters."""
    r = random.Random(seed)
    bad = set(exclude)
    unknown = bad - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {FEATURES}")
    on = {}

    def feat(name, p):
        drawn = r.random() < p  # always drawn: exclusions leave the other choices as they were
        on[name] = drawn and name not in bad
        return on[name]

    c = {"seed": seed}
    c["steps"] = r.randint(4, 7)
    c["batch"] = r.choice([2, 3, 4])
    c["d_in"] = r.randint(2, 5)
    c["hidden"] = r.choice([3, 4, 6])
    c["n_hidden"] = r.randint(1, 2)
    c["acts"] = [r.choice(["relu", "tanh", "sigmoid", None, "gelu", "elu"]) for _ in range(2)]
    c["optimizer"] = r.choice(["SGD", "SGD_momentum", "Adam", "RMSprop"])
    c["lr"] = r.choice([0.01, 0.05, 0.1])
    feat("embedding", 0.15)
    feat("classifier", 0.3)
    c["classes"] = r.randint(2, 4)
    feat("dropout", 0.3)
    c["dropout_rate"] = r.choice([0.1, 0.3, 0.5])
    c["dropout_training"] = r.random() < 0.6
    feat("layernorm", 0.2)
    feat("batchnorm", 0.1)
    c["act_layer"] = r.choice([None, None, "relu", "tanh"])
    feat("inner_loop", 0.2)
    c["inner_max"] = r.randint(2, 3)
    feat("py_branch", 0.25)
    c["py_p"] = r.choice([0.1, 0.2, 0.5, 0.9])
    feat("value_branch", 0.25)
    c["value_t"] = round(r.uniform(0.2, 1.5), 3)
    c["value_action"] = r.choice(["scale", "extra"])
    feat("numpy_scalar", 0.2)
    feat("state_scale", 0.3)
    c["decay"] = r.choice([0.9, 0.95, 0.99])
    feat("nan", 0.3)
    c["nan_step"] = r.randint(c["steps"] // 2, c["steps"] - 1)  # mostly after a graph is built
    c["nan_value"] = r.choice(["nan", "inf", "-inf"])
    c["nan_where"] = r.choice(["x", "y"])
    feat("nan_unguarded", 0.15)
    feat("raise_caught", 0.3)
    c["raise_cond"] = r.choice(["step", "step", "random", "value"])
    c["raise_step"] = r.randint(0, c["steps"] - 1)
    c["raise_where"] = r.choice(["before_loss", "after_loss"])
    c["try_scope"] = r.choice(["tape", "step"])
    feat("raise_uncaught", 0.08)
    c["uncaught_step"] = r.randint(1, c["steps"] - 1)
    c["uncaught_where"] = r.choice(["tape", "after_apply"])
    feat("op_error", 0.1)
    c["op_error_step"] = r.randint(0, c["steps"] - 1)
    feat("break_step", 0.2)
    c["break_at"] = r.randint(1, c["steps"] - 1)
    feat("break_value", 0.2)
    c["break_t"] = round(r.uniform(0.05, 0.8), 3)
    feat("keep_total", 0.5)
    c["total_tensor"] = r.random() < 0.5
    feat("keep_list", 0.5)
    feat("keep_grads", 0.2)
    feat("print", 0.5)
    c["print_every"] = r.randint(1, 3)
    feat("fetch_each_step", 0.7)
    feat("clip", 0.3)
    c["clip_kind"] = r.choice(["norm", "global"])
    feat("tf_function", 0.2)
    feat("lr_assign", 0.15)
    feat("small_last_batch", 0.15)
    feat("end_iteration", 0.5)
    c["seq"] = r.randint(2, 4)
    c["vocab"] = r.randint(5, 9)
    feat("grad_accum", 0.1)
    c["accum_steps"] = r.randint(2, 3)
    feat("loss_scale", 0.1)
    c["initial_scale"] = r.choice([2.0 ** 4, 2.0 ** 10, 2.0 ** 15])
    feat("value_shape", 0.1)
    c["shape_values"] = [r.choice([1, 1, 2, 3]) for _ in range(c["steps"])]
    c["shape_read"] = r.random() < 0.5
    feat("var_counter", 0.15)
    c["counter_mod"] = r.randint(2, 3)
    feat("noise", 0.2)
    c["noise_kind"] = r.choice(["generator", "stateful"])
    feat("opt_build", 0.5)
    feat("persistent", 0.15)
    feat("second_tape", 0.15)
    feat("stop_recording", 0.15)  # (drawn last: the choices above are those of earlier versions)
    c["stop_p"] = r.choice([0.3, 0.5, 0.8])
    feat("varying_batch", 0.25)  # (drawn after stop_recording, for the same reason)
    c["batch_sizes"] = [r.choice([c["batch"], max(1, c["batch"] - 1), max(1, c["batch"] - 2)])
                        for _ in range(c["steps"])]
    # ---- EXTENDED features (drawn last, in this order)
    feat("epochs", 0.2)  # the steps run twice (compiled paths run again, a path meets its past)
    feat("generator", 0.2)  # batches come from a Python generator
    feat("user_layer", 0.2)  # a user-defined layer, with Python state it mutates or without
    c["gate_every"] = r.choice([0, 2, 3])  # 0: pure; else every n-th call scales by 0.5
    feat("sequence", 0.25)  # a sequence input of a length drawn per step (shape groups)
    c["seq_max"] = r.randint(3, 5)
    c["seq_lens"] = [r.randint(2, c["seq_max"]) for _ in range(c["steps"])]
    c["seq_causal"] = r.random() < 0.5  # a causal mask made from the length Python reads
    feat("resize", 0.2)  # an image resized to a size Python computes from a random ratio
    c["resize_ratios"] = r.choice([[0.5, 1.5], [0.5, 0.75, 1.5], [0.75]])
    feat("mask", 0.2)  # a data-dependent shape: rows chosen by value
    c["mask_kind"] = r.choice(["boolean_mask", "where"])
    c["mask_read"] = r.choice([None, "log", "branch"])  # what Python does with the row count
    feat("metric", 0.25)  # a Keras Mean metric updated every step, read and reset
    c["metric_every"] = r.randint(1, 3)
    feat("recursion", 0.15)  # a recursive Python function of random depth in the forward pass
    c["recursion_max"] = r.randint(1, 3)
    feat("manual_update", 0.2)  # an extra variable updated by hand with a Python-float rate
    c["manual_decay"] = r.choice([0.5, 0.9])
    feat("tf_cond", 0.15)  # tf.cond on a tensor predicate (eagerly: one branch runs)
    feat("numpy_batch", 0.2)  # the model called on NumPy arrays, not tensors
    feat("freeze", 0.15)  # the head's layer is frozen from a step on (the trained list changes)
    c["freeze_at"] = r.randint(1, c["steps"] - 1)
    feat("py_function", 0.15)  # a tf.py_function in the loss (Python run by the op)
    feat("tf_data", 0.2)  # batches from a tf.data.Dataset (instead of slicing arrays)
    feat("iterations_branch", 0.15)  # a branch on optimizer.iterations, read in Python
    # Keras `fit(run_eagerly=True)` over a custom `train_step` (`_fit_program`), instead of a
    # loop of the program's own: the features that apply to a train_step are kept
    feat("fit", 0.15)
    c["fit_shuffle"] = r.random() < 0.5
    c["fit_validation"] = r.random() < 0.4
    c["features"] = on
    return c


def generate(seed: int, exclude=(), timeout_s: float = 20.0, exact: bool = False,
             config=None) -> str:
    """The source of the standalone script for `seed` (features in `exclude` off); `config`:
    further `terra.config` settings for the Terra run."""
    settings = {"timeout_s": float(timeout_s), **(config or {})}
    c = choose(seed, exclude)
    f = c["features"]
    on = sorted(k for k, v in f.items() if v)
    s = _Src()
    s(f'"""Terra fuzz program, seed {seed}. Features: {", ".join(on) or "none"}.',
      "",
      "`python this_file.py` runs the program eagerly and then under Terra (tf.TerraGradientTape),",
      'prints both outcomes and exits 1 if they differ."""',
      "import contextlib",
      "import io",
      "import os",
      "import random",
      "import sys",
      "import traceback",
      "",
      'os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")',
      "",
      "import keras  # noqa: E402",
      "import numpy as np  # noqa: E402",
      "import tensorflow as tf  # noqa: E402",
      "",
      "import terra  # noqa: E402",
      "",
      f"SEED = {seed}",
      f"FEATURES = {on!r}",
      f"TERRA_CONFIG = {settings!r}  # timeout_s bounds every wait: a hang becomes an error",
      f"EXACT = {bool(exact)!r}  # compare losses and variables bit for bit (else rtol 1e-5)",
      "STEP = [None]  # the step the program is in (an exception's step)",
      "",
      "",
      "class StepError(Exception):",
      "    pass",
      "",
      "",
      "class State:",
      "    def __init__(self):",
      "        self.scale = 1.0",
      "        self.seen = 0",
      "        self.history = []",
      "",
      "",
      )
    if f["user_layer"]:
        s("class Gate(keras.layers.Layer):",
          '    """A user-defined layer; with `every`, it counts its calls and scales every n-th."""',
          "",
          "    def __init__(self, every, **kwargs):",
          "        super().__init__(**kwargs)",
          "        self.every, self.calls = every, 0",
          "",
          "    def build(self, shape):",
          '        self.w = self.add_weight(shape=(shape[-1],), initializer="ones")',
          "",
          "    def call(self, x):",
          "        if not self.every:",
          "            return x * self.w",
          "        self.calls += 1",
          "        return x * self.w * (0.5 if self.calls % self.every == 0 else 1.0)",
          "", "")
    if f["tf_function"]:
        s("@tf.function",
          "def penalty(ws):",
          "    return tf.add_n([tf.reduce_sum(w * w) for w in ws])",
          "", "")
    (_fit_program if f["fit"] else _program)(s, c)
    s("", "")
    s(*_HARNESS.splitlines())
    return "\n".join(s.lines) + "\n"


def _program(s: _Src, c: dict) -> None:
    f = c["features"]
    B, D, H, T = c["batch"], c["d_in"], c["hidden"], c["steps"]
    out_dim = c["classes"] if f["classifier"] else 1
    training = "True" if c["dropout_training"] else "False"
    with s.block("def program(Tape, R):"):
        s("keras.utils.set_random_seed(SEED)",
          "prng = random.Random(SEED + 1)  # the program's own Python-random choices",
          "drng = np.random.default_rng(SEED)")
        # ---------------------------------------------------------------- model
        if f["embedding"]:
            layers = [f'keras.Input(({c["seq"]},), dtype="int32")',
                      f'keras.layers.Embedding({c["vocab"]}, {H})',
                      "keras.layers.GlobalAveragePooling1D()"]
        else:
            layers = [f"keras.Input(({D},))"]
        for i in range(c["n_hidden"]):
            act = c["acts"][i]
            if i == 0 and f["batchnorm"]:  # no bias before BatchNormalization (it cancels it)
                layers.append(f"keras.layers.Dense({H}, use_bias=False)")
            else:
                layers.append(f"keras.layers.Dense({H}, activation={act!r})")
            if i == 0 and f["layernorm"]:
                layers.append("keras.layers.LayerNormalization()")
            if i == 0 and f["batchnorm"]:
                layers.append("keras.layers.BatchNormalization()")
            if i == 0 and c["act_layer"]:
                layers.append(f'keras.layers.Activation({c["act_layer"]!r})')
            if i == 0 and f["dropout"]:
                layers.append(f'keras.layers.Dropout({c["dropout_rate"]}, seed={c["seed"] % 97})')
        s("trunk = keras.Sequential([")
        for layer in layers:
            s(f"    {layer},")
        s("])")
        s(f"head = keras.Sequential([keras.Input(({H},)), keras.layers.Dense({out_dim})])")
        models = ["trunk", "head"]
        if f["inner_loop"]:
            s(f'block = keras.Sequential([keras.Input(({H},)), keras.layers.Dense({H}, activation="tanh")])')
            models.append("block")
        if f["user_layer"]:
            s(f"gate = Gate({c['gate_every']})",
              f"gate.build((None, {H}))")
            models.append("gate")
        if f["sequence"]:
            s(f'seqnet = keras.Sequential([keras.Input((None, 2)), keras.layers.Dense({H}, activation="tanh")])')
            models.append("seqnet")
        if f["resize"]:
            # (a Dense per pixel, not a Conv2D: graph kernels round a convolution's last bit
            # differently from eager's, docs/testing.md)
            s(f'pixels = keras.Sequential([keras.Input((None, None, 1)), '
              f'keras.layers.Dense({H}, activation="relu")])')
            models.append("pixels")
        if f["recursion"]:
            with s.block("def deepen(h, k):  # recursion of a depth drawn per step"):
                with s.block("if k == 0:"):
                    s("return h")
                s("return deepen(h + 0.1 * tf.tanh(h), k - 1)")
        opt = {"SGD": f'keras.optimizers.SGD({c["lr"]})',
               "SGD_momentum": f'keras.optimizers.SGD({c["lr"]}, momentum=0.9)',
               "Adam": f'keras.optimizers.Adam({c["lr"]})',
               "RMSprop": f'keras.optimizers.RMSprop({c["lr"]})'}[c["optimizer"]]
        if f["grad_accum"]:
            opt = opt[:-1] + f", gradient_accumulation_steps={c['accum_steps']})"
        if f["loss_scale"]:
            opt = (f"keras.optimizers.LossScaleOptimizer({opt}, "
                   f"initial_scale={c['initial_scale']}, dynamic_growth_steps=2)")
        s(f"opt = {opt}",
          f"R[\"models\"], R[\"opt\"] = [{', '.join(models)}], opt",
          f"params = {' + '.join(m + '.trainable_variables' for m in models)}")
        if f["manual_update"]:
            s(f"bias = tf.Variable(tf.zeros(({out_dim},)))  # updated by hand, not by the optimizer",
              'R["extra"] = [bias]  # compared with the variables')
        if f["second_tape"]:
            s("aux_opt = keras.optimizers.SGD(0.01)")
            s('R["aux_opt"] = aux_opt')
        if f["opt_build"]:
            s("opt.build(params)  # the optimizer's variables exist before the first step")
        # ---------------------------------------------------------------- data
        if f["embedding"]:
            s(f'xs = drng.integers(0, {c["vocab"]}, size=({T}, {B}, {c["seq"]})).astype("int32")')
        else:
            s(f'xs = drng.normal(size=({T}, {B}, {D})).astype("float32")')
        if f["classifier"]:
            s(f'ys = drng.integers(0, {out_dim}, size=({T}, {B})).astype("int32")')
        else:
            s(f'ys = drng.normal(size=({T}, {B}, 1)).astype("float32")')
        bad = f["nan"] or f["nan_unguarded"]
        if bad:
            where = c["nan_where"]
            if f["embedding"] or (where == "y" and f["classifier"]):
                where = "y" if not f["classifier"] else None
            if f["embedding"] and f["classifier"]:
                where = None
            val = {"nan": 'float("nan")', "inf": 'float("inf")', "-inf": '-float("inf")'}[c["nan_value"]]
            if where is None:  # nothing float to poison: the loss itself is poisoned
                c["nan_in_loss"] = val
            else:
                s(f"{where}s[{c['nan_step']}, 0, 0] = {val}  # a bad batch")
        if f["sequence"]:
            s(f'ss = drng.normal(size=({T}, {B}, {c["seq_max"]}, 2)).astype("float32")',
              f"seq_lens = {c['seq_lens']!r}")
        if f["metric"]:
            s("metric = keras.metrics.Mean()")
        s("state = State()")
        if f["value_shape"]:
            s(f"lengths = {c['shape_values']!r}")
        if f["var_counter"]:
            s('counter = tf.Variable(0, dtype="int64")')
        if f["noise"] and c["noise_kind"] == "generator":
            s("g = tf.random.Generator.from_seed(SEED)")
        if f["keep_total"]:
            s("total = tf.constant(0.0)" if c["total_tensor"] else "total = 0.0")
        if f["keep_list"]:
            s("kept = []")
        if f["keep_grads"]:
            s("kept_grads = []")
        s('R["losses"], R["log"] = [], []')
        # ---------------------------------------------------------------- loop
        data = []  # the lines that make one step's batch
        if f["varying_batch"]:
            data += [f"n = {c['batch_sizes']!r}[step]  # a batch size drawn per step",
                     "x, y = tf.constant(xs[step][:n]), tf.constant(ys[step][:n])"]
        elif f["small_last_batch"]:
            data += [f"n = {B} if step < {T - 1} else {max(1, B - 1)}  # a smaller last batch",
                     "x, y = tf.constant(xs[step][:n]), tf.constant(ys[step][:n])"]
        else:
            data += ["x, y = tf.constant(xs[step]), tf.constant(ys[step])"]
        dataset = f["tf_data"] and not (f["generator"] or f["varying_batch"] or
                                        f["small_last_batch"] or f["sequence"])
        if dataset:  # the batches come from the dataset; the loop takes them
            data = []
        if f["numpy_batch"]:  # the same arrays, not made tensors: Keras converts them
            data = [line.replace("tf.constant(", "np.asarray(") for line in data]
        batch = "x, y"
        if f["sequence"]:
            rows = ":n" if f["varying_batch"] or f["small_last_batch"] else ":"
            data.append(f"sx = tf.constant(ss[step][{rows}, :seq_lens[step]])  # this step's length")
            batch += ", sx"
        if f["generator"]:
            with s.block("def batches():  # a generator of the batches"):
                with s.block(f"for step in range({T}):"):
                    s(*data)
                    s(f"yield {batch}")
        epochs = s.block("for epoch in range(2):") if f["epochs"] else contextlib.nullcontext()
        loop = f"for step, ({batch}) in enumerate(batches()):" if f["generator"] else \
            f"for step, ({batch}) in enumerate(dataset):" if dataset else f"for step in range({T}):"
        if dataset:
            s("dataset = tf.data.Dataset.from_tensor_slices((xs, ys))  # one batch per element")
        with epochs, s.block(loop):
            s("STEP[0] = step")
            if data and not f["generator"]:
                s(*data)
            if f["freeze"]:
                with s.block(f"if step == {c['freeze_at']}:"):
                    s("head.layers[-1].trainable = False  # frozen from here on",
                      'R["log"].append(("frozen", step))')
                s(f"params = {' + '.join(m + '.trainable_variables' for m in models)}")
            if f["lr_assign"]:
                s(f"opt.learning_rate.assign({c['lr']} * 0.9 ** step)")
            if f["state_scale"]:
                s(f"state.scale *= {c['decay']}")
            caught = f["raise_caught"] or f["op_error"]
            if caught:
                s("try:")
                s.depth += 1
            _tape(s, c, training)
            if c["try_scope"] == "tape" and caught:
                _except(s, c)
            if f["nan"]:
                with s.block("if not np.isfinite(float(loss)):"):
                    s('R["log"].append(("skipped", step))', "continue")
            target = "scaled" if f["loss_scale"] else "loss"
            if f["manual_update"]:
                s(f"grads, g_bias = tape.gradient({target}, (params, bias))",
                  f"bias.assign_sub({c['lr']} * {c['manual_decay']} ** step * g_bias)  # a Python-float rate")
            else:
                s(f"grads = tape.gradient({target}, params)")
            if f["clip"]:
                if c["clip_kind"] == "norm":
                    s("grads = [tf.clip_by_norm(g, 1.0) for g in grads]")
                else:
                    s("grads, norm = tf.clip_by_global_norm(grads, 1.0)")
            s("opt.apply_gradients(zip(grads, params))")
            if f["metric"]:
                s("metric.update_state(loss)")
                with s.block(f"if step % {c['metric_every']} == {c['metric_every'] - 1}:"):
                    s('R["log"].append(("metric", step, round(float(metric.result()), 4)))',
                      "metric.reset_state()")
            if f["persistent"]:
                s("head_grads = tape.gradient(loss, head.trainable_variables)  # a second gradient",
                  "head_norm = float(tf.linalg.global_norm(head_grads))",
                  'R["log"].append(("head grad norm", step, round(head_norm, 3)))',
                  "del tape")
            if f["second_tape"]:
                with s.block("with Tape() as tape2:  # a second model's step, as in a GAN"):
                    s("aux = tf.reduce_mean(tf.square(head(tf.stop_gradient(h)) - 0.5))")
                s("aux_grads = tape2.gradient(aux, head.trainable_variables)",
                  "aux_opt.apply_gradients(zip(aux_grads, head.trainable_variables))")
            if c["try_scope"] == "step" and caught:
                _except(s, c)
            if f["raise_uncaught"] and c["uncaught_where"] == "after_apply":
                with s.block(f"if step == {c['uncaught_step']}:"):
                    s('raise RuntimeError(f"stopped at step {step}")')
            if f["fetch_each_step"]:
                s('R["losses"].append(float(loss))')
            if f["keep_total"]:
                s("total += loss")
            if f["keep_list"]:
                s("kept.append(loss)")
            if f["keep_grads"]:
                s("kept_grads.append(grads[-1])")
            s("state.seen += 1")
            if f["print"]:
                with s.block(f"if step % {c['print_every']} == 0:"):
                    s('print(f"step {step}: loss {loss:.4f}")')
                    if f["keep_list"]:
                        s('print(f"mean of the last 3 {tf.reduce_mean(tf.stack(kept[-3:])):.4f}")')
            if f["break_step"]:
                with s.block(f"if step == {c['break_at']}:"):
                    s('R["log"].append(("break", step))', "break")
            if f["break_value"]:
                with s.block(f"if float(loss) < {c['break_t']}:"):
                    s('R["log"].append(("converged", step))', "break")
        # ---------------------------------------------------------------- after the loop
        if f["end_iteration"]:
            s("terra.end_iteration()")
        if f["keep_total"]:
            s('R["total"] = float(total)')
        if f["keep_list"]:
            s('R["kept"] = [float(v) for v in kept]')
        if f["keep_grads"]:
            s('R["kept_grads"] = [g.numpy() for g in kept_grads]')
        if f["user_layer"]:
            s('R["gate_calls"] = gate.calls')
        if f["metric"]:
            s('R["metric"] = round(float(metric.result()), 4)')
        s('R["state"] = (state.scale, state.seen, state.history)')


def _fit_program(s: _Src, c: dict) -> None:
    """The program as Keras' `fit` runs it: a model whose `train_step` opens the tape, fed
    arrays by `fit(..., run_eagerly=True)` (each step one Terra iteration), with callbacks that
    read the logs and may stop training."""
    f = c["features"]
    B, D, H, T = c["batch"], c["d_in"], c["hidden"], c["steps"]
    out_dim = c["classes"] if f["classifier"] else 1
    training = "True" if c["dropout_training"] else "False"
    layers = [f"keras.layers.Embedding({c['vocab']}, {H})",
              "keras.layers.GlobalAveragePooling1D()"] if f["embedding"] else []
    layers.append(f"keras.layers.Dense({H}, activation={c['acts'][0]!r})")
    if f["layernorm"]:
        layers.append("keras.layers.LayerNormalization()")
    if f["batchnorm"]:
        layers.append("keras.layers.BatchNormalization()")
    if f["dropout"]:
        layers.append(f'keras.layers.Dropout({c["dropout_rate"]}, seed={c["seed"] % 97})')
    with s.block("def program(Tape, R):"):
        s("keras.utils.set_random_seed(SEED)",
          "prng = random.Random(SEED + 1)  # the program's own Python-random choices",
          "drng = np.random.default_rng(SEED)")
        with s.block("class Net(keras.Model):"):
            with s.block("def __init__(self):"):
                s("super().__init__()",
                  "self.trunk = keras.Sequential([" + ", ".join(layers) + "])",
                  f"self.head = keras.layers.Dense({out_dim})",
                  'self.tracker = keras.metrics.Mean(name="loss")',
                  "self.scale, self.steps = 1.0, 0  # Python state of the model")
            s("")
            with s.block("def call(self, x, training=False):"):
                s("return self.head(self.trunk(x, training=training))")
            s("")
            s("@property")
            with s.block("def metrics(self):"):
                s("return [self.tracker]")
            s("")
            with s.block("def train_step(self, data):"):
                s("x, y = data", "self.steps += 1")
                if f["state_scale"]:
                    s(f"self.scale *= {c['decay']}")
                with s.block("with Tape() as tape:"):
                    s(f"out = self(x, training={training})")
                    if f["classifier"]:
                        s("loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy("
                          "y, out, from_logits=True))")
                    else:
                        s("loss = tf.reduce_mean(tf.square(out - y))")
                    if f["py_branch"]:
                        with s.block(f"if prng.random() < {c['py_p']}:  # a Python-random branch"):
                            s("loss = loss + 1e-3 * tf.reduce_sum(tf.square(self.head.kernel))",
                              'R["log"].append(("reg", self.steps))')
                    if f["value_branch"]:
                        with s.block(f"if float(loss) > {c['value_t']}:  # a branch on a fetched value"):
                            s("loss = loss * 0.5", 'R["log"].append(("big", self.steps))')
                    if f["numpy_scalar"]:
                        s("m = float(np.mean(out.numpy()))  # a value read with .numpy()",
                          "loss = loss * (1.0 + 0.01 * np.tanh(m))")
                    if f["state_scale"]:
                        s("loss = loss * self.scale")
                    if f["mask"]:
                        s("sel = tf.boolean_mask(out, out[:, 0] > 0.0)  # rows chosen by value",
                          "loss = loss + 0.01 * tf.reduce_sum(tf.square(sel))")
                s("grads = tape.gradient(loss, self.trainable_variables)")
                if f["clip"]:
                    s("grads, _ = tf.clip_by_global_norm(grads, 1.0)")
                s("self.optimizer.apply_gradients(zip(grads, self.trainable_variables))",
                  "self.tracker.update_state(loss)",
                  'return {"loss": self.tracker.result()}')
        s("")
        with s.block("class Log(keras.callbacks.Callback):"):
            with s.block("def on_train_batch_end(self, batch, logs=None):"):
                s("STEP[0] = batch")
                if f["print"]:
                    s('R["log"].append(("batch", batch, round(float(logs["loss"]), 4)))')
                if f["break_value"]:
                    with s.block(f'if float(logs["loss"]) < {c["break_t"]}:'):
                        s("self.model.stop_training = True", 'R["log"].append(("stop", batch))')
            with s.block("def on_epoch_end(self, epoch, logs=None):"):
                s('R["losses"].append(float(logs["loss"]))')
        s("")
        n = T * B - (1 if f["small_last_batch"] else 0)
        if f["embedding"]:
            s(f'xs = drng.integers(0, {c["vocab"]}, size=({n}, {c["seq"]})).astype("int32")')
        else:
            s(f'xs = drng.normal(size=({n}, {D})).astype("float32")')
        if f["classifier"]:
            s(f'ys = drng.integers(0, {out_dim}, size=({n},)).astype("int32")')
        else:
            s(f'ys = drng.normal(size=({n}, 1)).astype("float32")')
        opt = {"SGD": f'keras.optimizers.SGD({c["lr"]})',
               "SGD_momentum": f'keras.optimizers.SGD({c["lr"]}, momentum=0.9)',
               "Adam": f'keras.optimizers.Adam({c["lr"]})',
               "RMSprop": f'keras.optimizers.RMSprop({c["lr"]})'}[c["optimizer"]]
        s("model = Net()",
          f"model.compile(optimizer={opt}, run_eagerly=True)",
          'R["losses"], R["log"] = [], []',
          'R["models"], R["opt"] = [model], model.optimizer')
        val = ", validation_data=(xs[:3], ys[:3])" if c["fit_validation"] else ""
        s(f"model.fit(xs, ys, batch_size={B}, epochs={2 if f['epochs'] else 1}, "
          f"shuffle={c['fit_shuffle']}, verbose=0, callbacks=[Log()]{val})")
        if f["end_iteration"]:
            s("terra.end_iteration()")
        s('R["state"] = (model.scale, model.steps)')


def _tape(s: _Src, c: dict, training: str) -> None:
    f = c["features"]
    out_dim = c["classes"] if f["classifier"] else 1
    with s.block("with Tape(persistent=True) as tape:" if f["persistent"] else "with Tape() as tape:"):
        if f["raise_caught"] and c["raise_where"] == "before_loss":
            _raise(s, c)
        if f["noise"] and not f["embedding"]:
            if c["noise_kind"] == "generator":
                s("x = x + 0.01 * g.normal(tf.shape(x))")
            else:
                s("x = x + 0.01 * tf.random.normal(tf.shape(x))")
        s(f"h = trunk(x, training={training})")
        if f["stop_recording"]:
            with s.block(f"if prng.random() < {c['stop_p']}:  # recorded at random steps only"):
                with s.block("with tape.stop_recording():"):
                    s("h = h + 0.1 * tf.reduce_mean(params[0])")
            with s.block("else:"):
                s("h = h + 0.1 * tf.reduce_mean(params[0])")
        if f["user_layer"]:
            s("h = gate(h)")
        if f["sequence"]:
            s("hs = seqnet(sx)  # (rows, length, hidden)")
            if c["seq_causal"]:
                s("L = sx.shape[1]  # the length, read in Python",
                  "tri = tf.linalg.band_part(tf.ones((L, L)), -1, 0)  # a causal mask of it",
                  "hs = tf.matmul(tri, hs) / float(L)")
            s("h = h + 0.1 * tf.reduce_mean(hs, axis=1)")
        if f["resize"]:
            s(f"side = max(1, int(4 * prng.choice({c['resize_ratios']!r})))  # a size Python computes",
              "img = tf.reshape(tf.tile(h, [1, 16])[:, :16], (-1, 4, 4, 1))",
              "img = tf.image.resize(img, (side, side))",
              "h = h + 0.1 * tf.reduce_mean(pixels(img), axis=(1, 2))")
        if f["inner_loop"]:
            with s.block(f"for _ in range(prng.randint(1, {c['inner_max']})):  # a loop of random length"):
                s("h = h + 0.5 * block(h)")
        if f["recursion"]:
            s(f"h = deepen(h, prng.randint(0, {c['recursion_max']}))")
        if f["tf_cond"]:
            s("h = tf.cond(tf.reduce_mean(h) > 0.0, lambda: h * 0.9, lambda: h + 0.05)")
        if f["iterations_branch"]:
            with s.block("if int(opt.iterations) % 2 == 1:  # a branch on the optimizer's count"):
                s("h = h * 1.05")
        s("out = head(h)")
        if f["manual_update"]:
            s("out = out + bias")
        if f["classifier"]:
            s("loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, out, from_logits=True))")
        else:
            s("loss = tf.reduce_mean(tf.square(out - y))")
        if f["py_function"]:
            s("loss = loss + 0.01 * tf.py_function(lambda v: v * v, [loss], tf.float32)  # Python in an op")
        if f["mask"]:
            if c["mask_kind"] == "boolean_mask":
                s("sel = tf.boolean_mask(out, out[:, 0] > 0.0)  # rows chosen by value")
            else:
                s("sel = tf.gather_nd(out, tf.where(out[:, 0] > 0.0))  # rows chosen by value")
            s("loss = loss + 0.01 * tf.reduce_sum(tf.square(sel))")
            if c["mask_read"] == "log":
                s('R["log"].append(("rows", step, int(sel.shape[0])))')
            elif c["mask_read"] == "branch":
                with s.block("if 2 * sel.shape[0] > out.shape[0]:  # a branch on the row count"):
                    s("loss = loss * 1.1")
        if c.get("nan_in_loss"):
            with s.block(f"if step == {c['nan_step']}:"):
                s(f"loss = loss * {c['nan_in_loss']}  # a bad step")
        if f["op_error"]:
            s(f"col = {out_dim} if step == {c['op_error_step']} else 0  # out of range once",
              "loss = loss + 0.0 * tf.reduce_sum(tf.gather(out, [col], axis=1))")
        if f["py_branch"]:
            with s.block(f"if prng.random() < {c['py_p']}:  # a Python-random branch"):
                s("loss = loss + 1e-3 * tf.reduce_sum(tf.square(params[0]))")
                s('state.history.append("reg")')
        if f["value_branch"]:
            with s.block(f"if float(loss) > {c['value_t']}:  # a branch on a fetched value"):
                if c["value_action"] == "scale":
                    s("loss = loss * 0.5")
                else:
                    s("loss = loss + 0.1 * tf.reduce_mean(tf.abs(out))")
                s('R["log"].append(("big", step))')
        if f["numpy_scalar"]:
            s("m = float(np.mean(out.numpy()))  # a value read with .numpy()",
              "loss = loss * (1.0 + 0.01 * np.tanh(m))")
        if f["state_scale"]:
            s("loss = loss * state.scale")
        if f["value_shape"]:
            s("r = tf.range(tf.constant(lengths[step]))  # its shape depends on a value")
            if c["shape_read"]:
                s('R["log"].append(("range", step, [int(v) for v in r]))')
            s("loss = loss + 0.01 * tf.cast(tf.reduce_sum(r), tf.float32)")
        if f["var_counter"]:
            s("counter.assign_add(1)")
            with s.block(f"if int(counter) % {c['counter_mod']} == 0:  # a branch on a variable"):
                s("loss = loss * 0.9")
        if f["tf_function"]:
            s("loss = loss + 1e-3 * penalty(head.trainable_variables)")
        if f["loss_scale"]:
            s("scaled = opt.scale_loss(loss)")
        if f["raise_caught"] and c["raise_where"] == "after_loss":
            _raise(s, c)
        if f["raise_uncaught"] and c["uncaught_where"] == "tape":
            with s.block(f"if step == {c['uncaught_step']}:"):
                s('raise RuntimeError(f"stopped at step {step}")')


def _raise(s: _Src, c: dict) -> None:
    cond = c["raise_cond"]
    if cond == "value" and c["raise_where"] == "before_loss":
        cond = "step"
    if cond == "step":
        test = f"step == {c['raise_step']}"
    elif cond == "random":
        test = "prng.random() < 0.25"
    else:
        test = f"float(loss) > {c['value_t'] * 1.5:.3f}"
    with s.block(f"if {test}:"):
        s('raise StepError(f"bad step {step}")')


def _except(s: _Src, c: dict) -> None:
    f = c["features"]
    s.depth -= 1
    if f["raise_caught"]:
        with s.block("except StepError as e:"):
            s('R["log"].append(("caught", step, str(e)))', "continue")
    if f["op_error"]:
        with s.block("except tf.errors.InvalidArgumentError:"):
            s('R["log"].append(("op error", step))', "continue")


_HARNESS = '''\
# ------------------------------------------------------------------ harness (same in every program)
def run(Tape):
    """Run the program with `Tape`; everything it did, as plain values."""
    R = {}
    STEP[0] = None
    printed = io.StringIO()
    error = None
    try:
        with contextlib.redirect_stdout(printed):
            program(Tape, R)
    except Exception as e:  # the program's own exception, or one Terra raised
        lines = [fr.lineno for fr in traceback.extract_tb(e.__traceback__)
                 if fr.filename == __file__ and fr.name == "program"]
        error = (type(e).__name__, STEP[0], lines[-1] if lines else None, str(e)[:300])
    end_error = None
    if Tape is not tf.GradientTape:
        try:
            terra.end_iteration()
        except Exception as e:
            end_error = f"{type(e).__name__}: {str(e)[:300]}"
    out = {k: v for k, v in R.items() if k not in ("models", "opt", "aux_opt", "extra")}
    out["printed"] = printed.getvalue().splitlines()
    out["error"] = error
    out["end_error"] = end_error
    if "opt" in R:
        out["iterations"] = int(R["opt"].iterations)
        out["variables"] = [v.numpy() for m in R["models"] for v in m.weights] + \\
            [v.numpy() for o in (R["opt"], R.get("aux_opt")) if o for v in o.variables] + \\
            [v.numpy() for v in R.get("extra", ())]
    return out


def _same(a, b, exact):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if exact or not np.issubdtype(a.dtype, np.floating):
        return np.array_equal(a, b, equal_nan=True)
    return np.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True)


def _equal(a, b):
    """`a == b`, with NaN equal to NaN at any depth (a gradient norm the program logs is NaN
    after a bad batch, in eager and under Terra alike)."""
    if isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating)):
        return bool(a == b or (a != a and b != b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def compare(eager, got, exact=EXACT):
    """The differences of Terra's outcome from eager's (empty: equal)."""
    problems = []
    for key in sorted(set(eager) | set(got)):
        e, t = eager.get(key), got.get(key)
        if key == "error":
            same = (e is None) == (t is None) and (e is None or e[:3] == t[:3])
        elif key in ("variables", "kept_grads", "losses", "kept", "total"):
            if isinstance(e, list) and isinstance(t, list):
                same = len(e) == len(t) and all(_same(x, y, exact) for x, y in zip(e, t))
            else:
                same = e is t or (e is not None and t is not None and _same(e, t, exact))
        else:
            same = _equal(e, t)
        if not same:
            gap = _gap(e, t) if key in ("variables", "kept_grads", "losses", "kept") else ""
            problems.append(f"{key}: eager {_show(e)} | terra {_show(t)}{gap}")
    return problems


def _gap(e, t):
    """Where two lists of arrays differ: the first index and the largest difference."""
    if not (isinstance(e, list) and isinstance(t, list) and len(e) == len(t)):
        return ""
    for i, (a, b) in enumerate(zip(e, t)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape == b.shape and not np.array_equal(a, b, equal_nan=True):
            nan = np.isnan(a) != np.isnan(b)  # NaN on one side only: an infinite difference
            d = np.where(nan, np.inf, np.nan_to_num(np.abs(a - b), nan=0.0))
            rel = d / np.maximum(np.nan_to_num(np.abs(a), nan=0.0), 1e-30)
            return (f" (first at [{i}]: max abs diff {d.max():.3g}, "
                    f"max rel diff {rel.max():.3g})")
    return ""


def _show(v):
    if isinstance(v, list) and v and isinstance(v[0], np.ndarray):
        return "[" + ", ".join(np.array2string(a.ravel()[:3], precision=9) for a in v) + "]"
    if isinstance(v, list) and v and isinstance(v[0], float):
        return "[" + ", ".join(repr(x) for x in v) + "]"
    return repr(v)


STATS = {}  # terra.stats() of the last Terra run


def run_both():
    """Eager, then Terra; returns (eager outcome, Terra outcome, differences, terra.explain())."""
    terra.reset()
    eager = run(tf.GradientTape)
    terra.reset()
    old = terra.config(**TERRA_CONFIG)
    try:
        got = run(tf.TerraGradientTape)
        explain = terra.explain()
        STATS.clear()
        STATS.update(terra.stats())
    finally:
        terra.reset()
        terra.config(**old)
    return eager, got, compare(eager, got), explain


if __name__ == "__main__":
    eager, got, problems, explain = run_both()
    for name, o in (("eager", eager), ("terra", got)):
        print(f"--- {name}")
        for k in sorted(o):
            print(f"{k}: {_show(o[k])}")
    if problems:
        print("--- DIFFERENT from eager:")
        print("\\n".join(problems))
        print("--- terra.explain():")
        print(explain)
        sys.exit(1)
    print("--- same as eager")'''
