"""Shared by the Megatron tests: spawn gloo ranks with a timeout, Megatron args for an HF dir, tiny random HF models."""
import os
import socket
import time

import torch
import torch.multiprocessing as mp

from tests._args import make_args


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world_size, port, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK="0", SLIME_DEVICE="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size, *args, timeout=240):
    """Run `fn(rank, *args)` in `world_size` fresh gloo ranks; an assertion in any rank fails the caller."""
    run_processes(_entry, (fn, world_size, free_port(), args), world_size, fn.__name__, timeout)


def run_processes(entry, entry_args, nprocs, name, timeout):
    """`entry(index, *entry_args)` in `nprocs` spawned processes; the first failure (with its traceback) or the
    deadline fails the caller, and no process outlives the call."""
    ctx = mp.start_processes(entry, args=entry_args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.time() + timeout
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.time())):
            if time.time() > deadline:
                raise TimeoutError(f"{name}: {nprocs} process(es) did not finish within {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def train_once_for_offload(args, model, opt, sched, rollout, iters, nmb):
    """One GRPO step (so grads and Adam moments are non-trivial), then a bare actor holding what offload moves."""
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train

    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    train(args, 0, model, opt, sched, iters, nmb)
    actor = object.__new__(MegatronTrainRayActor)  # offload needs only these fields, not a Ray actor
    actor.args, actor.model, actor.optimizer, actor._offload_backup = args, model, opt, None
    return actor


# Megatron's parallel layout: passed as flags (not fields) so that what parse_args derives from it follows.
_LAYOUT_FLAGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
                 "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
                 "context_parallel_size": "--context-parallel-size",
                 "expert_model_parallel_size": "--expert-model-parallel-size",
                 "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank"}


def megatron_args(hf_dir, **overrides):
    """Real args (tests/_args.make_args) for the HF model in `hf_dir`: its config.json gives the architecture, as
    `--hf-checkpoint` does in a job; no dropout, 128-token sequences, no MoE aux loss. The parallel layout in
    `overrides` and the checkpoint paths become flags (with a world size the layout divides); every other
    override is set as a field."""
    argv = ["--seq-length", "128", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--moe-router-load-balancing-type", "none"]
    world = 1
    for name, flag in _LAYOUT_FLAGS.items():
        size = overrides.pop(name, None)
        if size is not None:
            argv += [flag, str(size)]
            world *= size if name != "virtual_pipeline_model_parallel_size" else 1
    for name in ("load", "save", "ref_load"):  # flags: parse_args derives resume-or-start-fresh from --load
        path = overrides.pop(name, None)
        if path is not None:
            argv += [f"--{name.replace('_', '-')}", str(path)]
    return make_args(*argv, "--actor-num-gpus-per-node", str(world), hf_checkpoint=hf_dir, **overrides)


def build_random_hf(kind, out_dir, seed=0):
    """A tiny random HF model of family `kind` in {qwen2, qwen3, llama, qwen3moe}; every tensor (norms too) random."""
    import transformers as tf

    common = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if kind == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(head_dim=24, **{**common, "tie_word_embeddings": True})
        cls = tf.Qwen3ForCausalLM
    elif kind == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif kind == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, **common)
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    model.save_pretrained(out_dir)
    return out_dir


def causal_mask(seq_len):
    """Megatron's explicit attention mask (True = masked) for a [b, s] padded batch: the local spec needs one on CPU."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def train_args(model_dir, **overrides):
    """Megatron + slime RL flags for the tiny kit: GRPO policy loss, 1 rollout of 2 prompts x 2 samples, gbs 4."""
    rl = dict(
        lr=1e-3, min_lr=0.0, clip_grad=1.0, optimizer="adam", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.98,
        adam_eps=1e-8, lr_decay_style="constant", use_checkpoint_opt_param_scheduler=True,
        accumulate_allreduce_grads_in_fp32=True, use_distributed_optimizer=False, global_batch_size=4, micro_batch_size=2,
        rollout_batch_size=2, n_samples_per_prompt=2, num_rollout=4, num_steps_per_rollout=None,
        use_dynamic_batch_size=False, max_tokens_per_gpu=None, balance_data=False, calculate_per_token_loss=False,
        loss_type="policy_loss", advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.2, eps_clip_c=None,
        kl_coef=0.0, use_kl_loss=True, kl_loss_coef=0.0, kl_loss_type="low_var_kl", entropy_coef=0.0, gamma=1.0,
        normalize_advantages=False, use_tis=False, tis_clip=2.0, tis_clip_low=0.0, rollout_temperature=1.0,
        use_rollout_entropy=False, compute_advantages_and_returns=True, ci_test=True, load=None, save=None,
        ref_load=None, offload=False, colocate=False, keep_old_actor=False, debug_rollout_only=False,
        debug_train_only=False, use_wandb=False, update_weight_buffer_size=512 * 1024**2,
        check_for_nan_in_loss_and_grad=True, fp16=False,
    )
    rl.update(overrides)
    return megatron_args(model_dir, **rl)


def fixed_rollout(vocab_size=512, n=4, seed=0):
    """A deterministic train-data dict in the rollout controller's format (tokens as int64 arrays, ...)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = [(5, 4), (7, 3), (4, 6), (6, 5)][:n]
    data = {"tokens": [], "response_lengths": [], "loss_masks": [], "rewards": [], "raw_reward": [], "truncated": [],
            "sample_indices": [], "rollout_log_probs": []}
    for i, (p, r) in enumerate(lengths):
        data["tokens"].append(rng.integers(3, vocab_size, p + r).astype(np.int64))
        data["response_lengths"].append(r)
        data["loss_masks"].append(np.ones(r, dtype=np.int32))
        data["rewards"].append([1.0, -1.0, 0.5, -0.5][i])
        data["raw_reward"].append([1.0, 0.0, 1.0, 0.0][i])
        data["truncated"].append(0)
        data["sample_indices"].append(i)
        data["rollout_log_probs"].append(np.full(r, -6.0, dtype=np.float32))
    return data


def hf_log_probs(model_dir, data):
    """Per-sample response log-probs of `data` (tokens, response_lengths) from a transformers fp32 forward."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for tokens, r in zip(data["tokens"], data["response_lengths"]):
            t = torch.as_tensor(tokens)[None]
            logp = torch.log_softmax(ref(t).logits[0].float(), -1)
            out.append(logp[-r - 1:-1].gather(-1, t[0, -r:, None])[:, 0])
    return out
