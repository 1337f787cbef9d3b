"""Qwen3-Next: Gated DeltaNet (linear attention) layers interleaved with gated full attention.

Full-attention layers are Megatron's own (output gate `--attention-output-gate`, zero-centred norms
`--apply-layernorm-1p`, partial RoPE, q/k norm); the MLP is Megatron's MoE with a gated shared expert
(`--moe-shared-expert-gate`). Gated DeltaNet layers hold transformers' `Qwen3NextGatedDeltaNet` in the attention slot
(`hf_attention.HuggingfaceAttention`), run over all packed samples at once: a depthwise causal convolution that
never reaches across a sample boundary, then the chunked gated delta rule of `--qwen-gdn-backend` with the state
reset at every boundary (`qwen_gdn_backend.py`).

Context parallelism: the full-attention layers split each sample in slime's zigzag chunks like any model
(Transformer Engine's CP attention on GPU, `cp_attention.AllGatherKVDotProductAttention` on the local spec; RoPE,
partial rotary included, in global positions); the Gated DeltaNet layers gather the CP group's chunks and run over
whole samples (`hf_attention`'s docstring says why).

Layer spec: `--spec slime_plugins.models.qwen3_next get_qwen3_next_spec` (what config.json implies by itself).
"""

import copy

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_gpt_decoder_block_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from transformers.activations import ACT2FN
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from slime.backends.megatron_utils.local_layers import ZeroCenteredRMSNorm, with_zero_centered_norms
from slime.backends.megatron_utils.model_provider import use_transformer_engine, with_cp_attention

from .hf_attention import HuggingfaceAttention, load_hf_text_config
from .qwen_gdn_backend import get_chunk_gated_delta_rule, varlen_causal_conv1d


class GatedDeltaNetAttention(HuggingfaceAttention):
    """A transformers Gated DeltaNet module (`hf_class`, held as `linear_attn` like in the HF decoder layer) run on
    packed samples; subclasses say how its input projections split into q, k, v, z, b, a (`project`)."""

    hf_class = None

    def __init__(self, args, config, layer_number, **kwargs):
        super().__init__(args, config, layer_number, **kwargs)
        self.linear_attn = self.hf_class(self.hf_config, self.hf_layer_idx)
        self.gated_delta_rule = get_chunk_gated_delta_rule(args.qwen_gdn_backend)

    def project(self, hidden_states):
        """`[1, T, h]` -> q, k, v, z `[1, T, heads, dim]` and b, a `[1, T, HV]`, in the HF module's layout."""
        raise NotImplementedError

    def hf_forward(self, hidden_states, cu_seqlens):
        m = self.linear_attn
        q, k, v, z, b, a = self.project(hidden_states)
        T = hidden_states.shape[1]
        mixed = torch_cat_flat(q, k, v)
        mixed = varlen_causal_conv1d(mixed, m.conv1d.weight.squeeze(1), cu_seqlens, activation=ACT2FN[m.activation])
        q, k, v = mixed.split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = q.reshape(1, T, m.num_k_heads, m.head_k_dim)
        k = k.reshape(1, T, m.num_k_heads, m.head_k_dim)
        v = v.reshape(1, T, m.num_v_heads, m.head_v_dim)
        beta = b.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)  # fp32: A may underflow in half precision
        out = self.gated_delta_rule(q, k, v, g, beta, cu_seqlens)
        out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(1, T, -1)
        return m.out_proj(out)


def torch_cat_flat(q, k, v):
    """q, k, v `[1, T, heads, dim]` -> `[T, q|k|v]`, the channel order of the HF conv1d."""
    return torch.cat([x.reshape(x.shape[1], -1) for x in (q, k, v)], dim=-1)


class Qwen3NextGatedDeltaNetAttention(GatedDeltaNetAttention):
    hf_class = Qwen3NextGatedDeltaNet

    def project(self, hidden_states):
        m = self.linear_attn
        return m.fix_query_key_value_ordering(m.in_proj_qkvz(hidden_states), m.in_proj_ba(hidden_states))


def hybrid_layer_spec(args, config, vp_stage, linear_attention_cls, what):
    """Megatron's decoder block spec with each `linear_attention` layer of config.json's `layer_types` given
    `linear_attention_cls` in its attention slot (and its own input norm: the TE spec fuses that norm into the
    attention's first linear, which the wrapped module does not have)."""
    te = use_transformer_engine(args)
    spec = get_gpt_decoder_block_spec(
        config, use_transformer_engine=te, normalization=config.normalization, vp_stage=vp_stage
    )
    if config.context_parallel_size > 1 and not te:  # full attention: slime's zigzag CP attention, as for any model
        spec = with_cp_attention(spec)
    if te:
        from megatron.core.extensions.transformer_engine import TENorm as norm  # lazy: GPU-only package
    else:
        norm = ZeroCenteredRMSNorm if config.layernorm_zero_centered_gamma else LNImpl
        if config.layernorm_zero_centered_gamma:
            spec = with_zero_centered_norms(spec)
    spec = copy.copy(spec)
    spec.layer_specs = list(spec.layer_specs)
    # Checkpoints: the layers differ (only the linear ones hold `linear_attn.*`, only the full ones `linear_qkv`),
    # so each layer's tensors get keys of their own, `decoder.layers.<global layer>.<name>`, as megatron-core gives
    # its own linear-attention hybrids (`linear_attention_freq`) and MoE models with dense layers; stacked
    # `decoder.layers.<name>` keys [num_layers, ...] would declare every tensor in every layer.
    config.hetereogenous_dist_checkpoint = True  # sic: megatron-core's spelling
    layer_types = hybrid_layer_types(load_hf_text_config(args.hf_checkpoint))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    # their MTP layers (`mtp.layers.{i}` in HF) are full attention with the decoder's last MLP (`mtp.mtp_block_spec`)
    spec.mtp_layer_spec = spec.layer_specs[-1] if spec.layer_specs else None
    for i, layer in enumerate(spec.layer_specs):
        if layer_types[offset + i] == "linear_attention":
            layer = copy.deepcopy(layer)
            layer.submodules.self_attention = ModuleSpec(module=linear_attention_cls, params={"args": args})
            layer.submodules.input_layernorm = norm
            spec.layer_specs[i] = layer
    return spec


def hybrid_layer_types(hf_config):
    """config.json's per-layer `layer_types` (older configs: every `full_attention_interval`-th layer is full)."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        interval = getattr(hf_config, "full_attention_interval", 4)
        types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(hf_config.num_hidden_layers)
        ]
    return list(types)


def get_qwen3_next_spec(args, config, vp_stage=None):
    return hybrid_layer_spec(args, config, vp_stage, Qwen3NextGatedDeltaNetAttention, "Qwen3-Next")
