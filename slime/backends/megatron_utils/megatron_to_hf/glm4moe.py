"""GLM-4.5 MoE (GLM-4.5, GLM-4.5-Air): first-k dense layers, sigmoid router with `e_score_correction_bias`, routed
experts plus plural `shared_experts`, optional q/k norm and qkv bias; MTP layers at `model.layers.{num_hidden_layers + i}`
(`--mtp-num-layers`)."""

from ._common import GPTFamily

FAMILY = GPTFamily("glm4moe", features=("qkv_bias", "qk_norm", "moe", "expert_bias", "shared_experts"), mtp="layers")


def convert_glm4moe_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
