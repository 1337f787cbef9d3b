"""`--hf-checkpoint`'s config.json -> the Megatron architecture: what slime infers from it, and the check that given
model flags agree with it."""

import logging
import os

logger = logging.getLogger(__name__)


def _rope_theta(cfg):
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    return theta


def _rope_parameters(cfg) -> dict:
    """RoPE settings of an HF config: transformers 5 keeps them (theta, scaling, partial rotary) in
    `rope_parameters`; older configs have `rope_scaling` and top-level `partial_rotary_factor`."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    if getattr(cfg, "partial_rotary_factor", None) is not None:
        rope.setdefault("partial_rotary_factor", cfg.partial_rotary_factor)
    return rope


# RoPE-scaling parameters Megatron hard-codes (llama3 scaler; MLA yarn defaults): an HF config with other values
# cannot be trained faithfully, so it is refused at start-up.
_FIXED_ROPE_PARAMS = {
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
}


# HF model_type -> the layer spec (module, function) that builds it: transformers modules in Megatron layers.
HYBRID_SPECS = {
    "qwen3_next": ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"),
    "qwen3_5_text": ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"),
    "qwen3_5_moe_text": ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"),
}
# MiniMax-M2's attention (q/k norms over all heads)
MINIMAX_M2_SPEC = ("slime_plugins.models.minimax_m2", "get_minimax_m2_layer_spec")
# HF text model_type of a vision-language checkpoint -> the model provider (current slime's `--spec` protocol) that
# builds its language model and vision tower.
VLM_SPECS = {
    "qwen2_5_vl_text": ("slime_plugins.models.qwen2_5_vl", "get_qwen2_5_vl_model_provider"),
    "qwen3_vl_text": ("slime_plugins.models.qwen3_vl", "get_qwen3_vl_model_provider"),
    "qwen3_vl_moe_text": ("slime_plugins.models.qwen3_vl", "get_qwen3_vl_model_provider"),
}
# HF text model_type of a hybrid checkpoint with a vision tower -> the provider that trains both; chosen by
# --multimodal-keys (without it the decoder trains alone and the engine keeps the checkpoint's tower).
HYBRID_VLM_SPECS = {
    "qwen3_5_text": ("slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider"),
    "qwen3_5_moe_text": ("slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider"),
}


def _qwen_moe_layers(cfg):
    """1 for each routed layer of a Qwen-MoE config, 0 for a dense one, as transformers builds them: dense where
    `mlp_only_layers` lists the layer or `(layer + 1) % decoder_sparse_step` is not 0."""
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    dense = getattr(cfg, "mlp_only_layers", None) or []
    return [0 if i in dense or (i + 1) % step else 1 for i in range(cfg.num_hidden_layers)]


# hidden_act values that are SiLU in transformers' ACT2FN ("swiglu": configs that name the gated MLP itself)
_SILU_ACTS = ("silu", "swish", "swiglu")
# HF config keys of a LayerNorm (not RMSNorm) model's epsilon
_LAYER_NORM_KEYS = ("layer_norm_eps", "layer_norm_epsilon")


def _swiglu(cfg):
    """--swiglu for the HF config's (gated) MLP activation; None when the config names none."""
    act = getattr(cfg, "hidden_act", None)
    return None if act is None else str(act).lower() in _SILU_ACTS


def _layer_norm_key(cfg):
    """The config's LayerNorm epsilon key, for a model without `rms_norm_eps`; None if it has none."""
    return next((k for k in _LAYER_NORM_KEYS if getattr(cfg, k, None) is not None), None)


def hf_architecture(cfg, images=False) -> dict:
    """Megatron flag values (by dest) that describe the HF model `cfg` (Qwen2/3, Llama 2/3, Qwen3-MoE, GLM-4,
    GLM-4.5, DeepSeek-V3, MiMo, the vision-language ones' decoders); `images`: the checkpoint has a vision tower
    and the run trains on images. Raises ValueError for HF settings Megatron cannot reproduce."""
    model_type = getattr(cfg, "model_type", "") or ""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    rope = _rope_parameters(cfg)
    arch = {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": heads,
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads,
        "kv_channels": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "norm_epsilon": getattr(cfg, "rms_norm_eps", None),
        "rotary_base": _rope_theta(cfg),
        "untie_embeddings_and_output_weights": not getattr(cfg, "tie_word_embeddings", False),
        # every family slime converts has a gated MLP: SiLU there is Megatron's SwiGLU
        "swiglu": _swiglu(cfg),
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "qk_layernorm": model_type.startswith("qwen3") or bool(getattr(cfg, "use_qk_norm", False)),
        "add_qkv_bias": model_type in ("qwen2", "qwen2_moe", "mimo", "qwen2_5_vl_text")
        or bool(getattr(cfg, "attention_bias", False)),
        "add_bias_linear": False,
        "position_embedding_type": "rope",
        "rotary_percent": float(rope.get("partial_rotary_factor", 1.0)),
        "use_rope_scaling": rope["rope_type"] == "llama3",
    }
    if arch["norm_epsilon"] is not None:
        arch["normalization"] = "RMSNorm"
    elif _layer_norm_key(cfg):
        arch["normalization"] = "LayerNorm"
    if arch["rotary_base"] is not None:
        arch["rotary_base"] = int(arch["rotary_base"])
    fixed = _FIXED_ROPE_PARAMS.get(rope["rope_type"], {})
    for key, value in fixed.items():
        if key in rope and float(rope[key]) != float(value):
            raise ValueError(
                f"rope_parameters.{key}={rope[key]} ({rope['rope_type']} RoPE): Megatron-Core only "
                f"implements {key}={value}"
            )
    if rope["rope_type"] not in ("default", "llama3") and not (
        rope["rope_type"] == "yarn" and model_type == "deepseek_v3"
    ):
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported for {model_type!r}")
    if model_type in VLM_SPECS:  # 3-D (temporal, height, width) positions; the model lays out the frequencies
        arch.update(position_embedding_type="mrope", mrope_section=list(rope["mrope_section"]))
        arch["spec"] = list(VLM_SPECS[model_type])
    if arch["use_rope_scaling"]:
        arch["rope_scaling_factor"] = float(rope.get("factor", 8.0))
    if model_type == "glm4":  # every layer has post-attention and post-MLP norms; RoPE pairs are interleaved
        arch.update(post_self_attn_layernorm=True, post_mlp_layernorm=True, rotary_interleaved=True)
    if model_type == "deepseek_v3":
        arch.update(
            multi_latent_attention=True,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_nope_head_dim,
            qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            kv_channels=cfg.v_head_dim,
            qk_layernorm=True,
            rope_type="yarn" if rope["rope_type"] == "yarn" else "rope",
        )
        if rope["rope_type"] == "yarn":
            arch.update(
                rotary_scaling_factor=float(rope["factor"]),
                mscale=float(rope.get("mscale", 1.0)),
                mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            )
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        arch.update(
            num_experts=getattr(cfg, "num_experts", None) or cfg.num_local_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None) or arch["ffn_hidden_size"],
        )
        # softmax routing: transformers renormalises the top-k weights only with norm_topk_prob (Qwen2/3-MoE's default
        # is False; configs without the key, e.g. Mixtral's, always do), Megatron only without pre-softmax
        arch["moe_router_pre_softmax"] = not getattr(cfg, "norm_topk_prob", True)
        if getattr(cfg, "shared_expert_intermediate_size", None):  # Qwen2-MoE's shared expert, always gated
            arch["moe_shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
            arch["moe_shared_expert_gate"] = True
        sparse = _qwen_moe_layers(cfg)
        if 0 in sparse:  # Qwen-MoE's dense layers (mlp_only_layers, decoder_sparse_step): a dense MLP there
            arch["moe_layer_freq"] = sparse
    # MiniMax-M2: q/k RMSNorm over all heads; sigmoid top-k with a score-correction bias, renormalised
    if model_type == "minimax_m2":
        arch.update(
            spec=list(MINIMAX_M2_SPEC),
            qk_layernorm=True,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_dtype="fp32",
        )
    if model_type in HYBRID_SPECS:  # Gated DeltaNet layers between gated full-attention layers
        from slime_plugins.models.qwen3_next import hybrid_layer_types  # heavy (transformers modeling)

        for i, kind in enumerate(hybrid_layer_types(cfg)):
            if kind not in ("linear_attention", "full_attention"):
                raise ValueError(f"layer_types[{i}]={kind!r} is not a layer type slime can build for {model_type!r}")
        arch.update(spec=list(HYBRID_SPECS[model_type]), apply_layernorm_1p=True, attention_output_gate=True)
        if arch.get("num_experts"):
            # Qwen3.5-MoE: every layer routed (no mlp_only_layers / decoder_sparse_step), no dense MLP size
            arch.update(
                ffn_hidden_size=arch["ffn_hidden_size"] or arch["moe_ffn_hidden_size"],
                moe_layer_freq=_qwen_moe_layers(cfg),
            )
    if images and model_type in HYBRID_VLM_SPECS:
        arch.update(position_embedding_type="mrope", mrope_section=list(rope["mrope_section"]))
        arch["spec"] = list(HYBRID_VLM_SPECS[model_type])
    if getattr(cfg, "n_routed_experts", None):  # DeepSeek-V3 / GLM-4.5 routing
        if not getattr(cfg, "norm_topk_prob", True):
            raise ValueError("norm_topk_prob=False: Megatron-Core always renormalises sigmoid top-k scores")
        first_dense = getattr(cfg, "first_k_dense_replace", 0) or 0
        groups = getattr(cfg, "n_group", None) or 1
        arch.update(
            num_experts=cfg.n_routed_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_layer_freq=[0] * first_dense + [1] * (cfg.num_hidden_layers - first_dense),
            moe_shared_expert_intermediate_size=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size or None,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_pre_softmax=True,
            moe_router_dtype="fp32",
            moe_router_topk_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0)),
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=cfg.topk_group if groups > 1 else None,
        )
    return arch


# (HF attribute shown in messages, Megatron flag, dest): pairs that must agree (flags given next to --hf-checkpoint),
# RoPE variants, MoE routing and MLA dimensions included.
_HF_CHECKS = (
    ("hidden_size", "--hidden-size", "hidden_size"),
    ("num_attention_heads", "--num-attention-heads", "num_attention_heads"),
    ("num_hidden_layers", "--num-layers", "num_layers"),
    ("intermediate_size", "--ffn-hidden-size", "ffn_hidden_size"),
    ("tie_word_embeddings", "--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"),
    ("rms_norm_eps", "--norm-epsilon", "norm_epsilon"),
    ("rope_theta", "--rotary-base", "rotary_base"),
    ("num_key_value_heads", "--num-query-groups", "num_query_groups"),
    ("head_dim", "--kv-channels", "kv_channels"),  # named per config in _head_dim_key
    ("hidden_act", "--swiglu", "swiglu"),
    ("rms_norm_eps", "--normalization", "normalization"),  # named per config in _hf_mismatches
    ("vocab_size", "--vocab-size", "vocab_size"),  # unpadded: Megatron pads it (--make-vocab-size-divisible-by)
    ("rope_parameters.partial_rotary_factor", "--rotary-percent", "rotary_percent"),
    ("rope_parameters.rope_type", "--use-rope-scaling", "use_rope_scaling"),
    ("rope_parameters.factor", "--rope-scaling-factor", "rope_scaling_factor"),
    ("attention_bias", "--add-qkv-bias", "add_qkv_bias"),
    ("use_qk_norm", "--qk-layernorm", "qk_layernorm"),
    ("model_type", "--post-self-attn-layernorm", "post_self_attn_layernorm"),
    ("model_type", "--post-mlp-layernorm", "post_mlp_layernorm"),
    ("model_type", "--rotary-interleaved", "rotary_interleaved"),
    ("num_experts", "--num-experts", "num_experts"),
    ("num_experts_per_tok", "--moe-router-topk", "moe_router_topk"),
    ("moe_intermediate_size", "--moe-ffn-hidden-size", "moe_ffn_hidden_size"),
    (
        "n_shared_experts*moe_intermediate_size",
        "--moe-shared-expert-intermediate-size",
        "moe_shared_expert_intermediate_size",
    ),
    ("first_k_dense_replace", "--moe-layer-freq", "moe_layer_freq"),
    ("scoring", "--moe-router-score-function", "moe_router_score_function"),
    ("e_score_correction_bias", "--moe-router-enable-expert-bias", "moe_router_enable_expert_bias"),
    ("routed_scaling_factor", "--moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor"),
    ("n_group", "--moe-router-num-groups", "moe_router_num_groups"),
    ("topk_group", "--moe-router-group-topk", "moe_router_group_topk"),
    ("model_type", "--multi-latent-attention", "multi_latent_attention"),
    ("model_type", "--attention-output-gate", "attention_output_gate"),
    ("model_type", "--apply-layernorm-1p", "apply_layernorm_1p"),
    ("shared_expert_gate", "--moe-shared-expert-gate", "moe_shared_expert_gate"),
    ("norm_topk_prob", "--moe-router-pre-softmax", "moe_router_pre_softmax"),
    ("q_lora_rank", "--q-lora-rank", "q_lora_rank"),
    ("kv_lora_rank", "--kv-lora-rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "--qk-head-dim", "qk_head_dim"),
    ("qk_rope_head_dim", "--qk-pos-emb-head-dim", "qk_pos_emb_head_dim"),
    ("v_head_dim", "--v-head-dim", "v_head_dim"),
    ("rope_parameters.factor", "--rotary-scaling-factor", "rotary_scaling_factor"),
    ("rope_parameters.mscale", "--mscale", "mscale"),
    ("rope_parameters.mscale_all_dim", "--mscale-all-dim", "mscale_all_dim"),
)
_BOOL_FLAGS = {
    "untie_embeddings_and_output_weights",
    "use_rope_scaling",
    "add_qkv_bias",
    "qk_layernorm",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
    "rotary_interleaved",
    "multi_latent_attention",
    "moe_router_enable_expert_bias",
    "attention_output_gate",
    "apply_layernorm_1p",
    "moe_shared_expert_gate",
    "moe_router_pre_softmax",
    "swiglu",
}
# Model flags whose Megatron default is not None (GeLU MLP, LayerNorm) and fits no family slime converts: when the
# flag is absent from the command line (and from --megatron-config-path) they are taken from config.json like the None
# ones.
_FILLED_UNLESS_GIVEN = {"swiglu": "--swiglu", "normalization": "--normalization"}


def _head_dim_key(cfg, arch):
    """What --kv-channels is compared with: MLA's value head dim, `head_dim`, or hidden_size // heads."""
    if arch.get("multi_latent_attention"):
        return "v_head_dim"
    if getattr(cfg, "head_dim", None):
        return "head_dim"
    return "hidden_size/num_attention_heads"


def _layer_pattern(freq, num_layers):
    """`--moe-layer-freq` as a per-layer 0/1 list."""
    return list(freq) if isinstance(freq, list) else [1 if i % freq == 0 else 0 for i in range(num_layers)]


def _hf_mismatches(args, arch, cfg):
    """'--flag mine but hf_key=theirs' for every checked flag the user set differently from the HF config."""
    out = []
    for hf_name, flag, dest in _HF_CHECKS:
        hf_value = arch.get(dest)
        mine = getattr(args, dest)
        if dest == "num_query_groups" and not args.group_query_attention:
            mine = args.num_attention_heads
        if dest == "attention_output_gate":
            mine = mine or args.use_gated_attention
        if dest == "rope_scaling_factor" and not arch.get("use_rope_scaling"):
            continue
        if dest == "moe_layer_freq" and hf_value is not None and args.num_layers:
            mine = _layer_pattern(mine, args.num_layers)
            if mine != hf_value:
                out.append(f"{flag} {mine} but first_k_dense_replace={hf_value.count(0)}")
            continue
        if dest == "moe_router_pre_softmax" and arch.get("moe_router_score_function") == "sigmoid":
            continue  # sigmoid scores are the same either way
        if dest == "kv_channels":
            hf_name = _head_dim_key(cfg, arch)
        if dest == "normalization" and hf_value is not None and mine != hf_value:
            key = "rms_norm_eps" if hf_value == "RMSNorm" else _layer_norm_key(cfg)
            out.append(f"{flag} {mine} but {key}={getattr(cfg, key)} ({hf_value})")
            continue
        if dest in _BOOL_FLAGS:
            if hf_value is not None and bool(mine) != bool(hf_value):
                shown = {
                    "untie_embeddings_and_output_weights": not hf_value,
                    "use_rope_scaling": _rope_parameters(cfg)["rope_type"],
                    "moe_router_pre_softmax": not hf_value,
                    "swiglu": getattr(cfg, "hidden_act", None),
                }.get(dest, cfg.model_type if hf_name == "model_type" else hf_value)
                out.append(f"{flag} is {'set' if mine else 'not set'} but {hf_name}={shown}")
            continue
        if hf_value is None or mine is None:
            continue
        if (
            abs(float(mine) - float(hf_value)) > 1e-12 * max(1.0, abs(float(hf_value)))
            if isinstance(hf_value, float) or isinstance(mine, float)
            else mine != hf_value
        ):
            out.append(f"{flag} {mine} but {hf_name}={hf_value}")
    return out


# HF config keys of the dropout probabilities, per Megatron flag; a config without any has no such dropout.
HF_DROPOUT_KEYS = {
    "attention_dropout": ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"),
    "hidden_dropout": ("hidden_dropout", "hidden_dropout_prob", "resid_pdrop"),
}


def _dropout_from_hf(args, cfg, given):
    """Megatron's default dropout (0.1) is not what the HF model was trained with and perturbs RL's first-step
    invariants: flags the user did not give take the HF config's value."""
    for dest, keys in HF_DROPOUT_KEYS.items():
        flag = "--" + dest.replace("_", "-")
        if flag in given:
            continue
        value = next((float(getattr(cfg, k)) for k in keys if getattr(cfg, k, None) is not None), 0.0)
        setattr(args, dest, value)
        logger.info(
            "%s %s taken from --hf-checkpoint %s/config.json (flag not given)", flag, value, args.hf_checkpoint
        )


def apply_hf_config(args, error, check_paths, given=frozenset()):
    """Fill Megatron architecture flags the user did not give from `--hf-checkpoint`'s config.json, and check
    that the ones given agree with it. Also defaults `--model-name` to the lowercased HF config class name and
    the dropout flags not given to the HF config's dropout."""
    path = args.hf_checkpoint
    if not os.path.exists(path) and not check_paths:
        return  # dry run of a launch script for another machine: nothing to read
    from transformers import AutoConfig  # heavy

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=True)
    except Exception as e:
        error(
            f"--hf-checkpoint {path}: cannot read an HF model config there ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Point it at a directory with config.json."
        )
    if args.model_name is None:
        args.model_name = type(cfg).__name__.lower()
    _dropout_from_hf(args, cfg, given)
    images = bool(getattr(args, "multimodal_keys", None)) and getattr(cfg, "vision_config", None) is not None
    cfg = getattr(cfg, "text_config", None) or cfg  # vision-language checkpoints: the decoder's config
    if not hasattr(cfg, "num_hidden_layers") or not hasattr(cfg, "num_attention_heads"):
        return  # not a decoder LLM config we know how to map; Megatron flags must be given
    try:
        arch = hf_architecture(cfg, images)
    except ValueError as e:
        error(f"--hf-checkpoint {path}/config.json: {e}.")
    infer_all = args.num_layers is None  # no MODEL_ARGS at all: the HF config is the whole description
    for dest, value in arch.items():
        if value is None or not hasattr(args, dest):
            continue
        if infer_all or getattr(args, dest) is None:
            setattr(args, dest, value)
        elif dest in _FILLED_UNLESS_GIVEN and _FILLED_UNLESS_GIVEN[dest] not in given:
            if getattr(args, dest) != value:
                logger.info(
                    "%s %s taken from --hf-checkpoint %s/config.json (flag not given)",
                    _FILLED_UNLESS_GIVEN[dest],
                    value,
                    path,
                )
            setattr(args, dest, value)
    mismatches = _hf_mismatches(args, arch, cfg)
    hf_mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    key = "num_nextn_predict_layers"
    if not hf_mtp and getattr(cfg, "mtp_num_hidden_layers", 0):
        # Qwen3-Next / Qwen3.5: their checkpoints share one `mtp.fc` and its norms over every MTP layer, while
        # Megatron's MTP block keeps them per depth, so only one depth maps onto their names
        hf_mtp, key = cfg.mtp_num_hidden_layers, "mtp_num_hidden_layers"
        if args.mtp_num_layers and args.mtp_num_layers > 1:
            error(
                f"--mtp-num-layers {args.mtp_num_layers}: --hf-checkpoint {path}/config.json keeps its MTP layers "
                "as mtp_num_hidden_layers, which share one mtp.fc / pre_fc_norm_* / norm that Megatron's MTP block "
                "holds per depth; slime trains 1 of them: give --mtp-num-layers 1."
            )
    if args.mtp_num_layers and args.mtp_num_layers > hf_mtp:
        error(
            f"--mtp-num-layers {args.mtp_num_layers}: --hf-checkpoint {path}/config.json has {hf_mtp} "
            f"multi-token-prediction layer(s) ({key}); give at most that many, or drop the flag."
        )
    if hf_mtp and not args.mtp_num_layers:
        logger.info(
            "--hf-checkpoint %s has %d multi-token-prediction layer(s): without --mtp-num-layers the trainer builds "
            "no MTP block, so weight updates and exports leave them out (the engine keeps the checkpoint's).",
            path,
            hf_mtp,
        )
    if mismatches:
        error(
            f"Megatron model flags disagree with --hf-checkpoint {path}/config.json: {'; '.join(mismatches)}. "
            "Fix the MODEL_ARGS (or drop them to infer everything from the HF config)."
        )
