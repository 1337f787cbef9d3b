"""LoRA weight updates and trainer memory: adapter-only vs merged vs full fine-tuning, in the same run.

Builds a random Qwen3-style HF model locally (no hub), starts one real CPU inference server with LoRA serving
(`SGLangEngine`, `--enable-lora`) and one Megatron trainer (Ray actor, TP=1, disaggregated on one host), and times
`update_weights()` end to end (pause, gather, convert, transfer, load, continue) for:
  full      full fine-tuning: every weight, shared-memory buckets (the same-host path)
  merged    --enable-lora --lora-sync merged: W + s B A for adapted layers, same path and bytes as full
  adapter   --enable-lora --lora-sync adapter: only the adapters (PEFT tensors by value, sha256-checked)
Trainer memory is parameters + gradients + Adam state in fp32, from the trainer's parameter counts (a LoRA run keeps
gradients and optimizer state for the adapters only).

    python benchmarks/bench_lora.py [--hidden 1024 --ffn 4096 --layers 6 --rank 16 --repeats 5]
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile

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


def bench_mode(args, engine, repeats):
    from slime.ray.utils import Lock
    from tests.test_weight_sync import start_trainers, stop

    trainers, lock = start_trainers(args, colocate=False), Lock.remote()
    try:
        total, trainable = ray.get(trainers[0].param_counts.remote(), timeout=600)
        ray.get(trainers[0].connect.remote([engine], lock), timeout=600)
        ray.get(trainers[0].update_weights.remote(), timeout=600)  # warm-up: connections, first-touch pages
        runs = [ray.get(trainers[0].update_weights.remote(), timeout=600) for _ in range(repeats)]
    finally:
        stop(trainers + [lock])
    times = [r["perf/update_weights_time"] for r in runs]
    memory = total * 4 + trainable * (4 + 8)  # fp32 params, fp32 grads and Adam's two moments for trainable ones
    return runs[0]["perf/update_weights_bytes"], min(times), statistics.median(times), memory, trainable


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    opts = p.parse_args()

    from tests._megatron_helpers import megatron_args
    from tests.test_weight_sync import start_engines, stop
    from tools.build_tiny_kit import build_model

    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="bench-lora-")
    engines = []
    try:
        model_dir = os.path.join(workdir, "model")
        build_model(model_dir, hidden=opts.hidden, ffn=opts.ffn, layers=opts.layers)
        ray.init(
            num_cpus=8,
            num_gpus=4,
            include_dashboard=False,
            object_store_memory=1 << 30,
            log_to_driver=False,
            _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        )

        def run_args(**lora):
            a = megatron_args(
                model_dir,
                rollout_num_gpus_per_engine=1,
                rollout_num_gpus_per_node=4,
                inference_server="cpu",
                update_weight_buffer_size=512 << 20,
                update_weight_timeout=600,
                lora_rank=opts.rank,
                lora_alpha=2.0 * opts.rank,
                **lora,
            )
            a.check_weight_update_equal = False
            return a

        # one engine for all three: LoRA serving on (adapter sync needs it), full updates load as usual
        engines = start_engines(run_args(enable_lora=True, lora_sync="adapter"), 1)
        results = {
            "full": bench_mode(run_args(), engines[0], opts.repeats),
            "merged": bench_mode(run_args(enable_lora=True, lora_sync="merged"), engines[0], opts.repeats),
            "adapter": bench_mode(run_args(enable_lora=True, lora_sync="adapter"), engines[0], opts.repeats),
        }
    finally:
        stop(engines)
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
    full_bytes, full_best, _, full_mem, _ = results["full"]
    print(
        f"model: hidden {opts.hidden}, ffn {opts.ffn}, {opts.layers} layers, fp32; LoRA rank {opts.rank}, all-linear"
    )
    print(f"best of {opts.repeats} updates (median in brackets); ratios against full fine-tuning in this run")
    print(f"{'mode':<10}{'MB moved':>10}{'x full':>8}{'seconds':>18}{'x full':>8}{'trainer MB':>12}{'x full':>8}")
    for mode, (moved, best, median, mem, trainable) in results.items():
        print(
            f"{mode:<10}{moved / 1e6:>10.2f}{moved / full_bytes:>8.3f}{f'{best:.4f} ({median:.4f})':>18}"
            f"{best / full_best:>8.3f}{mem / 1e6:>12.0f}{mem / full_mem:>8.3f}   trainable {trainable:,}"
        )


if __name__ == "__main__":
    main()
