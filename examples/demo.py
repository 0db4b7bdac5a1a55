"""Terra demo: an ordinary eager Keras training loop, run eagerly and then under Terra.

The only change for Terra is the tape: `tf.TerraGradientTape` instead of `tf.GradientTape`.
The loop keeps everything eager code may do: a Python attribute mutated every step (a DropBlock-
style schedule), a value printed every few steps, and a smaller last batch. Both runs start from
the same weights; the demo checks they end with the same weights and prints the speedup and
`terra.stats()`. Runs in about a minute on 2 CPU cores.

    python examples/demo.py [--epochs 3]
"""
import argparse
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402  (installs tf.TerraGradientTape)


class Schedule:
    """Python state the loop mutates; AutoGraph would freeze it at trace time."""

    def __init__(self):
        self.keep = 1.0

    def step(self):
        self.keep = max(0.7, self.keep - 0.01)


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.layers.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10)])


def train(GradientTape, data, epochs, log):
    model = build()
    optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    schedule = Schedule()
    x_all, y_all = data
    step, times = 0, []
    for epoch in range(epochs):
        for start in range(0, len(x_all), 32):          # the last batch is smaller
            x, y = x_all[start:start + 32], y_all[start:start + 32]
            t0 = time.perf_counter()
            with GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits * schedule.keep)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            schedule.step()
            step += 1
            if step % 10 == 0:
                log(f"    step {step:3d}  loss {loss:.4f}")      # a fetch every 10 steps
            float(loss)
            times.append(time.perf_counter() - t0)
    return model, times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=336)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    data = (rng.normal(size=(args.samples, 32, 32, 3)).astype(np.float32),
            rng.integers(0, 10, size=(args.samples,)).astype(np.int32))
    per_epoch = -(-args.samples // 32)
    print(f"CNN, batch 32 (last batch {args.samples % 32 or 32}), {args.epochs} epochs x "
          f"{per_epoch} steps")

    print("eager (tf.GradientTape):")
    eager_model, eager_t = train(tf.GradientTape, data, args.epochs, print)
    print("Terra (tf.TerraGradientTape):")
    terra.reset()
    terra_model, terra_t = train(tf.TerraGradientTape, data, args.epochs, print)
    terra.end_iteration()
    stats = terra.stats()

    same = all(np.allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
               for a, b in zip(eager_model.variables, terra_model.variables))
    skip = per_epoch  # steady state: leave out the first epoch (tracing, graph build)
    e, t = np.median(eager_t[skip:]), np.median(terra_t[skip:])
    print(f"\nsteady-state step time (median, epochs 2+): eager {1e3 * e:.1f} ms, "
          f"Terra {1e3 * t:.1f} ms  ->  speedup {e / t:.2f}x")
    print(f"total: eager {sum(eager_t):.2f} s, Terra {sum(terra_t):.2f} s (Terra includes "
          f"tracing and graph builds)")
    print(f"final weights equal to eager: {same}")
    print("terra.stats():")
    for k, v in stats.items():
        print(f"    {k:15s} {v:.3f}" if isinstance(v, float) else f"    {k:15s} {v}")
    print("terra.explain():")
    for line in terra.explain().splitlines():
        print("    " + line)
    if not same:
        sys.exit("Terra's weights differ from eager")


if __name__ == "__main__":
    main()
