"""Weight-sync throughput, trainer -> CPU inference server, next to memcpy bandwidth measured in the same run.

Builds a random Qwen3-style HF model of a few hundred MB locally (no hub), starts one real CPU inference server
(`SGLangEngine`) and one Megatron trainer (Ray actor, TP=1), and times `update_weights()` end to end (pause, gather,
convert, transfer, load into the engine, continue):
  broadcast  disaggregated, --update-weight-transport broadcast (gloo group; the cross-host path)
  shm        disaggregated, --update-weight-transport auto on one host (shared-memory buckets)   target >= 0.25x memcpy
  colocated  --colocate (shared-memory handles of the CPU weight dict)                          target >= 0.5x memcpy
  disk       --update-weight-transport disk: one HF checkpoint per version, loaded by update_weights_from_disk
  delta      --update-weight-mode delta: xor deltas after one Adam-like step (every weight moved by lr = 1e-6),
             pulled into a local checkpoint (/pull_weights) and reloaded; the MB column is what was written

    python benchmarks/bench_weight_sync.py [--hidden 1024 --ffn 4096 --layers 6 --repeats 5]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
for k, v in {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
    "SLIME_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(k, v)

import ray  # noqa: E402
import torch  # noqa: E402


def memcpy_gbps(nbytes, repeats=5):
    """Copy into an existing (already faulted-in) buffer: the ceiling any weight transfer is held against."""
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times) / 1e9


def bench_mode(args, engine, mode, repeats, workdir):
    from slime.ray.utils import Lock
    from tests.test_weight_sync import start_trainers, stop

    args.update_weight_transport = {"broadcast": "broadcast", "disk": "disk", "delta": "disk"}.get(mode, "auto")
    args.update_weight_mode = "delta" if mode == "delta" else "full"
    args.update_weight_disk_dir = os.path.join(workdir, f"versions-{mode}")
    args.update_weight_local_checkpoint_dir = os.path.join(workdir, "local") if mode == "delta" else None
    trainers, lock = start_trainers(args, colocate=mode == "colocated"), Lock.remote()
    try:
        ray.get(trainers[0].connect.remote([engine], lock), timeout=600)
        ray.get(trainers[0].update_weights.remote(), timeout=600)  # warm-up: connections, first-touch pages
        runs = []
        for i in range(repeats):
            if mode == "delta":
                ray.get(trainers[0].adam_like_step.remote(1e-6, i), timeout=600)
            runs.append(ray.get(trainers[0].update_weights.remote(), timeout=600))
    finally:
        stop(trainers + [lock])
    times = [r["perf/update_weights_time"] for r in runs]
    return runs[0]["perf/update_weights_bytes"], min(times), statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=5)
    opts = p.parse_args()

    from tests._megatron_helpers import megatron_args
    from tests.test_weight_sync import start_engines, stop
    from tools.build_tiny_kit import build_model

    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench-weight-sync-")
    engines = []
    try:
        model_dir = os.path.join(workdir, "model")
        build_model(model_dir, hidden=opts.hidden, ffn=opts.ffn, layers=opts.layers)
        nbytes = sum(
            os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors")
        )
        print(
            f"model: hidden {opts.hidden}, ffn {opts.ffn}, {opts.layers} layers, fp32, {nbytes / 1e6:.0f} MB on disk"
        )
        memcpy_before = memcpy_gbps(nbytes)
        ray.init(
            num_cpus=8,
            num_gpus=4,
            include_dashboard=False,
            object_store_memory=1 << 30,
            log_to_driver=False,
            _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        )
        args = megatron_args(
            model_dir,
            rollout_num_gpus_per_engine=1,
            rollout_num_gpus_per_node=4,
            inference_server="cpu",
            update_weight_buffer_size=512 << 20,
            update_weight_timeout=600,
            check_weight_update_equal=False,
        )
        engines = start_engines(args, 1)
        results = {
            mode: bench_mode(args, engines[0], mode, opts.repeats, workdir)
            for mode in ("broadcast", "shm", "colocated", "disk", "delta")
        }
    finally:
        stop(engines)
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    # best of the runs on both sides: on a shared machine the best is the least disturbed measurement
    memcpy = max(memcpy_before, memcpy_gbps(nbytes))
    print(f"best of {opts.repeats} updates (median in brackets); memcpy = copy into an existing buffer, best of 10")
    print(f"{'path':<12}{'MB':>8}{'seconds':>16}{'GB/s':>8}{'x memcpy':>10}{'target':>8}")
    print(f"{'memcpy':<12}{nbytes / 1e6:>8.0f}{nbytes / memcpy / 1e9:>16.3f}{memcpy:>8.2f}{1.0:>10.2f}")
    for mode, target in (("broadcast", None), ("shm", 0.25), ("colocated", 0.5), ("disk", None), ("delta", None)):
        moved, best, median = results[mode]
        gbps = moved / best / 1e9
        print(
            f"{mode:<12}{moved / 1e6:>8.0f}{f'{best:.3f} ({median:.3f})':>16}{gbps:>8.2f}{gbps / memcpy:>10.2f}{target or '':>8}"
        )


if __name__ == "__main__":
    main()
