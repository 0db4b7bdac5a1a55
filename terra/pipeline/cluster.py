"""Cluster mode: one `tf.distribute.Server` worker process per stage, one client driving them.

Each worker is its own process with the BFC allocator on CPU (``TF_CPU_ALLOCATOR_USE_BFC=true``),
so its allocator peak is that stage's real memory; the client asks for it over the worker's stdin
(``mem`` / ``reset`` / ``quit``) and the worker answers one JSON line. The client connects with
`tf.config.experimental_connect_to_cluster` and places stage ``r`` on
``/job:worker/replica:0/task:r/device:CPU:0``; the `PipelineTrainer` is unchanged.

TensorFlow's gRPC server listens on every interface (``*:port``) whatever address the cluster spec
names. `LocalCluster` therefore refuses to start unless the process is in a network namespace
whose only interface is loopback; `run_isolated` provides one (``unshare -rn``, loopback brought
up, nothing else reachable). On a real multi-host cluster, skip `LocalCluster`: start one worker
per host with ``python -m terra.pipeline.cluster worker --spec '<json>' --task i
--listen-all-interfaces`` (the flag says you know the port is open on every interface: firewall
it as your site requires; without it a worker outside a loopback-only namespace refuses to
start) and give the client the same spec (see docs/pipeline_executor.md).

Usage: ``python -m terra.pipeline.cluster demo --workers 4`` runs 1F1B and BPipe on 4 local
workers (inside ``unshare -rn``) and prints a JSON report (gradient errors vs single device,
ledger and allocator peaks per worker); ``--schedules zb-h1,zb-v`` runs the zero-bubble schedules
(ZB-V cuts the model into 2 x workers parts, two per worker). ``python -m terra.pipeline.cluster
keras`` hands a plain-Keras GPT to `terra.pipeline.pipeline` and reports the plan's predicted peak
bytes and part times beside the workers' allocator peaks and the measured times.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

WORKER_DEVICE = "/job:worker/replica:0/task:{}/device:CPU:0"


def loopback_only() -> bool:
    """True if the only network interface of this namespace is loopback (/proc/net/dev follows
    the namespace; /sys/class/net may still show the host's)."""
    try:
        with open("/proc/net/dev") as f:
            names = [line.split(":", 1)[0].strip() for line in f.readlines()[2:]]
    except OSError:
        return False
    return names == ["lo"]


def _free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class LocalCluster:
    """``num_workers`` worker processes on 127.0.0.1 (context manager; always kills them)."""

    def __init__(self, num_workers: int, timeout: float = 60.0, bfc: bool = True):
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        if not loopback_only():
            raise RuntimeError("TF servers listen on all interfaces; start LocalCluster inside a "
                               "loopback-only network namespace (terra.pipeline.cluster.run_isolated "
                               "or `unshare -rn`)")
        self.num_workers, self.timeout, self.bfc = num_workers, timeout, bfc
        self.spec = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(num_workers)]}
        self.procs = []

    @property
    def devices(self):
        return [WORKER_DEVICE.format(i) for i in range(self.num_workers)]

    def __enter__(self):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        if self.bfc:
            env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
        try:
            for i in range(self.num_workers):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "terra.pipeline.cluster", "worker",
                     "--spec", json.dumps(self.spec), "--task", str(i)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    text=True, env=env))  # same process group: run_isolated's kill reaches them
            for i in range(self.num_workers):
                self._ask(i, "ping")
            import tensorflow as tf
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec(self.spec), rpc_layer="grpc")
            tf.config.experimental_connect_to_cluster(resolver, make_master_device_default=False)
        except BaseException:
            self.close()
            raise
        return self

    def _ask(self, task, command):
        proc = self.procs[task]
        proc.stdin.write(command + "\n")
        proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        import select
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"worker {task} exited (code {proc.poll()})")
                return json.loads(line)
            if proc.poll() is not None:
                raise RuntimeError(f"worker {task} exited (code {proc.returncode})")
        raise TimeoutError(f"worker {task} did not answer {command!r} within {self.timeout} s")

    def allocator(self, task) -> Optional[dict]:
        """``{'current', 'peak'}`` bytes of worker ``task``'s CPU allocator."""
        return self._ask(task, "mem")

    def reset_peaks(self):
        for i in range(self.num_workers):
            self._ask(i, "reset")

    def probe(self, task: int):
        """Worker ``task``'s allocator as a `memory.AllocatorProbe` (what the profile measures
        temporaries with)."""
        from terra.pipeline.memory import AllocatorProbe
        return AllocatorProbe(lambda: self._ask(task, "reset"), lambda: self.allocator(task))

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def __exit__(self, *exc):
        self.close()


def worker_main(spec: dict, task: int):
    """Run one worker: a TF server plus a tiny stdin/stdout control loop for allocator stats."""
    import tensorflow as tf
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name="worker", task_index=task,
                                  protocol="grpc", start=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "ping":
            answer = {"ok": True, "target": server.target}
        elif command == "mem":
            try:
                answer = dict(tf.config.experimental.get_memory_info("CPU:0"))
            except (ValueError, RuntimeError) as e:
                answer = {"error": str(e)}
        elif command == "reset":
            tf.config.experimental.reset_memory_stats("CPU:0")
            answer = {"ok": True}
        elif command == "quit":
            break
        else:
            answer = {"error": f"unknown command {command!r}"}
        print(json.dumps(answer), flush=True)
    # stdin closed or quit: the client is gone; leave at once (server threads never join).
    os._exit(0)


def run_isolated(args, timeout: float = 180.0, on_start=None, cancel=None) -> dict:
    """Run ``python -m terra.pipeline.cluster <args>`` inside ``unshare -rn`` (loopback only) and
    return the JSON it prints last. The whole process group is killed on timeout, on error, or
    once the threading.Event `cancel` is set (TimeoutError either way, saying which).
    The run is a session of its own (its workers included), whose id is the pid of the process
    `on_start(popen)` is given, if passed."""
    cmd = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "terra.pipeline.cluster", *args])
    proc = subprocess.Popen(["unshare", "-rn", "sh", "-c", f"ip link set lo up && exec {cmd}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
    if on_start is not None:
        on_start(proc)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:  # (retrying communicate after its timeout loses no output)
                out, err = proc.communicate(timeout=timeout if cancel is None else 0.2)
                break
            except subprocess.TimeoutExpired:
                cancelled = cancel is not None and cancel.is_set()
                if not cancelled and time.monotonic() < deadline:
                    continue
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                why = "was cancelled" if cancelled else f"exceeded {timeout} s"
                raise TimeoutError(f"cluster run {why}; stderr tail:\n{err[-2000:]}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [l for l in out.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"cluster run failed (code {proc.returncode}); stderr tail:\n{err[-3000:]}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------------------------ demo
def demo(workers: int, microbatches: int, seq: int, d_model: int, mb_size: int, schedules,
         repeats: int = 1):
    """1F1B and BPipe (and any other ``schedules``) on local workers; gradients vs single device."""
    import numpy as np
    import keras
    import tensorflow as tf
    from terra.pipeline import calibrate, executor, stage as st

    report = {"workers": workers, "runs": {}}
    rng = np.random.default_rng(0)
    b = microbatches * mb_size
    x = rng.integers(0, 64, (b, seq)).astype("int32")
    y = rng.integers(0, 64, (b, seq)).astype("int32")
    models = {}

    def model(plan):
        """The tiny GPT cut into the schedule's model parts, each on its stage's worker, and
        its single-device loss and gradients (one per part layout)."""
        key = plan.stage_ranks[:plan.pipe_depth]
        if key not in models:
            parts = st.tiny_gpt(plan.pipe_depth, d_model=d_model, seq=seq,
                                devices=[devices[r] for r in key])
            variables = [v for part in parts for v in st.trainable_variables(part)]
            with tf.GradientTape() as tape:
                h = x
                for part in parts[:-1]:
                    h = st.sequential(part)(h)
                loss = st.lm_loss(y, st.sequential(parts[-1])(h))
            models[key] = parts, loss, [g.numpy() for g in tape.gradient(loss, variables)]
        return models[key]

    with LocalCluster(workers) as cluster:
        devices = cluster.devices
        for name in schedules:
            sched, *flags = name.split("+")            # e.g. "1f1b+bpipe+sync"
            plan = executor.make_schedule(sched, workers, microbatches)
            parts, ref_loss, ref = model(plan)
            replicas = None
            if sched == "chimera":   # the upward pipeline's copy: part k on rank p - 1 - k
                replicas = st.tiny_gpt(plan.pipe_depth, d_model=d_model, seq=seq,
                                       devices=[devices[workers - 1 - k] for k in range(plan.pipe_depth)])
            trainer = executor.PipelineTrainer(parts, lambda: keras.optimizers.Adam(1e-3),
                                               devices=devices, schedule=sched,
                                               balance="bpipe" if "bpipe" in flags else None,
                                               microbatches=microbatches, overlap="sync" not in flags,
                                               replica_stages=replicas)
            trainer.step(x, y, apply=False)              # build and warm up
            times = []
            for _ in range(repeats):
                trainer.ledger.reset_peaks()
                cluster.reset_peaks()
                base = [cluster.allocator(i)["current"] for i in range(workers)]
                start = time.perf_counter()
                loss = trainer.step(x, y, apply=False)
                times.append(time.perf_counter() - start)
            seconds = sorted(times)[len(times) // 2]
            grads = [g.numpy() for part in trainer.last_gradients for g in part]
            err = max(float(np.max(np.abs(a - r))) for a, r in zip(grads, ref))
            mem = trainer.memory_report(allocator=cluster.allocator)
            # The cost model beside the run: each stage timed alone on its worker, backward working
            # sets from the workers' allocators; the 2 cores are shared by every worker (parallel=1).
            shared = calibrate.predict(trainer, parallel=1, probes=[cluster.probe(i) for i in range(workers)])
            alone = calibrate.predict(trainer, costs=shared.costs)
            report["runs"][name] = {
                "predicted_s": alone.step_time, "predicted_shared_s": shared.step_time,
                "predicted_bubble": shared.bubble, "predicted_peak": list(shared.total_peak_bytes),
                "predicted_ledger_peak": list(shared.peak_bytes),
                "ledger_peak": [r["peak_total"] for r in mem],
                "loss": loss, "ref_loss": float(ref_loss), "grad_err": err, "seconds": seconds,
                "seconds_min": min(times), "seconds_max": max(times),
                "pack_bytes": trainer.pack_bytes,
                "transfer_seconds": trainer.transfer_seconds,
                "ledger_peak_packs": [r["peak_packs"] for r in mem],
                "ledger_peak_activation": [r["peak_activation"] for r in mem],
                "allocator_peak": [r["allocator"]["peak"] for r in mem],
                "allocator_base": base}
            trainer.close()
    return report


def keras_demo(workers: int, microbatches: int, mb_size: int, d_model: int, blocks: int,
               schedule: str = "1f1b", steps: int = 2, checks: int = 5) -> dict:
    """A plain-Keras GPT handed to `terra.pipeline.pipeline` on local workers (profiled on worker
    0, its allocator measuring temporaries): the plan's predicted per-worker peak bytes and part
    times beside the workers' allocator peaks, the executor's ledger and the parts' measured
    times (per part the median of ``checks`` runs of `ModelPipeline.check`, with their range:
    on a busy machine a part's time moves by tens of percent from run to run)."""
    import numpy as np
    import keras
    import terra.pipeline as tp
    from terra.pipeline.models import keras_gpt

    rng = np.random.default_rng(0)
    b = microbatches * mb_size
    x = rng.integers(0, 64, (b, 16)).astype("int32")
    y = (x + 1) % 64
    with LocalCluster(workers) as cluster:
        model = keras_gpt(d_model=d_model, blocks=blocks)
        trainer = tp.pipeline(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                              keras.optimizers.Adam(1e-3), devices=cluster.devices, schedule=schedule,
                              microbatches=microbatches, memory_probe=cluster.probe(0))
        losses = [trainer.step(x, y) for _ in range(steps)]   # the first builds and warms up
        trainer.trainer.ledger.reset_peaks()
        cluster.reset_peaks()
        base = [cluster.allocator(i)["current"] for i in range(workers)]
        losses.append(trainer.step(x, y))
        mem = trainer.memory_report(allocator=cluster.allocator)
        runs = [trainer.check() for _ in range(checks)]   # part times vary run to run: medians
        checks = [dict(rows[0], **{key: float(np.median([r[key] for r in rows])) for key in ("forward_s", "backward_s")},
                       fb_spread=[min(r["forward_s"] + r["backward_s"] for r in rows),
                                  max(r["forward_s"] + r["backward_s"] for r in rows)])
                  for rows in zip(*runs)]
        for row in checks:
            for key in ("forward_s", "backward_s"):
                row[key + "_error"] = (row[key + "_predicted"] - row[key]) / row[key]
        plan = trainer.plan
        report = {"workers": workers, "schedule": schedule, "losses": losses, "plan": str(plan),
                  "ranks": []}
        for r, m in enumerate(mem):
            peak, predicted = m["allocator"]["peak"], plan.rank_total_bytes[r]
            report["ranks"].append({
                "predicted_ledger_peak": plan.rank_peak_bytes[r], "ledger_peak": m["peak_total"],
                "predicted_peak": predicted, "allocator_peak": peak, "allocator_base": base[r],
                "peak_error": (predicted - peak) / peak})
        report["parts"] = [{k: v for k, v in row.items() if not k.startswith("rank_peak")} for row in checks]
        # What the planner balances is each part's share of the step; a machine that runs slower
        # now than while profiling moves every part alike and leaves the shares as they were.
        predicted = [p["forward_s_predicted"] + p["backward_s_predicted"] for p in report["parts"]]
        measured = [p["forward_s"] + p["backward_s"] for p in report["parts"]]
        for part, a, b in zip(report["parts"], predicted, measured):
            part["fb_error"] = (a - b) / b
            part["share_error"] = (a / sum(predicted) - b / sum(measured)) / (b / sum(measured))
        trainer.close()
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m terra.pipeline.cluster")
    sub = parser.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--spec", required=True)
    w.add_argument("--task", type=int, required=True)
    w.add_argument("--listen-all-interfaces", action="store_true",
                   help="start outside a loopback-only network namespace: TF's server then "
                        "accepts connections on every interface of the host (firewall it)")
    d = sub.add_parser("demo")
    d.add_argument("--workers", type=int, default=4)
    d.add_argument("--microbatches", type=int, default=8)
    d.add_argument("--seq", type=int, default=32)
    d.add_argument("--d-model", type=int, default=32)
    d.add_argument("--mb-size", type=int, default=4)
    d.add_argument("--schedules", default="1f1b,1f1b+bpipe",
                   help="comma-separated runs: schedule[+bpipe][+sync] (sync: no transfer overlap)")
    d.add_argument("--repeats", type=int, default=1)
    k = sub.add_parser("keras", help="a plain-Keras GPT cut by terra.pipeline.pipeline: predicted "
                                     "against measured memory and time per worker")
    k.add_argument("--workers", type=int, default=4)
    k.add_argument("--microbatches", type=int, default=8)
    k.add_argument("--mb-size", type=int, default=8)
    k.add_argument("--d-model", type=int, default=128)
    k.add_argument("--blocks", type=int, default=4)
    k.add_argument("--schedule", default="1f1b")
    args = parser.parse_args(argv)
    if args.cmd == "worker":
        if not loopback_only() and not args.listen_all_interfaces:
            parser.error("TF's gRPC server listens on every interface, whatever address the spec "
                         "names; run the worker inside a loopback-only network namespace "
                         "(`unshare -rn`, as LocalCluster and run_isolated do), or pass "
                         "--listen-all-interfaces on a host whose port is firewalled")
        worker_main(json.loads(args.spec), args.task)
    elif args.cmd == "keras":
        print(json.dumps(keras_demo(args.workers, args.microbatches, args.mb_size, args.d_model,
                                    args.blocks, args.schedule)), flush=True)
    else:
        print(json.dumps(demo(args.workers, args.microbatches, args.seq, args.d_model,
                              args.mb_size, args.schedules.split(","), args.repeats)), flush=True)


if __name__ == "__main__":
    main()
