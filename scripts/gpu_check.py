"""The GPU check: slime's GPU path on a machine with CUDA GPUs.

    python scripts/gpu_check.py [--tier core|all] [--model-dir DIR] [--out outputs/gpu-check]

Runs, each as its own process, and prints a pass/fail table at the end (exit status 1 if any failed).
The `core` tier needs only torch, megatron-core, Ray and sglang-router (for its flags; no SGLang: what a GPU machine
without package registries has, once those are carried as wheels):
  1. tests/test_megatron_gpu.py (Transformer-Engine specs vs transformers, bf16 step, NCCL bucket, GPU offload);
  2. tests/test_gdn_kernel_gpu.py (the `fla` Gated DeltaNet kernel against the project's torch rule: forward and
     gradients, grouped value heads, variable lengths, bf16 and fp32; skipped without `fla`);
  3. benchmarks/bench_trainer.py on a random Qwen3-0.6B: log-prob pass and training step, tokens/s, peak memory, MFU,
     flat packing and then --tree-training (FlexAttention on the tree's block mask), and tree/flat.
`all` (the default) adds the runs with real SGLang (`slime[sglang]`):
  4. colocated train.py (--colocate, so --offload with torch_memory_saver): two rollout/update cycles, the engine
     releasing and resuming kv_cache, weights and cuda_graph around each update, --check-weight-update-equal;
  5. disaggregated train.py (1 trainer GPU + 1 engine GPU): weights by NCCL broadcast, --check-weight-update-equal.
The model is the tiny offline Qwen3 kit (built if missing), so nothing is downloaded; --model-dir takes another
local HF Qwen3 directory. Needs 2 GPUs for the disaggregated run (1 is enough for the others).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_QWEN3 = [
    "--num-layers",
    "4",
    "--hidden-size",
    "128",
    "--ffn-hidden-size",
    "512",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--kv-channels",
    "32",
    "--use-rotary-position-embeddings",
    "--rotary-base",
    "10000",
    "--disable-bias-linear",
    "--normalization",
    "RMSNorm",
    "--norm-epsilon",
    "1e-6",
    "--swiglu",
    "--qk-layernorm",
    "--vocab-size",
    "512",
    "--max-position-embeddings",
    "512",
]


def train_argv(model_dir, data_dir, out, *extra):
    return [
        sys.executable,
        "train.py",
        *TINY_QWEN3,
        "--hf-checkpoint",
        model_dir,
        "--inference-server",
        "sglang",
        "--prompt-data",
        f"{data_dir}/train.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--rm-type",
        "answer_match",
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--global-batch-size",
        "16",
        "--rollout-max-response-len",
        "8",
        "--lr",
        "1e-5",
        "--seed",
        "1",
        "--check-weight-update-equal",
        "--sglang-mem-fraction-static",
        "0.3",
        "--metrics-path",
        f"{out}/metrics.jsonl",
        *extra,
    ]


def run(name, argv, out, timeout, check=None):
    """Runs one step, its output in OUT/log.txt. Passes when it exits 0 and `check(out)` (if given) returns no
    complaint; the detail is `check`'s summary, else the step's last output line."""
    os.makedirs(out, exist_ok=True)
    start = time.time()
    with open(f"{out}/log.txt", "w") as log:
        try:
            rc = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    with open(f"{out}/log.txt") as log:
        lines = [line.rstrip() for line in log if line.strip()]
    detail, complaint = (lines[-1] if lines else str(rc)), None
    if rc == 0 and check is not None:
        detail, complaint = check(out)
    ok = rc == 0 and complaint is None
    return name, ok, f"{time.time() - start:.0f}s", f"{complaint or detail}; log {out}/log.txt"


def two_rollouts(out):
    """(summary, complaint) of a train.py run's metrics: it must have logged exactly two rollouts."""
    if not os.path.exists(f"{out}/metrics.jsonl"):
        return "no metrics", "no metrics.jsonl"
    with open(f"{out}/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    summary = f"{len(rows)} rollouts, weight versions {[r.get('rollout/weight_version') for r in rows]}"
    return summary, None if len(rows) == 2 else f"wrong rollout count: {summary}"


def core_checks(a):
    """The tier that needs no SGLang."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    return [
        run("tests/test_megatron_gpu.py", [*pytest, "tests/test_megatron_gpu.py"], f"{a.out}/megatron_gpu",
                    a.timeout),
        run("tests/test_gdn_kernel_gpu.py", [*pytest, "tests/test_gdn_kernel_gpu.py"], f"{a.out}/gdn_kernel",
                    a.timeout),
        run("benchmarks/bench_trainer.py --shape qwen3-0.6b --layout flat tree",
                    [sys.executable, "benchmarks/bench_trainer.py", "--shape", "qwen3-0.6b", "--prompts", "4",
                     "--n-samples", "8", "--prompt-len", "512", "--response-len", "512", "--micro-batch-size", "8",
                     "--layout", "flat", "tree"],
                    f"{a.out}/bench_trainer", a.timeout),
    ]  # fmt: skip


def sglang_checks(a):
    """train.py with real SGLang engines, colocated and disaggregated."""
    import torch

    one_gpu = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "1"]
    results = [
        run(
            "colocated, offload + torch_memory_saver, 2 cycles, --check-weight-update-equal",
            train_argv(a.model_dir, a.data_dir, f"{a.out}/colocate", *one_gpu, "--colocate"),
            f"{a.out}/colocate",
            a.timeout,
            two_rollouts,
        ),
    ]
    if torch.cuda.device_count() >= 2:
        results.append(
            run(
                "disaggregated, NCCL broadcast, 2 cycles, --check-weight-update-equal",
                train_argv(
                    a.model_dir,
                    a.data_dir,
                    f"{a.out}/disagg",
                    *one_gpu,
                    "--rollout-num-gpus",
                    "1",
                    "--update-weight-transport",
                    "broadcast",
                ),
                f"{a.out}/disagg",
                a.timeout,
                two_rollouts,
            )
        )
    else:
        results.append(("disaggregated, NCCL broadcast", False, "-", "needs 2 GPUs"))
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tier", choices=["core", "all"], default="all", help="core: no SGLang needed")
    ap.add_argument("--model-dir", default="models/qwen3-tiny")
    ap.add_argument("--data-dir", default="data/addition")
    ap.add_argument("--out", default="outputs/gpu-check")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per step")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False)")
    if a.tier == "all":
        import sglang

        print(f"gpu_check: {torch.cuda.device_count()} GPU(s), torch {torch.__version__}, sglang {sglang.__version__}")
    else:
        print(f"gpu_check (core tier, no SGLang): {torch.cuda.device_count()} GPU(s), torch {torch.__version__}")
    if not os.path.isfile(os.path.join(ROOT, a.model_dir, "config.json")):
        subprocess.run(
            [sys.executable, "tools/build_tiny_kit.py", "--model-dir", a.model_dir, "--data-dir", a.data_dir],
            cwd=ROOT,
            check=True,
        )
    results = core_checks(a) + (sglang_checks(a) if a.tier == "all" else [])
    width = max(len(r[0]) for r in results)
    print(f"\n{'check':<{width}}  result  time   detail")
    for name, ok, secs, detail in results:
        print(f"{name:<{width}}  {'PASS' if ok else 'FAIL':<6}  {secs:>5}  {detail}")
    sys.exit(0 if all(r[1] for r in results) else 1)


if __name__ == "__main__":
    main()
