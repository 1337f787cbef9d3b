"""Trainer speed: the log-prob pass and a training step of one Megatron rank, on a random model of a given shape.

Builds a random HF Qwen3 of the chosen shape (`--shape`: a published one such as `qwen3-0.6b`, or a small one that
fits a CPU), loads it through slime's own trainer path (`--hf-checkpoint`, `initialize_model_and_optimizer`), and
times, on a GRPO-shaped rollout (`--prompts` groups of `--n-samples` samples sharing a prompt):

- the log-prob pass (`forward_only`, what the trainer runs for reference and old-actor log-probs);
- a training step (`train`: forward, backward, optimizer step).

For each it prints the median seconds over `--repeats` (with min-max), tokens/s, peak memory and model FLOPs
utilisation against two ceilings: a matmul of the model's own shape measured in the same run (on any machine), and on
a GPU the datasheet's dense bf16 rate. The device is whatever slime picks (`slime.utils.device`; SLIME_DEVICE=cpu
forces the CPU): on a GPU, bf16 with Transformer Engine when installed; on a CPU, fp32 on the local spec.

`--layout flat tree` times flat packing and `--tree-training` (local spec; its attention `--tree-attention-backend`,
by default FlexAttention on a GPU) one after the other in the same run and prints tree/flat per pass (the ratio of
the medians; each layout's min-max beside it). Keep `--micro-batch-size` a multiple of `--n-samples`, so a group's
samples share one tree. FLOPs and MFU count the flat tokens in both (the work the model's output stands for).

    python benchmarks/bench_trainer.py                         # CPU-sized default shape
    python benchmarks/bench_trainer.py --shape qwen3-0.6b --prompts 8 --n-samples 8 --prompt-len 512 --response-len 512
    python benchmarks/bench_trainer.py --layout flat tree --micro-batch-size 8
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# hidden, layers, heads, kv heads, head dim, ffn, vocab: Qwen3-0.6B and -1.7B as published; `cpu` fits a 2-core machine
SHAPES = {
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                intermediate_size=768, vocab_size=8192),
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, vocab_size=151936),
}  # fmt: skip

# dense bf16 tensor-core peaks (FLOP/s) by device name, for model FLOPs utilisation on a GPU
GPU_PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def build_model(model_dir, shape, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        **SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False
    )
    Qwen3ForCausalLM(config).save_pretrained(model_dir)
    return config


def rollout(prompts, n, prompt_len, response_len, vocab, seed=0):
    """Train data in the rollout controller's format: `prompts` groups of `n` samples, each group sharing its prompt."""
    rng = np.random.default_rng(seed)
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward", "truncated")}
    for _ in range(prompts):
        prompt = rng.integers(3, vocab, prompt_len)
        for j in range(n):
            data["tokens"].append(np.concatenate([prompt, rng.integers(3, vocab, response_len)]).astype(np.int64))
            data["response_lengths"].append(response_len)
            data["loss_masks"].append(np.ones(response_len, dtype=np.int32))
            data["rewards"].append(float(j % 2))
            data["raw_reward"].append(float(j % 2))
            data["truncated"].append(0)
    data["sample_indices"] = list(range(prompts * n))
    return data


def model_flops_per_token(config, seq_len):
    """Forward FLOPs per token: 2 per weight of every matmul (lm head included, embedding lookup not) plus causal
    attention's QK^T and AV over an average context of (seq_len + 1) / 2."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attention = 4 * q * (seq_len + 1) / 2
    return 2 * (c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size) + c.num_hidden_layers * attention


def matmul_rate(config, dtype, device, repeats=5):
    """FLOP/s of this machine on the model's largest matmul (tokens x hidden @ hidden x ffn), measured now."""
    from slime.utils.device import synchronize

    m, k, n = 2048, config.hidden_size, config.intermediate_size
    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    times = []
    for _ in range(repeats + 1):
        synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        synchronize()
        times.append((time.perf_counter() - t0) / 10)
    return 2 * m * k * n / statistics.median(times[1:])


class _Ref:  # what process_rollout_data gets from Ray: `.inner` is handed to ray.get
    def __init__(self, data):
        self.inner = data


def _entry(rank, model_dir, opts, port, out_path):
    import torch.distributed as dist

    from slime.utils import device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    torch.set_num_threads(opts["threads"])
    device.set_device(0)
    dist.init_process_group(device.dist_backend(), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        _bench(model_dir, opts, out_path)
    finally:
        dist.destroy_process_group()


def _bench(model_dir, opts, out_path):
    import ray
    from transformers import AutoConfig

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from slime.utils import device
    from tests._megatron_helpers import train_args

    config = AutoConfig.from_pretrained(model_dir)
    samples, seq = opts["prompts"] * opts["n_samples"], opts["prompt_len"] + opts["response_len"]
    args = train_args(
        model_dir,
        global_batch_size=samples,
        rollout_batch_size=opts["prompts"],
        n_samples_per_prompt=opts["n_samples"],
        micro_batch_size=opts["micro_batch_size"],
        seq_length=seq,
        bf16=device.bf16_by_default(),
        transformer_impl="local" if opts["layout"] == "tree" else device.default_transformer_impl(),
        ci_test=False,
        use_kl_loss=False,
        lr=1e-6,
        tree_training=opts["layout"] == "tree",
        tree_attention_backend=opts["tree_attention_backend"] or device.default_tree_attention_backend(),
    )
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x  # the benchmark hands the dict itself instead of an ObjectRef
    data = process_rollout_data(args, _Ref(rollout(opts["prompts"], opts["n_samples"], opts["prompt_len"],
                                                   opts["response_len"], config.vocab_size)), 0, 1)  # fmt: skip
    iters, nmb = get_data_iterator(args, model, data)

    def reset_peak():
        if not device.is_cpu():
            torch.cuda.reset_peak_memory_stats()

    def peak_bytes():
        if device.is_cpu():
            import resource

            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the process's peak RSS
        return torch.cuda.max_memory_allocated()

    def timed(fn):
        device.synchronize()
        t0 = time.perf_counter()
        fn()
        device.synchronize()
        return time.perf_counter() - t0

    def log_probs():
        data.update(forward_only(args, model, iters, nmb))

    def step():
        compute_advantages_and_returns(args, data)
        train(args, 0, model, opt, sched, iters, nmb)

    log_probs()
    result = {}
    for name, fn in (("log-prob pass", log_probs), ("training step", step)):
        reset_peak()
        fn()  # warm-up
        result[name] = {"times": [timed(fn) for _ in range(opts["repeats"])], "peak_bytes": peak_bytes()}
    dtype = device.default_dtype(args.bf16)
    result["matmul_flops"] = matmul_rate(config, dtype, device.current_device())
    result["device"] = torch.cuda.get_device_name() if not device.is_cpu() else "cpu"
    result["dtype"] = str(dtype).removeprefix("torch.")
    with open(out_path, "w") as f:
        json.dump(result, f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    p.add_argument("--model-dir", help="an existing HF Qwen3 directory instead of a random one of --shape")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=96)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--layout", nargs="+", choices=["flat", "tree"], default=["flat"])
    p.add_argument("--tree-attention-backend", choices=["dense", "flex"], help="default: the device's")
    opts = vars(p.parse_args())

    from transformers import AutoConfig

    from tests._megatron_helpers import free_port, run_processes

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = opts["model_dir"] or os.path.join(tmp, "model")
        if not opts["model_dir"]:
            build_model(model_dir, opts["shape"])
        config = AutoConfig.from_pretrained(model_dir)
        results = {}
        for layout in opts["layout"]:
            out = os.path.join(tmp, f"{layout}.json")
            run = dict(opts, layout=layout)
            run_processes(_entry, (model_dir, run, free_port(), out), 1, "bench_trainer", opts["timeout"], "spawn")
            with open(out) as f:
                results[layout] = json.load(f)
    for layout, result in results.items():
        report(opts, config, layout, result)
    if len(results) == 2:
        for name in ("log-prob pass", "training step"):
            tree, flat = (statistics.median(results[k][name]["times"]) for k in ("tree", "flat"))
            print(f"  tree/flat {name}: {tree / flat:.2f}x ({tree:.3f} s vs {flat:.3f} s, medians)")


def report(opts, config, layout, result):
    samples, seq = opts["prompts"] * opts["n_samples"], opts["prompt_len"] + opts["response_len"]
    tokens = samples * seq
    flops_fwd = model_flops_per_token(config, seq) * tokens
    peak = next((v for k, v in GPU_PEAK_BF16.items() if k in result["device"]), None)
    print(
        f"bench_trainer ({layout}): {opts['model_dir'] or opts['shape']} on {result['device']} ({result['dtype']}), "
        f"{opts['prompts']} prompts x {opts['n_samples']} samples x ({opts['prompt_len']}+{opts['response_len']}) "
        f"tokens = {tokens} tokens per pass; matmul of the model's shape here: {result['matmul_flops'] / 1e12:.3f} "
        f"TFLOP/s"
    )
    for name, mult in (("log-prob pass", 1), ("training step", 3)):  # backward is twice the forward
        times = result[name]["times"]
        med = statistics.median(times)
        achieved = mult * flops_fwd / med
        mfu = f"{achieved / result['matmul_flops']:.2f}x matmul"
        if peak:
            mfu += f", MFU {achieved / peak:.1%} of {peak / 1e12:.0f} TFLOP/s"
        print(
            f"  {name:<14} {med:.3f} s (min-max {min(times):.3f}-{max(times):.3f}, {len(times)} runs)  "
            f"{tokens / med:,.0f} tokens/s  peak memory {result[name]['peak_bytes'] / 2**30:.2f} GiB  {mfu}"
        )


if __name__ == "__main__":
    main()
