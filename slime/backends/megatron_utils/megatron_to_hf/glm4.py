"""GLM-4 dense (GLM-4-9B-0414, GLM-Z1): qkv bias, HF's fused `mlp.gate_up_proj`, and post-attention / post-MLP
("sandwich") norms at layer level."""

from ._common import GPTFamily

FAMILY = GPTFamily("glm4", features=("qkv_bias", "post_norms", "fused_gate_up"))


def convert_glm4_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
