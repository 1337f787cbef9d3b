"""Qwen3.5 (dense and MoE): the Qwen3-Next hybrid (see qwen3_next.py) with separate Gated DeltaNet input projections
(`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, q/k/v in a flat `[q_all, k_all, v_all]` layout).

Layer spec: `--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec` (what config.json implies by itself); with
`--multimodal-keys` and a vision-language checkpoint, qwen3_5_vl.py's `get_qwen3_5_vl_model_provider`.
"""

from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from .qwen3_next import GatedDeltaNetAttention, hybrid_layer_spec


class Qwen3_5GatedDeltaNetAttention(GatedDeltaNetAttention):
    hf_class = Qwen3_5GatedDeltaNet

    def project(self, hidden_states):
        m = self.linear_attn
        B, T, _ = hidden_states.shape
        q, k, v = m.in_proj_qkv(hidden_states).split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = q.reshape(B, T, m.num_k_heads, m.head_k_dim)
        k = k.reshape(B, T, m.num_k_heads, m.head_k_dim)
        v = v.reshape(B, T, m.num_v_heads, m.head_v_dim)
        z = m.in_proj_z(hidden_states).reshape(B, T, m.num_v_heads, m.head_v_dim)
        return q, k, v, z, m.in_proj_b(hidden_states), m.in_proj_a(hidden_states)


def get_qwen3_5_spec(args, config, vp_stage=None):
    return hybrid_layer_spec(args, config, vp_stage, Qwen3_5GatedDeltaNetAttention, "Qwen3.5")
