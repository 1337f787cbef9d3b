"""Build a Megatron-Core `GPTModel` from Megatron-LM flags (slime's `get_model_provider_func`).

Layer spec: Transformer Engine when it is importable and we are on GPU, otherwise the local (pure torch) spec —
the one that runs on CPU. `--spec module fn` overrides both, as in slime (e.g. a custom GLM4 spec).
"""
import importlib

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig

from slime.utils.device import default_dtype, is_cpu
from slime.utils.misc import accepted_kwargs, load_function


def _arg(args, name, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def use_transformer_engine(args) -> bool:
    """TE spec only on GPU with transformer_engine installed (and not forced off by --transformer-impl local)."""
    if is_cpu() or _arg(args, "transformer_impl", "transformer_engine") == "local":
        return False
    return importlib.util.find_spec("transformer_engine") is not None


def padded_vocab_size(args) -> int:
    if getattr(args, "padded_vocab_size", None):
        return args.padded_vocab_size
    vocab = args.vocab_size
    multiple = _arg(args, "make_vocab_size_divisible_by", 128) * _arg(args, "tensor_model_parallel_size", 1)
    return (vocab + multiple - 1) // multiple * multiple


def core_transformer_config_from_args(args) -> TransformerConfig:
    dtype = default_dtype(bool(getattr(args, "bf16", False)))
    num_experts = _arg(args, "num_experts", None)
    vpp = _arg(args, "virtual_pipeline_model_parallel_size", None)
    vpp_overlap = vpp is not None and bool(_arg(args, "overlap_p2p_comm", True))
    group_query = _arg(args, "group_query_attention", _arg(args, "num_query_groups", None) is not None)
    kw = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=_arg(args, "ffn_hidden_size", 4 * args.hidden_size),
        num_attention_heads=args.num_attention_heads,
        num_query_groups=_arg(args, "num_query_groups", None) if group_query else None,
        kv_channels=_arg(args, "kv_channels", None),
        normalization=_arg(args, "normalization", "RMSNorm"),
        layernorm_epsilon=_arg(args, "norm_epsilon", 1e-5),
        gated_linear_unit=_arg(args, "swiglu", True),
        activation_func=F.silu if _arg(args, "swiglu", True) else F.gelu,
        add_bias_linear=_arg(args, "add_bias_linear", False),
        add_qkv_bias=_arg(args, "add_qkv_bias", False),
        qk_layernorm=_arg(args, "qk_layernorm", False),
        hidden_dropout=_arg(args, "hidden_dropout", 0.0),
        attention_dropout=_arg(args, "attention_dropout", 0.0),
        init_method_std=_arg(args, "init_method_std", 0.02),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=bool(getattr(args, "fp16", False)) and not is_cpu(),
        use_cpu_initialization=is_cpu() or bool(getattr(args, "use_cpu_initialization", False)),
        tensor_model_parallel_size=_arg(args, "tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=_arg(args, "pipeline_model_parallel_size", 1),
        virtual_pipeline_model_parallel_size=_arg(args, "virtual_pipeline_model_parallel_size", None),
        num_layers_in_first_pipeline_stage=_arg(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=_arg(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding_in_pipeline_split=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss_in_pipeline_split=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
        context_parallel_size=_arg(args, "context_parallel_size", 1),
        expert_model_parallel_size=_arg(args, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=_arg(args, "expert_tensor_parallel_size", None),
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        calculate_per_token_loss=bool(getattr(args, "calculate_per_token_loss", False)),
        recompute_granularity=_arg(args, "recompute_granularity", None),
        recompute_method=_arg(args, "recompute_method", None),
        recompute_num_layers=_arg(args, "recompute_num_layers", None),
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the allgather default rejects variable_seq_lengths even without MoE
        # CPU: no CUDA stream sync in p2p (PP>1); see cpu_compat.
        batch_p2p_sync=not is_cpu(),
        # Megatron-LM's defaults: the interleaved (VPP) schedule overlaps p2p with compute through individual
        # isend/irecv (which also keeps the two directions apart at PP=2); other schedules batch their p2p ops.
        overlap_p2p_comm=vpp_overlap,
        batch_p2p_comm=not vpp_overlap,
    )
    if num_experts:
        kw.update(
            num_moe_experts=num_experts,
            moe_router_topk=_arg(args, "moe_router_topk", 2),
            moe_ffn_hidden_size=_arg(args, "moe_ffn_hidden_size", kw["ffn_hidden_size"]),
            moe_grouped_gemm=bool(getattr(args, "moe_grouped_gemm", False)) and use_transformer_engine(args),
            # alltoall creates CUDA streams; allgather is the dispatcher that runs everywhere.
            moe_token_dispatcher_type="allgather" if is_cpu() else _arg(args, "moe_token_dispatcher_type", "alltoall"),
            moe_router_load_balancing_type=_arg(args, "moe_router_load_balancing_type", "aux_loss"),
            moe_aux_loss_coeff=_arg(args, "moe_aux_loss_coeff", 0.0),
            moe_router_pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
            moe_router_dtype=_arg(args, "moe_router_dtype", None),
        )
        if is_cpu():
            kw["variable_seq_lengths"] = False  # the allgather dispatcher rejects it; matters only for PP>1 p2p shapes
    return TransformerConfig(**kw)


def _layer_spec(args, config, vp_stage=None):
    if getattr(args, "spec", None):
        module, fn = args.spec
        return getattr(importlib.import_module(module), fn)(args)
    num_experts = _arg(args, "num_experts", None)
    qk = bool(getattr(args, "qk_layernorm", False))
    if use_transformer_engine(args):
        if num_experts:
            return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk)
    return get_gpt_layer_local_spec(
        num_experts=num_experts, qk_layernorm=qk, normalization=config.normalization
    )


def _custom_model_provider(path):
    """--custom-model-provider-path: `provider(pre_process=, post_process=)`, plus `vp_stage=` if it declares it."""
    provider = load_function(path)

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        kwargs = accepted_kwargs(provider, vp_stage=vp_stage)
        return provider(pre_process=pre_process, post_process=post_process, **kwargs)

    return model_provider


def get_model_provider_func(args):
    if args.custom_model_provider_path:
        return _custom_model_provider(args.custom_model_provider_path)

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        config = core_transformer_config_from_args(args)
        return GPTModel(
            config=config,
            transformer_layer_spec=_layer_spec(args, config, vp_stage),
            vocab_size=padded_vocab_size(args),
            max_sequence_length=_arg(args, "max_position_embeddings", _arg(args, "seq_length", 4096)),
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=False,
            parallel_output=True,
            share_embeddings_and_output_weights=not getattr(args, "untie_embeddings_and_output_weights", False),
            position_embedding_type=_arg(args, "position_embedding_type", "rope"),
            rotary_percent=_arg(args, "rotary_percent", 1.0),
            rotary_base=int(_arg(args, "rotary_base", 10000)),
            vp_stage=vp_stage,
        )

    return model_provider
