"""Shared by the Megatron tests: spawn gloo ranks with a timeout, Megatron args for an HF dir, tiny random HF models."""

import multiprocessing
import os
import re
import time

import torch
import torch.multiprocessing as mp

from slime.utils.http_utils import free_port
from tests._args import make_args


def _entry(rank, fn, world_size, port, args):
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        SLIME_DEVICE="cpu",
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    poison_p2p_receive_buffers()
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


class _NaNEmptyTorch:
    """`torch` for Megatron's p2p module, with `empty` filled with NaN (integer shape buffers: -1)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, requires_grad=False, **kw):
        t = torch.empty(*shape, **kw)
        return t.fill_(float("nan") if t.is_floating_point() else -1).requires_grad_(requires_grad)


def poison_p2p_receive_buffers():
    """Pipeline stages receive into `torch.empty` buffers, and gloo fills only as many rows as were sent: NaN there
    makes any row a stage computes on but never received show in the results, every time (not now and then)."""
    from megatron.core.pipeline_parallel import p2p_communication

    p2p_communication.torch = _NaNEmptyTorch()


def spawn(fn, world_size, *args, timeout=240):
    """Run `fn(rank, *args)` in `world_size` fresh gloo ranks; an assertion in any rank fails the caller. A rendezvous
    port taken between choosing and binding it (by a process of the other test worker) is chosen again, twice."""
    for attempt in range(3):
        try:
            return run_processes(_entry, (fn, world_size, free_port(), args), world_size, fn.__name__, timeout)
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise


# What every rank imports (several seconds each on 2 cores): imported once, by the forkserver, which then forks each
# rank from that state. Fresh interpreters all the same for what the tests check: nothing is initialised at import
# (no process group, no device, no Megatron state), and the device is chosen inside each rank (`_entry`).
_PRELOAD = [
    "tests._megatron_helpers",
    "transformers",
    "slime.backends.megatron_utils.actor",
    "slime.backends.megatron_utils.model",
]
multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)


def run_processes(entry, entry_args, nprocs, name, timeout, start_method="forkserver"):
    """`entry(index, *entry_args)` in `nprocs` new processes (forked from the pre-imported forkserver; "spawn" for
    fresh interpreters); the first failure (with its traceback) or the deadline fails the caller, and no process
    outlives the call."""
    ctx = mp.start_processes(entry, args=entry_args, nprocs=nprocs, join=False, start_method=start_method)
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
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train

    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    train(args, 0, model, opt, sched, iters, nmb)
    actor = object.__new__(MegatronTrainRayActor)  # offload needs only these fields, not a Ray actor
    actor.args, actor.model, actor.optimizer, actor._offload_backup = args, model, opt, None
    return actor


# Megatron's parallel layout: passed as flags (not fields) so that what parse_args derives from it follows.
_LAYOUT_FLAGS = {
    "tensor_model_parallel_size": "--tensor-model-parallel-size",
    "pipeline_model_parallel_size": "--pipeline-model-parallel-size",
    "context_parallel_size": "--context-parallel-size",
    "expert_model_parallel_size": "--expert-model-parallel-size",
    "virtual_pipeline_model_parallel_size": "--num-virtual-stages-per-pipeline-rank",
}


def megatron_args(hf_dir, **overrides):
    """Real args (tests/_args.make_args) for the HF model in `hf_dir`: its config.json gives the architecture, as
    `--hf-checkpoint` does in a job; no dropout, 128-token sequences, no MoE aux loss. The parallel layout in
    `overrides` and the checkpoint paths become flags (with a world size the layout divides); every other
    override is set as a field."""
    argv = [
        "--seq-length",
        "128",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--moe-router-load-balancing-type",
        "none",
    ]
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


# MiMo ships as remote code (not in transformers): its public modeling file's structure, written into the test
# checkpoint so that `trust_remote_code=True` loads it offline. A Qwen2 decoder plus `model.mtp_layers`.
_MIMO_CONFIG = """from transformers import Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, *args, num_nextn_predict_layers=0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(*args, **kwargs)
"""
_MIMO_MODEL = """from torch import nn
from transformers import Qwen2ForCausalLM, Qwen2Model
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm

from .configuration_mimo import MiMoConfig


class MiMoMTPLayers(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm, self.post_attention_layernorm = Qwen2RMSNorm(h, eps=eps), Qwen2RMSNorm(h, eps=eps)
        self.token_layernorm, self.hidden_layernorm = Qwen2RMSNorm(h, eps=eps), Qwen2RMSNorm(h, eps=eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = Qwen2RMSNorm(h, eps=eps)
        self.self_attn = Qwen2Attention(config, layer_idx=0)
        self.mlp = Qwen2MLP(config)


class MiMoModel(Qwen2Model):
    config_class = MiMoConfig

    def __init__(self, config):
        super().__init__(config)
        self.mtp_layers = nn.ModuleList([MiMoMTPLayers(config) for _ in range(config.num_nextn_predict_layers)])


class MiMoForCausalLM(Qwen2ForCausalLM):
    config_class = MiMoConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = MiMoModel(config)
        self.post_init()
"""


def _build_mimo(common, out_dir):
    """(config, model class) of a tiny MiMo loaded from remote-code files written into `out_dir`."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    for name, text in (("configuration_mimo.py", _MIMO_CONFIG), ("modeling_mimo.py", _MIMO_MODEL)):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(text)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(
            {
                **common,
                "model_type": "mimo",
                "architectures": ["MiMoForCausalLM"],
                "hidden_act": "silu",
                "num_nextn_predict_layers": 1,
                "rope_theta": 640000.0,
                "auto_map": {
                    "AutoConfig": "configuration_mimo.MiMoConfig",
                    "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
                },
            },
            f,
        )
    cfg = AutoConfig.from_pretrained(out_dir, trust_remote_code=True)
    return cfg, lambda c: AutoModelForCausalLM.from_config(c, trust_remote_code=True)


def build_random_hf(kind, out_dir, seed=0, vocab_size=200, layer_types=None, num_layers=2):
    """A tiny random HF model of family `kind` in {qwen2, qwen3, llama, llama3, qwen3moe, glm4, glm4moe, deepseekv3,
    mimo, qwen3next, qwen3_5, qwen3_5_moe, qwen3_5_moe_vl (the published layout: a vision-language checkpoint)};
    every tensor (norms and router score biases too) random. `layer_types` (the hybrids): config.json's per-layer
    `linear_attention` / `full_attention` list (default linear, full, linear), which also sets the layer count."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=2,
    )
    # GLM-4.5 / DeepSeek-V3 routing: 1 dense + 2 MoE layers, 8 experts, a shared expert, scaled sigmoid top-k.
    routed = dict(
        num_hidden_layers=3,
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        moe_intermediate_size=32,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    )
    if kind == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(head_dim=24, **{**common, "tie_word_embeddings": True})
        cls = tf.Qwen3ForCausalLM
    elif kind == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif kind == "llama3":  # Llama-3.2 style: tied embeddings, llama3 RoPE scaling with factor 32
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        )
        cfg = tf.LlamaConfig(
            **{**common, "tie_word_embeddings": True, "max_position_embeddings": 131072}, rope_parameters=rope
        )
        cls = tf.LlamaForCausalLM
    elif kind == "glm4":
        cfg = tf.Glm4Config(head_dim=16, attention_bias=True, **common)
        cls = tf.Glm4ForCausalLM
    elif kind == "glm4moe":  # grouped query attention, q/k norm, qkv bias, partial rotary 0.5, no routing groups
        cfg = tf.Glm4MoeConfig(
            head_dim=16,
            num_experts_per_tok=2,
            use_qk_norm=True,
            attention_bias=True,
            n_group=1,
            topk_group=1,
            **{**common, **routed},
        )
        cls = tf.Glm4MoeForCausalLM
    elif kind == "deepseekv3":  # MLA with q-lora, yarn RoPE (factor 40), 4 routing groups of which 2 are kept
        rope = dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
        )
        cfg = tf.DeepseekV3Config(
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            rope_parameters=rope,
            **{**common, **routed, "num_key_value_heads": 4, "max_position_embeddings": 163840},
        )
        cls = tf.DeepseekV3ForCausalLM
    elif kind == "mimo":
        cfg, cls = _build_mimo(common, out_dir)
    elif kind in ("qwen3moe", "qwen3moe_dense_layers"):
        moe = dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        if (
            kind == "qwen3moe_dense_layers"
        ):  # dense MLPs in layers 0, 2 (decoder_sparse_step 2) and 3 (mlp_only_layers)
            moe.update(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
        cfg = tf.Qwen3MoeConfig(**{**common, **moe})
        cls = tf.Qwen3MoeForCausalLM
    elif kind == "minimaxm2":  # q/k norms over all heads, partial RoPE 0.5, sigmoid top-2 of 4 with a score bias
        cfg = tf.MiniMaxM2Config(
            head_dim=16,
            bos_token_id=1,
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
            **{**common, "intermediate_size": 32},
        )
        cls = tf.MiniMaxM2ForCausalLM
    elif kind == "qwen2moe":  # Qwen1.5/Qwen2-MoE: qkv bias, a sigmoid-gated shared expert, top-k weights not
        # renormalised (norm_topk_prob=False, as the published configs), a dense MLP in layer 0 (mlp_only_layers)
        moe = dict(
            num_hidden_layers=3,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        )
        cfg = tf.Qwen2MoeConfig(**{**common, **moe})
        cls = tf.Qwen2MoeForCausalLM
    elif kind in (
        "qwen3next",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_vl",
    ):  # Gated DeltaNet / gated full attention hybrids, partial RoPE 0.25
        layer_types = layer_types or ["linear_attention", "full_attention", "linear_attention"]
        hybrid = dict(
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=12,
            linear_conv_kernel_dim=4,
            layer_types=layer_types,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
            **{**common, "num_hidden_layers": len(layer_types)},
        )
        if kind == "qwen3next":  # softmax top-2 of 4 experts, a gated shared expert; layer 1 has a dense MLP
            cfg = tf.Qwen3NextConfig(
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                norm_topk_prob=True,
                mlp_only_layers=[1],
                **hybrid,
            )
            cls = tf.Qwen3NextForCausalLM
        elif kind.startswith("qwen3_5_moe"):  # every layer: softmax top-2 of 4 experts and a gated shared expert
            hybrid.pop("intermediate_size")  # no dense MLP
            moe = dict(
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
            )
            if kind == "qwen3_5_moe":
                cfg = tf.Qwen3_5MoeTextConfig(**moe, **hybrid)
                cls = tf.Qwen3_5MoeForCausalLM
            else:  # decoder under model.language_model., a one-block vision tower the trainer leaves alone
                vision = dict(
                    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4
                )
                cfg = tf.Qwen3_5MoeConfig(
                    text_config={**moe, **hybrid}, vision_config=vision, tie_word_embeddings=False
                )
                cls = tf.Qwen3_5MoeForConditionalGeneration
        else:
            cfg = tf.Qwen3_5TextConfig(**hybrid)
            cls = tf.Qwen3_5ForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
        if kind.startswith(
            ("qwen3next", "qwen3_5")
        ):  # zero-centred norms (scale 1 + w): w near 0, as trained ones are
            for name, p in model.named_parameters():
                if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")):
                    p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir)
    if kind == "qwen3_5_moe_vl":  # transformers writes one tensor per expert; the published checkpoint stacks them
        from safetensors.torch import load_file, save_file

        path = os.path.join(out_dir, "model.safetensors")
        tensors = load_file(path)
        for name, t in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                pre = name.rsplit(".", 1)[0] + "."
                for key in [k for k in tensors if k.startswith(pre) and k[len(pre)].isdigit()]:
                    del tensors[key]
                tensors[name] = t.detach().clone()
        save_file(tensors, path, metadata={"format": "pt"})
    return out_dir


_STACKED_EXPERTS = re.compile(r"^(.*\.experts\.)(gate_up_proj|down_proj)$")


def read_checkpoint(hf_dir):
    """Every tensor of every safetensors file in `hf_dir`, by name."""
    from safetensors import safe_open

    out = {}
    for fn in sorted(os.listdir(hf_dir)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, fn), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def decoder_checkpoint(hf_dir):
    """The tensors of `hf_dir`'s safetensors the trainer holds and exports: MTP layers and a vision tower left out,
    stacked experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) as the per-expert tensors."""
    from safetensors.torch import load_file

    out = {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if ".mtp_layers." in name or name.startswith("model.visual."):
            continue
        if m := _STACKED_EXPERTS.match(name):
            for e in range(t.shape[0]):
                if m.group(2) == "down_proj":
                    out[f"{m.group(1)}{e}.down_proj.weight"] = t[e]
                else:
                    gate, up = t[e].chunk(2)
                    out[f"{m.group(1)}{e}.gate_proj.weight"], out[f"{m.group(1)}{e}.up_proj.weight"] = gate, up
        else:
            out[name] = t
    return out


def causal_mask(seq_len):
    """Megatron's explicit attention mask (True = masked) for a [b, s] padded batch: the local spec needs one on CPU."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


def train_args(model_dir, **overrides):
    """Megatron + slime RL flags for the tiny kit: GRPO policy loss, 1 rollout of 2 prompts x 2 samples, gbs 4."""
    rl = dict(
        lr=1e-3,
        min_lr=0.0,
        clip_grad=1.0,
        optimizer="adam",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_eps=1e-8,
        lr_decay_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        accumulate_allreduce_grads_in_fp32=True,
        use_distributed_optimizer=False,
        global_batch_size=4,
        micro_batch_size=2,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        num_rollout=4,
        num_steps_per_rollout=None,
        use_dynamic_batch_size=False,
        max_tokens_per_gpu=None,
        balance_data=False,
        calculate_per_token_loss=False,
        loss_type="policy_loss",
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=0.2,
        eps_clip_c=None,
        kl_coef=0.0,
        use_kl_loss=True,
        kl_loss_coef=0.0,
        kl_loss_type="low_var_kl",
        entropy_coef=0.0,
        gamma=1.0,
        normalize_advantages=False,
        use_tis=False,
        tis_clip=2.0,
        tis_clip_low=0.0,
        rollout_temperature=1.0,
        use_rollout_entropy=False,
        compute_advantages_and_returns=True,
        ci_test=True,
        ci_train_rollout_logprob_abs_diff_threshold=float("inf"),  # fixed_rollout's rollout log-probs are made up
        load=None,
        save=None,
        ref_load=None,
        offload=False,
        colocate=False,
        keep_old_actor=False,
        debug_rollout_only=False,
        debug_train_only=False,
        use_wandb=False,
        update_weight_buffer_size=512 * 1024**2,
        check_for_nan_in_loss_and_grad=True,
        fp16=False,
    )
    rl.update(overrides)
    return megatron_args(model_dir, **rl)


def fixed_rollout(vocab_size=512, n=4, seed=0):
    """A deterministic train-data dict in the rollout controller's format (tokens as int64 arrays, ...)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = [(5, 4), (7, 3), (4, 6), (6, 5)][:n]
    data = {
        "tokens": [],
        "response_lengths": [],
        "loss_masks": [],
        "rewards": [],
        "raw_reward": [],
        "truncated": [],
        "sample_indices": [],
        "rollout_log_probs": [],
    }
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


# Four GRPO groups of 4 for the prefix-tree tests: prompts sharing heads, responses that branch (identical,
# prefix-of, ragged). Tree token counts (unique prompt tokens + unique response tokens): A 7+5, B 5+9, C 9+8, D 3+5.
TREE_GROUPS = [
    ([11, 12, 13, 21, 22, 23, 24], [[40, 41, 42], [40, 41, 43, 44], [40, 41, 42], [40, 41]]),
    ([11, 12, 13, 31, 32], [[50, 51, 52, 53], [50, 54], [60, 61, 62], [50, 51, 55]]),
    ([70, 71, 72, 73, 74, 75, 76, 77, 78], [[80], [80, 81, 82, 83, 84], [85, 86], [80, 81, 87]]),
    ([11, 12, 90], [[91, 92], [91, 92], [93], [91, 94, 95]]),
]


def grouped_rollout(groups=TREE_GROUPS):
    """Train data in the rollout controller's format for `groups` of (prompt, [responses])."""
    import numpy as np

    data = {k: [] for k in ("tokens", "response_lengths", "loss_masks", "rewards", "raw_reward", "truncated")}
    data.update(sample_indices=[], rollout_log_probs=[])
    rewards = [1.0, -1.0, 0.5, -0.5, 0.25, -0.75, 1.0, 0.0]
    for i, (p, r) in enumerate((p, r) for p, rs in groups for r in rs):
        data["tokens"].append(np.array(p + r, dtype=np.int64))
        data["response_lengths"].append(len(r))
        data["loss_masks"].append(np.ones(len(r), dtype=np.int32))
        data["rewards"].append(rewards[i % len(rewards)])
        data["raw_reward"].append(0.0)
        data["truncated"].append(0)
        data["sample_indices"].append(i)
        data["rollout_log_probs"].append(np.full(len(r), -5.0, dtype=np.float32))
    return data


def hf_log_probs(model_dir, data):
    """Per-sample response log-probs of `data` (tokens, response_lengths) from a transformers fp32 forward."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager", trust_remote_code=True
    ).eval()
    out = []
    with torch.no_grad():
        for tokens, r in zip(data["tokens"], data["response_lengths"]):
            t = torch.as_tensor(tokens)[None]
            logp = torch.log_softmax(ref(t).logits[0].float(), -1)
            out.append(logp[-r - 1 : -1].gather(-1, t[0, -r:, None])[:, 0])
    return out
