"""Train a small GPT written in plain Keras with pipeline parallelism, cut automatically.

The model is an ordinary functional Keras model (Embedding, MultiHeadAttention with a causal mask,
LayerNormalization, Dropout, an output head tied to the token embedding). `terra.pipeline.pipeline`
profiles it, picks the cuts, and trains it on logical CPUs (or GPUs when there are enough); a
second copy of the same model trains on one device, micro-batch after micro-batch, beside it.

    python examples/pipeline_gpt.py --schedule 1f1b --balance bpipe --stages 4 --steps 5
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def single_device_step(model, optimizer, loss, x, y, m):
    """One device, the same micro-batches in the same order, gradients of the mean accumulated."""
    total, losses = None, []
    for xi, yi in zip(np.split(x, m), np.split(y, m)):
        with tf.GradientTape() as tape:
            li = loss(yi, model(xi, training=True))
        grads = [tf.convert_to_tensor(g) / m for g in tape.gradient(li, model.trainable_variables)]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
        losses.append(float(li))
    optimizer.apply_gradients(zip(total, model.trainable_variables))
    return float(np.mean(losses))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved", "kfkb", "zb-h1", "zb-v", "dualpipe-v"])
    parser.add_argument("--balance", default=None, choices=[None, "bpipe"], type=lambda s: None if s == "none" else s)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--memory-budget", type=int, default=None, help="bytes per device the plan must fit")
    args = parser.parse_args()

    if len(tf.config.list_physical_devices("GPU")) < args.stages:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.stages)

    import keras
    import terra.pipeline as tp
    from terra.pipeline.models import keras_gpt

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model, reference = (keras_gpt(blocks=args.blocks, d_model=args.d_model) for _ in range(2))
    trainer = tp.pipeline(model, loss, keras.optimizers.Adam(args.lr), stages=args.stages,
                          schedule=args.schedule, balance=args.balance, microbatches=args.microbatches,
                          memory_budget=args.memory_budget)
    ref_opt = keras.optimizers.Adam(args.lr)
    rng = np.random.default_rng(0)
    # A learnable toy language: the next token is (token + 1) mod 64.
    batch = args.microbatches * args.microbatch_size
    print(f"{'step':>4} {'pipeline loss':>14} {'one device':>11} {'ms':>7}")
    for step in range(args.steps):
        x = rng.integers(0, 64, (batch, 16)).astype("int32")
        y = (x + 1) % 64
        got = trainer.step(x, y)
        want = single_device_step(reference, ref_opt, loss, x, y, args.microbatches)
        print(f"{step:>4} {got:>14.6f} {want:>11.6f} {trainer.last_step_seconds * 1e3:>7.0f}")
        if step == 0:
            print(trainer.plan.explain())
    worst = max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(model.variables, reference.variables))
    print(f"largest difference of any variable from one-device training: {worst:.2e}")
    print("per part: predicted / measured (pack = saved activations per micro-batch; peak = rank ledger)")
    for r in trainer.check():
        line = (f"  part {r['part']} rank {r['rank']}: pack {r['pack_bytes_predicted']} / {r['pack_bytes']} B, "
                f"peak {r['rank_peak_bytes_predicted']} / {r['rank_peak_bytes']} B "
                f"({r['rank_peak_bytes_error']:+.1%})")
        if "forward_s" in r:
            line += (f", F+B {1e3 * (r['forward_s_predicted'] + r['backward_s_predicted']):.2f} / "
                     f"{1e3 * (r['forward_s'] + r['backward_s']):.2f} ms")
        print(line)
    for r in trainer.memory_report():
        if r["allocator"]:
            print(f"  rank {r['rank']} allocator peak {r['allocator']['peak']} B")
    trainer.close()


if __name__ == "__main__":
    main()
