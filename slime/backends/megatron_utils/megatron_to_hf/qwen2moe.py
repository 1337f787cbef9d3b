"""Qwen1.5-MoE / Qwen2-MoE: Qwen2 attention (qkv bias) + a softmax router `mlp.gate`, per-expert projections and one
shared expert gated by `mlp.shared_expert_gate` (the names Qwen3-Next kept)."""

from ._common import GPTFamily

FAMILY = GPTFamily("qwen2moe", features=("qkv_bias", "moe", "shared_expert"))


def convert_qwen2moe_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
