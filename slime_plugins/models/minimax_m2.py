"""`--spec slime_plugins.models.minimax_m2 get_minimax_m2_layer_spec`: MiniMax-M2's decoder.

Megatron's layers with one change: MiniMax-M2 normalises the whole query projection (all heads, 48 x 128) and the
whole key projection with one RMSNorm each, where megatron-core's `--qk-layernorm` normalises each head. Under tensor
parallelism a rank holds some heads, so the attention gathers the projections over the TP group, normalises, and keeps
its own heads again (the gradient takes the reverse path; the replicated norm weights get the same gradient on every
rank). The rest (sigmoid routing with a score-correction bias, partial RoPE) is megatron-core's own.
"""

import copy

from megatron.core.tensor_parallel import (
    gather_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import build_module

from slime.backends.megatron_utils.model_provider import default_layer_spec


class MiniMaxM2SelfAttention(SelfAttention):
    """Self-attention with `q_norm` / `k_norm` over the full query / key projections (current slime's names)."""

    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.q_layernorm = self.k_layernorm = None  # not per head: the full-width norms below instead
        width = self.hidden_size_per_attention_head
        for name, spec, heads in (
            ("q_norm", submodules.q_layernorm, config.num_attention_heads),
            ("k_norm", submodules.k_layernorm, config.num_query_groups),
        ):
            norm = build_module(spec, hidden_size=width * heads, config=config, eps=config.layernorm_epsilon)
            setattr(self, name, norm)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        if not split_qkv or output_gate:
            raise ValueError("MiniMax-M2's attention normalises split queries and keys, without an output gate")
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        query, key = (self._full_width_norm(t, norm) for t, norm in ((query, self.q_norm), (key, self.k_norm)))
        return query, key, value

    def _full_width_norm(self, x, norm):
        """`norm` over all heads of x [s, b, local heads, d] (heads in HF order: Megatron's query groups keep it)."""
        shape = x.shape
        x = x.reshape(*shape[:-2], -1)
        tp = self.tp_group.size() > 1
        if tp:
            x = gather_from_tensor_model_parallel_region(x, self.tp_group)
        x = norm(x)
        if tp:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        return x.view(shape)


def get_minimax_m2_layer_spec(args, config, vp_stage=None):
    """The default layer spec (MoE block spec, local or Transformer Engine) with MiniMax-M2's attention. TP at most
    the key/value heads (checked at start-up: `check_minimax_m2`)."""
    spec = copy.deepcopy(default_layer_spec(args, config, vp_stage))
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        layer.submodules.self_attention.module = MiniMaxM2SelfAttention
    return spec
