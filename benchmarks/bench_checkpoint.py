"""How long a checkpoint save holds the trainer: a synchronous save vs --async-save, in the same run.

One Megatron trainer rank (gloo on a CPU, NCCL on a GPU) on a random Qwen3-style model of --shape, after one training
step (so the Adam moments exist): each round saves a checkpoint synchronously, then one with --async-save, and times
the save call itself (what the trainer waits for before it can train again) and, for the async save, the wait at
its finalisation (written by then, or waited for). Printed: medians with their spread, and the ratio of the async
call to the synchronous save per round.

    python benchmarks/bench_checkpoint.py [--shape cpu|qwen3-0.6b] [--repeats 5]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench_trainer import SHAPES, _Ref, build_model, rollout  # noqa: E402


def _entry(rank, model_dir, opts, port, out):
    import ray
    import torch.distributed as dist

    from slime.backends.megatron_utils import checkpoint
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.utils import device
    from tests._megatron_helpers import train_args

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    device.set_device(0)
    dist.init_process_group(device.dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    args = train_args(model_dir, bf16=device.bf16_by_default(), ci_test=False, loss_type="sft_loss", seq_length=64)
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x  # the benchmark hands the dict itself instead of an ObjectRef
    data = process_rollout_data(args, _Ref(rollout(2, 2, 48, 16, opts["vocab"])), 0, 1)
    iters, nmb = get_data_iterator(args, model, data)
    train(args, 0, model, opt, sched, iters, nmb)
    times = {"sync save": [], "async save call": [], "async finalize wait": []}
    for i in range(opts["repeats"]):
        for mode in ("sync", "async"):
            args.save, args.async_save = os.path.join(opts["tmp"], f"{mode}_{i}"), mode == "async"
            start = time.perf_counter()
            checkpoint.save_checkpoint(args, 0, model, opt, sched)
            device.synchronize()
            times["sync save" if mode == "sync" else "async save call"].append(time.perf_counter() - start)
            if mode == "async":
                start = time.perf_counter()
                checkpoint.finalize_async_save()
                times["async finalize wait"].append(time.perf_counter() - start)
    with open(out, "w") as f:
        json.dump(times, f)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--timeout", type=int, default=1800)
    opts = vars(p.parse_args())

    from tests._megatron_helpers import free_port, run_processes

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "model")
        config = build_model(model_dir, opts["shape"])
        opts.update(tmp=tmp, vocab=config.vocab_size)
        out = os.path.join(tmp, "times.json")
        run_processes(_entry, (model_dir, opts, free_port(), out), 1, "bench_checkpoint", opts["timeout"], "spawn")
        with open(out) as f:
            times = json.load(f)
        size = sum(
            os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tmp, "sync_0")) for f in fs
        )
    print(f"bench_checkpoint: shape {opts['shape']}, {size / 1e6:.0f} MB per checkpoint, {opts['repeats']} rounds")
    for name, values in times.items():
        print(f"  {name}: median {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})")
    ratios = [a / s for a, s in zip(times["async save call"], times["sync save"])]
    print(
        f"  async call / sync save: {statistics.median(ratios):.2f}x (per-round range {min(ratios):.2f}-"
        f"{max(ratios):.2f}x)"
    )


if __name__ == "__main__":
    main()
