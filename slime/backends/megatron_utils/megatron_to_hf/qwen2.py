"""Qwen2 / Qwen2.5 (qkv bias) and Qwen3 (q/k RMSNorm) dense models: one converter, as in slime."""

from ._common import GPTFamily

FAMILY = GPTFamily("qwen2", features=("qkv_bias", "qk_norm"))


def convert_qwen2_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
