"""Build a Megatron-Core `GPTModel` from Megatron-LM flags (slime's `get_model_provider_func`).

Layer spec: Transformer Engine when it is importable and we are on GPU, otherwise the local (pure torch) spec —
the one that runs on CPU. `--spec module fn` overrides both, as in slime (e.g. a custom GLM4 spec).
"""

import copy
import importlib
import inspect
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.transformer_config import MLATransformerConfig

from slime.backends.megatron_utils.cp_attention import AllGatherKVDotProductAttention
from slime.backends.megatron_utils.tree_attention import TREE_FLEX
from slime.utils.device import current_device, default_dtype
from slime.utils.misc import accepted_kwargs
from slime.utils.user_errors import user_function

from . import cpu_compat
from .arguments import use_transformer_engine
from .local_layers import mla_local_spec, with_post_norms
from .mtp import MTPGPTModel, mtp_block_spec
from .param_utils import PREFIX, named_parameters


def rope_fusion(args) -> bool:
    """Megatron-LM's `--no-rope-fusion` (fusion on by default): the fused RoPE kernel is Transformer Engine's, so
    without TE (CPU, `--transformer-impl local`) RoPE runs unfused; Megatron fuses MLA's RoPE only for YaRN."""
    if not (args.apply_rope_fusion and use_transformer_engine(args)):
        return False
    return not (args.multi_latent_attention and args.rope_type != "yarn")


def padded_vocab_size(args) -> int:
    if args.padded_vocab_size:
        return args.padded_vocab_size
    vocab = args.vocab_size
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return (vocab + multiple - 1) // multiple * multiple


def _cp_comm_type(args):
    """Megatron-LM's `--cp-comm-type`: one type for every layer, or one per layer."""
    types = args.cp_comm_type
    if types is None or isinstance(types, str):
        return types
    return types[0] if len(types) == 1 else list(types)


def core_transformer_config_from_args(args) -> TransformerConfig:
    dtype = default_dtype(bool(args.bf16))
    num_experts = args.num_experts
    vpp = args.virtual_pipeline_model_parallel_size
    vpp_overlap = vpp is not None and bool(args.overlap_p2p_comm)
    kw = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        kv_channels=args.kv_channels,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear,
        add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=args.qk_layernorm,
        layernorm_zero_centered_gamma=bool(args.apply_layernorm_1p),
        attention_output_gate=bool(args.attention_output_gate),
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=bool(args.fp16),
        use_cpu_initialization=bool(args.use_cpu_initialization),
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=args.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=args.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=bool(args.account_for_embedding_in_pipeline_split),
        account_for_loss_in_pipeline_split=bool(args.account_for_loss_in_pipeline_split),
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=_cp_comm_type(args),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=bool(args.sequence_parallel),
        # fused weight-gradient accumulation into Megatron DDP's main_grad: Transformer Engine's layers only
        gradient_accumulation_fusion=bool(args.gradient_accumulation_fusion) and use_transformer_engine(args),
        calculate_per_token_loss=bool(args.calculate_per_token_loss),
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        mtp_num_layers=args.mtp_num_layers,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # the allgather default rejects variable_seq_lengths even without MoE
        batch_p2p_sync=True,
        # Megatron-LM's defaults: the interleaved (VPP) schedule overlaps p2p with compute through individual
        # isend/irecv (which also keeps the two directions apart at PP=2); other schedules batch their p2p ops.
        overlap_p2p_comm=vpp_overlap,
        batch_p2p_comm=not vpp_overlap,
    )
    if num_experts:
        kw.update(
            num_moe_experts=num_experts,
            moe_layer_freq=args.moe_layer_freq,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=bool(args.moe_shared_expert_gate),
            moe_router_score_function=args.moe_router_score_function,
            moe_router_enable_expert_bias=bool(args.moe_router_enable_expert_bias),
            moe_router_bias_update_rate=args.moe_router_bias_update_rate,
            moe_router_num_groups=args.moe_router_num_groups,
            moe_router_group_topk=args.moe_router_group_topk,
            moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            moe_router_topk=args.moe_router_topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_grouped_gemm=bool(args.moe_grouped_gemm) and use_transformer_engine(args),
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_router_load_balancing_type=args.moe_router_load_balancing_type,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff,
            moe_router_pre_softmax=bool(args.moe_router_pre_softmax),
            moe_router_dtype=args.moe_router_dtype,
            moe_enable_routing_replay=bool(args.use_routing_replay),  # R2/R3: routers can replay given experts
        )
    if getattr(args, "fp8", None):  # Transformer Engine's FP8 GEMMs (start-up refuses it without TE)
        kw.update(fp8=args.fp8, fp8_recipe=args.fp8_recipe)
    if args.position_embedding_type == "mrope":
        kw["mrope_section"] = args.mrope_section
    kw["rotary_interleaved"] = bool(args.rotary_interleaved)
    kw["apply_rope_fusion"] = rope_fusion(args)
    kw.update(cpu_compat.transformer_config_overrides(kw))
    if args.multi_latent_attention:
        config = MLATransformerConfig(
            **kw,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            rope_type=args.rope_type,
            rotary_base=args.rotary_base,
            rotary_percent=args.rotary_percent,
            rotary_scaling_factor=args.rotary_scaling_factor,
            mscale=args.mscale,
            mscale_all_dim=args.mscale_all_dim,
        )
    else:
        config = TransformerConfig(**kw)
    return cpu_compat.finish_transformer_config(config)


def _user_spec(args, config, vp_stage):
    """`--spec MODULE FN`: current slime calls `FN(args, config, vp_stage)`, slime v0.1.0 `FN(args)` (decided by its
    signature); FN may return a layer spec or a model provider. A non-callable FN is the spec itself."""
    spec = getattr(importlib.import_module(args.spec[0]), args.spec[1])
    if not callable(spec):
        return spec
    params = inspect.signature(spec).parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return spec(args, config, vp_stage)
    return spec(args)  # the spec adds what it needs (post norms, ...)


def _is_model_provider(spec):
    """A `--spec` result that builds the model itself (current slime: a callable taking `pre_process`)."""
    return callable(spec) and "pre_process" in inspect.signature(spec).parameters


def _layer_spec(args, config, vp_stage=None):
    """The decoder's layer spec: `--spec module fn` (`_user_spec`), else TE on GPU / local elsewhere; a block spec
    with MoE (it honours `--moe-layer-freq`) or MLA; GLM-4 post norms where asked for."""
    if args.spec:
        return _user_spec(args, config, vp_stage)
    return default_layer_spec(args, config, vp_stage)


def default_layer_spec(args, config, vp_stage=None):
    """The layer spec without `--spec` (also what a model plugin builds its language model with)."""
    te = use_transformer_engine(args)
    if args.num_experts or config.multi_latent_attention:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=te, normalization=config.normalization, vp_stage=vp_stage
        )
        if not te and config.multi_latent_attention:
            spec.layer_specs = [mla_local_spec(s) for s in spec.layer_specs]
    elif te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=bool(args.qk_layernorm))
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=bool(args.qk_layernorm), normalization=config.normalization)
    if args.post_self_attn_layernorm or args.post_mlp_layernorm:
        spec = with_post_norms(spec, args, te)
    if config.context_parallel_size > 1 and not te:  # TE's attention implements CP itself (config.cp_comm_type)
        spec = with_cp_attention(spec)
    if getattr(args, "tree_training", False) and getattr(args, "tree_attention_backend", None) == "flex":
        spec = with_core_attention(spec, TREE_FLEX, "--tree-attention-backend flex", "--tree-attention-backend dense")
    return spec


def with_cp_attention(spec):
    """The local spec under CP: megatron's DotProductAttention refuses CP > 1, the all-gather-KV one takes its place."""
    return with_core_attention(
        spec,
        {DotProductAttention: AllGatherKVDotProductAttention},
        "--context-parallel-size > 1 without Transformer Engine",
        "--context-parallel-size 1 or the TE spec (GPU)",
    )


def with_core_attention(spec, replacements, what, instead):
    """`spec` with each local core attention replaced as `replacements` ({class: its replacement}) says (`what`
    needs it; else use `instead`)."""
    spec = copy.deepcopy(spec)
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention in replacements.values():  # block specs share one submodule spec
            continue
        if attention.core_attention not in replacements:
            raise ValueError(
                f"{what} replaces megatron's local core attention, but this layer spec's core attention is "
                f"{attention.core_attention.__name__}; use {instead}"
            )
        attention.core_attention = replacements[attention.core_attention]
    return spec


def _custom_model_provider(path):
    """--custom-model-provider-path: `provider(pre_process=, post_process=)`, plus `vp_stage=` if it declares it."""
    provider = user_function("--custom-model-provider-path", path)

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        kwargs = accepted_kwargs(provider, vp_stage=vp_stage)
        return provider(pre_process=pre_process, post_process=post_process, **kwargs)

    return model_provider


class ValueHead(torch.nn.Linear):
    """The critic's output layer: hidden -> one value per position, replicated on every tensor-parallel rank (one
    column cannot be split). It takes GPTModel's output-layer call and returns `(values [s, b, 1], None)`; under
    sequence parallelism the sequence shards are gathered first, as the vocab projection would. Its initial weights
    come from a generator of their own seeded with `seed`, so that they are the same whatever the parallel layout
    (the global RNG differs by pipeline stage and by what was drawn before)."""

    def __init__(self, config, seed):
        super().__init__(config.hidden_size, 1, bias=True, dtype=config.params_dtype)
        self.sequence_parallel = config.sequence_parallel
        for p in self.parameters():  # megatron's grad all-reduce over the SP region
            p.sequence_parallel = config.sequence_parallel
        init = torch.randn(self.weight.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
        with torch.no_grad():
            self.weight.copy_(init * config.init_method_std)
            self.bias.zero_()

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        values = super().forward(hidden_states).float()
        if self.sequence_parallel:
            values = tensor_parallel.gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def _with_role(provider, role, seed):
    """`role="critic"`: the last stage's output layer becomes a one-output `ValueHead` (initialised from `seed`)."""
    if role == "actor":
        return provider

    def critic_provider(pre_process=True, post_process=True, vp_stage=None):
        model = provider(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if post_process:
            model.output_layer = ValueHead(model.config, seed)
        return model

    return critic_provider


def gpt_model_kwargs(args, config, layer_spec, pre_process, post_process, vp_stage):
    """`GPTModel`'s arguments from the flags (shared with the model plugins that subclass it)."""
    return dict(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(args),
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=False,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=int(args.rotary_base),
        rope_scaling=bool(args.use_rope_scaling),
        rope_scaling_factor=args.rope_scaling_factor,
        vp_stage=vp_stage,
    )


def get_model_provider_func(args, role="actor"):
    if args.custom_model_provider_path:
        return _with_role(_custom_model_provider(args.custom_model_provider_path), role, args.seed)

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        config = core_transformer_config_from_args(args)
        layer_spec = _layer_spec(args, config, vp_stage)
        if _is_model_provider(layer_spec):  # current slime's model plugins return their own provider
            if args.mtp_num_layers:
                raise ValueError(
                    f"--mtp-num-layers with --spec {' '.join(args.spec)}: that spec builds its own model, without "
                    "slime's MTP block; drop --mtp-num-layers"
                )
            return layer_spec(pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        mtp_spec = mtp_block_spec(args, layer_spec, use_transformer_engine(args), post_process)
        model = (MTPGPTModel if mtp_spec is not None else GPTModel)(
            **gpt_model_kwargs(args, config, layer_spec, pre_process, post_process, vp_stage), mtp_block_spec=mtp_spec
        )
        if mtp_spec is not None:
            model.real_vocab_size = args.vocab_size
        return model

    return _with_role(model_provider, role, args.seed)


def freeze_model_params(model, args):
    """`--only-train-params-name-list` / `--freeze-params-name-list` on this rank's model chunks (before any
    wrapper: DDP and the optimizer then leave frozen parameters out). Names are matched (re.search) as
    `decoder.layers.<global layer>.<...>`, `embedding.word_embeddings.weight`, `output_layer.weight`, ...; a tied
    output layer is the embedding (the last stage's copy goes by the embedding's name, so both copies train or
    neither). Collective over all ranks: a pattern that matches no parameter anywhere is an error naming it."""
    only, freeze = args.only_train_params_name_list, args.freeze_params_name_list
    if not (only or freeze):
        return
    patterns = only or freeze
    hits = torch.zeros(len(patterns), dtype=torch.int32)
    for name, param in named_parameters(args, model):
        if not isinstance(param, torch.nn.Parameter):  # MoE expert_bias buffers never train
            continue
        name = name[len(PREFIX) :]
        if name == "output_layer.weight" and getattr(param, "shared_embedding", False):
            name = "embedding.word_embeddings.weight"
        matched = [i for i, p in enumerate(patterns) if re.search(p, name)]
        hits[matched] = 1
        param.requires_grad = bool(matched) if only else not matched
    hits = hits.to(current_device())
    dist.all_reduce(hits, op=dist.ReduceOp.MAX)  # pipeline stages and expert-parallel ranks hold different names
    unmatched = [p for p, h in zip(patterns, hits.tolist()) if not h]
    if unmatched:
        flag = "--only-train-params-name-list" if only else "--freeze-params-name-list"
        quoted = ", ".join(f"'{p}'" for p in unmatched)
        raise ValueError(f"{flag}: {quoted} matches no parameter of this model")
