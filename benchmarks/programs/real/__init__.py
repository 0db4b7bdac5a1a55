"""Real programs: public TF2 custom training loops, adapted only to synthetic data and smaller
sizes (source and licence named in each module). Each module has

    SOURCE, LICENSE, TRAIT               where it comes from, what it exercises
    run(Tape, steps, *, seed=0, decorate=None, on_step=None, size="bench") -> dict

`run` executes the program's own loop with `Tape` as its gradient tape for `steps` training
steps and returns {"losses": [float per step], "variables": [np.ndarray, ...]}. `decorate` is
applied to the program's train-step function (None: left as is, the eager program; the harness
passes `tf.function` for the mode the tutorials ship). `on_step(i)` is called after step `i`
(the harness timestamps steps with it). The same seed gives the same data and initial weights.
"""
import importlib

PROGRAMS = (
    "scratch_mnist", "custom_walkthrough", "dcgan", "cvae", "wgan_gp", "vae_keras",
    "text_generation", "nmt_attention", "actor_critic", "dqn", "reptile", "style_transfer",
)


def load(name):
    if name not in PROGRAMS:
        raise ValueError(f"unknown real program {name!r}; choose from {', '.join(PROGRAMS)}")
    return importlib.import_module(f"{__name__}.{name}")
