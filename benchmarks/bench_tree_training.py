"""Prefix-tree training (`--tree-training`) against flat packing: the trainer's log-prob pass and a training step.

One Megatron rank on the tiny kit's Qwen3 (fp32, local spec, dynamic batching as the main job runs it), the same
rollout data through both layouts, interleaved in the same run (the order alternates every round). Shapes:

- `main`: the main job's (`scripts/run-qwen3-tiny-cpu.sh`): 16 GRPO groups of 8 per rollout, each sharing its
  chat-templated prompt "What is a+b?" (15 tokens with the kit's tokenizer; every prompt also shares the template's
  head with the others), responses of 2-3 tokens (an answer near a+b, then <|im_end|>), 2 steps of 64 samples,
  `--max-tokens-per-gpu 4096` (the default of `--max-tokens-per-gpu`);
- `long`: 2 groups of 8 sharing a random 512-token prompt, random 64-token responses, one step.

Prints, per shape, the tokens each layout computes (real tokens and padded slots), the median seconds of the
log-prob pass (`forward_only`) and of a training step (`train`: forward, backward, optimizer step, lr 0 so the
weights stay put), each tree/flat ratio as the median (min-max) over the rounds' pairs, and max |Δ log-prob|.

    python benchmarks/bench_tree_training.py --repeats 5
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


def main_job_rollout(tokenizer, groups=16, n=8, seed=0):
    """The main job's rollout shape: real chat-templated addition prompts, answers of 1-2 digits + <|im_end|>."""
    rng = np.random.default_rng(seed)
    samples = []
    for problem in rng.choice(100, groups, replace=False):  # distinct problems: no two groups share a whole prompt
        a, b = divmod(int(problem), 10)
        messages = [{"role": "user", "content": f"What is {a}+{b}?"}]
        prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        for _ in range(n):  # a policy in training: mostly the right sum, some near misses
            answer = max(0, a + b + int(rng.choice([0, 0, 0, -1, 1, 2])))
            samples.append((prompt, tokenizer.encode(f"{answer}<|im_end|>")))
    return samples


def random_rollout(groups, n, prompt_len, response_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(groups):
        prompt = rng.integers(3, vocab, prompt_len).tolist()
        samples += [(prompt, rng.integers(3, vocab, response_len).tolist()) for _ in range(n)]
    return samples


def train_data(samples):
    """Train data in the rollout controller's format."""
    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward", "truncated")}
    for i, (p, r) in enumerate(samples):
        data["tokens"].append(np.array(p + r, dtype=np.int64))
        data["response_lengths"].append(len(r))
        data["loss_masks"].append(np.ones(len(r), dtype=np.int32))
        data["rewards"].append(float(i % 2))
        data["raw_reward"].append(float(i % 2))
        data["truncated"].append(0)
    data["sample_indices"] = list(range(len(samples)))
    return data


class _Ref:  # what process_rollout_data gets from Ray: `.inner` is handed to ray.get
    def __init__(self, data):
        self.inner = data


def _entry(rank, model_dir, shape, opts, port, out_path):
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", SLIME_DEVICE="cpu"
    )
    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        _bench(model_dir, shape, opts, out_path)
    finally:
        dist.destroy_process_group()


def _bench(model_dir, shape, opts, out_path):
    import ray
    from transformers import AutoTokenizer

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import _tree_layout, get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from tests._megatron_helpers import train_args

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if shape == "main":
        samples, groups, step = main_job_rollout(tokenizer), 16, 64
    else:
        samples, groups, step = random_rollout(2, 8, 512, 64, len(tokenizer)), 2, 16
    args = train_args(
        model_dir,
        global_batch_size=step,
        rollout_batch_size=groups,
        n_samples_per_prompt=8,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=opts["max_tokens_per_gpu"],
        seq_length=1024,
        ci_test=False,
        use_kl_loss=False,
        lr=0.0,  # the weights stay put, so every round measures the same model
    )
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x  # the benchmark hands the dict itself instead of an ObjectRef
    data = process_rollout_data(args, _Ref(train_data(samples)), 0, 1)
    layouts = {}
    for tree in (False, True):  # the flag decides how dynamic batching fills micro-batches (tokens vs tree tokens)
        args.tree_training = tree
        layouts["tree" if tree else "flat"] = get_data_iterator(args, model, data)

    tokens = {}
    for name, (iters, _) in layouts.items():
        real = padded = 0
        for mb in iters[0].micro_batch_indices:
            seqs = [torch.as_tensor(data["tokens"][i]) for i in mb]
            if name == "tree":
                row = _tree_layout(seqs)["tokens"].numel()  # no TP padding: the row is the tree's unique tokens
                real, padded = real + row, padded + row
            else:
                real += sum(s.numel() for s in seqs)
                padded += len(seqs) * max(s.numel() for s in seqs)
        tokens[name] = {"real": real, "padded": padded, "micro_batches": len(iters[0].micro_batch_indices)}

    def log_probs(name):
        iters, nmb = layouts[name]
        return forward_only(args, model, iters, nmb)

    def step_fn(name):
        iters, nmb = layouts[name]
        train(args, 0, model, opt, sched, iters, nmb)

    flat_lp, tree_lp = log_probs("flat"), log_probs("tree")
    max_dlogp = max((a - b).abs().max().item() for a, b in zip(flat_lp["log_probs"], tree_lp["log_probs"]))
    data.update(flat_lp)
    data.update({"ref_" + k: v for k, v in flat_lp.items()})
    compute_advantages_and_returns(args, data)
    for name in layouts:
        step_fn(name)  # warm-up

    def timed(fn, name):
        t0 = time.perf_counter()
        fn(name)
        return time.perf_counter() - t0

    times = {(kind, name): [] for kind in ("log_probs", "train_step") for name in layouts}
    for r in range(opts["repeats"]):
        order = ("flat", "tree") if r % 2 == 0 else ("tree", "flat")
        for kind, fn in (("log_probs", log_probs), ("train_step", step_fn)):
            for name in order:
                times[(kind, name)].append(timed(fn, name))
    result = {
        "samples": len(samples),
        "prompt_len": statistics.median(len(p) for p, _ in samples),
        "response_lens": sorted({len(r) for _, r in samples}),
        "tokens": tokens,
        "max_dlogp": max_dlogp,
        "times": {f"{k}/{n}": v for (k, n), v in times.items()},
    }
    with open(out_path, "w") as f:
        json.dump(result, f)


def _spread(values):
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def report(shape, r):
    t = r["tokens"]
    print(
        f"[{shape}] {r['samples']} samples, prompt {r['prompt_len']:.0f} tokens, responses {r['response_lens']} tokens; "
        f"max |dlogp| tree vs flat {r['max_dlogp']:.1e}"
    )
    print(
        f"  tokens computed: flat {t['flat']['real']} ({t['flat']['padded']} padded slots, "
        f"{t['flat']['micro_batches']} micro-batches) vs tree {t['tree']['real']} ({t['tree']['micro_batches']} "
        f"micro-batches): {t['flat']['real'] / t['tree']['real']:.2f}x fewer real tokens, "
        f"{t['flat']['padded'] / t['tree']['padded']:.2f}x fewer slots"
    )
    for kind in ("log_probs", "train_step"):
        flat, tree = r["times"][f"{kind}/flat"], r["times"][f"{kind}/tree"]
        ratios = [b / a for a, b in zip(flat, tree)]
        print(
            f"  {kind:<10} flat {_spread(flat)} s  tree {_spread(tree)} s  tree/flat {_spread(ratios)} "
            f"= {1 / statistics.median(ratios):.2f}x faster ({len(flat)} interleaved rounds)"
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=["main", "long"], default=["main", "long"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens-per-gpu", type=int, default=4096, help="dynamic batching's budget (the main job's)")
    p.add_argument("--timeout", type=int, default=1800)
    opts = vars(p.parse_args())

    from tests._megatron_helpers import free_port, run_processes
    from tools.build_tiny_kit import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(os.path.join(tmp, "qwen3-tiny"))
        for shape in opts["shapes"]:
            out = os.path.join(tmp, f"{shape}.json")
            args = (model_dir, shape, opts, free_port(), out)
            run_processes(_entry, args, 1, "bench_tree_training", opts["timeout"], "spawn")
            with open(out) as f:
                report(shape, json.load(f))


if __name__ == "__main__":
    main()
