"""Time saved per rollout by reusing the training forward's log-probs as PPO's old log-probs.

With exactly one optimizer step per rollout the trainer skips its separate old-log-prob forward
(`actor.reuses_training_log_probs`). This runs both paths of one trainer rank on the tiny Qwen3 kit (Megatron on
CPU/gloo), alternating them on the same rollout so both see the same machine load:

- separate: old-log-prob forward, advantages, one optimizer step (what the trainer did before);
- reused:   advantages, one optimizer step whose forward also gives the old log-probs.

and prints the median seconds per rollout of each, and the fraction saved.

    .venv/bin/python benchmarks/bench_log_prob_reuse.py [--samples 32] [--response-len 96] [--repeats 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rollout(samples, prompt_len, response_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "tokens": [rng.integers(3, vocab, prompt_len + response_len).astype(np.int64) for _ in range(samples)],
        "response_lengths": [response_len] * samples,
        "loss_masks": [np.ones(response_len, dtype=np.int32) for _ in range(samples)],
        "rewards": [float(i % 2) for i in range(samples)],
        "raw_reward": [float(i % 2) for i in range(samples)],
        "truncated": [0] * samples,
        "sample_indices": list(range(samples)),
    }


class _Ref:  # what process_rollout_data gets from Ray: `.inner` is handed to ray.get
    def __init__(self, data):
        self.inner = data


def _bench(rank, model_dir, opts, out_path):
    import ray

    from slime.backends.megatron_utils.actor import needs_old_log_prob_forward
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.rollout_data import process_rollout_data
    from tests._megatron_helpers import train_args

    n = opts["samples"]
    args = train_args(
        model_dir,
        global_batch_size=n,
        rollout_batch_size=n // 2,
        micro_batch_size=opts["micro_batch_size"],
        seq_length=opts["prompt_len"] + opts["response_len"],
        ci_test=False,
        use_kl_loss=False,
        lr=1e-6,
    )
    assert not needs_old_log_prob_forward(args, num_steps=1)  # the reuse path is the one the trainer takes
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x
    data = _rollout(n, opts["prompt_len"], opts["response_len"], vocab=500)
    base = process_rollout_data(args, _Ref(data), 0, 1)
    iters, nmb = get_data_iterator(args, model, base)
    assert len(nmb) == 1

    def one(separate):
        rollout = dict(base)
        for it in iters:
            it.rollout_data = rollout
        t0 = time.perf_counter()
        if separate:
            rollout.update(forward_only(args, model, iters, nmb))
        compute_advantages_and_returns(args, rollout)
        train(args, 0, model, opt, sched, iters, nmb)
        return time.perf_counter() - t0

    one(True), one(False)  # warm-up
    times = {"separate": [], "reused": []}
    for _ in range(opts["repeats"]):
        times["separate"].append(one(True))
        times["reused"].append(one(False))
    torch.save(times, out_path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=96)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    opts = vars(p.parse_args())

    from tests._megatron_helpers import spawn
    from tools.build_tiny_kit import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "qwen3-tiny")
        build_model(model_dir)
        out = os.path.join(tmp, "times.pt")
        spawn(_bench, 1, model_dir, opts, out, timeout=1800)
        times = torch.load(out)
    sep, reu = statistics.median(times["separate"]), statistics.median(times["reused"])
    print(
        f"{opts['samples']} samples x {opts['prompt_len']}+{opts['response_len']} tokens, one optimizer step, "
        f"{opts['repeats']} repeats (median s per rollout)"
    )
    print(f"separate old-log-prob forward: {sep:.3f} s   {['%.3f' % t for t in times['separate']]}")
    print(f"reused training forward:       {reu:.3f} s   {['%.3f' % t for t in times['reused']]}")
    print(f"saved: {sep - reu:.3f} s per rollout ({(sep - reu) / sep:.0%})")


if __name__ == "__main__":
    main()
