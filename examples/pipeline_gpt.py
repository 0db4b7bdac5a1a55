"""Train a small GPT with pipeline parallelism on logical CPUs (or GPUs when present).

    python examples/pipeline_gpt.py --schedule 1f1b --balance bpipe --stages 4 --steps 5
"""
import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "interleaved", "kfkb", "chimera",
                                                                "zb-h1", "zb-v"])
    parser.add_argument("--balance", default=None, choices=[None, "bpipe"], type=lambda s: None if s == "none" else s)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()

    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) >= args.stages:
        devices = [f"/device:GPU:{i}" for i in range(args.stages)]
    else:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * args.stages)
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]

    import keras
    from terra.pipeline import stage
    from terra.pipeline.executor import PipelineTrainer, make_schedule

    p = args.stages
    plan = make_schedule(args.schedule, p, args.microbatches)   # interleaved, zb-v: 2p parts
    nparts = plan.pipe_depth
    parts = stage.tiny_gpt(nparts, devices=[devices[plan.stage_ranks[k]] for k in range(nparts)])
    replicas = (stage.tiny_gpt(nparts, devices=devices[::-1]) if args.schedule == "chimera" else None)
    trainer = PipelineTrainer(parts, lambda: keras.optimizers.Adam(args.lr), devices=devices,
                              schedule=args.schedule, balance=args.balance,
                              microbatches=args.microbatches, replica_stages=replicas)
    rng = np.random.default_rng(0)
    # A learnable toy language: the next token is (token + 1) mod 64.
    batch = args.microbatches * args.microbatch_size
    for step in range(args.steps):
        x = rng.integers(0, 64, (batch, 16)).astype("int32")
        y = (x + 1) % 64
        loss = trainer.step(x, y)
        print(f"step {step}: loss {loss:.4f} ({trainer.last_step_seconds * 1e3:.0f} ms)")
    print(f"schedule {trainer.schedule.name} balance {args.balance}: per-rank peaks")
    for r in trainer.memory_report():
        alloc = r["allocator"]["peak"] if r["allocator"] else "n/a"
        print(f"  rank {r['rank']}: activations {r['peak_activation']} B ({r['peak_packs']} packs), "
              f"total {r['peak_total']} B, allocator peak {alloc}")
    trainer.close()


if __name__ == "__main__":
    main()
