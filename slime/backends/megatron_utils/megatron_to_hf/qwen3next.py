"""Qwen3-Next: Gated DeltaNet layers (transformers' module in the attention slot, HF names kept), gated full
attention with q/k norm, and a softmax-routed MoE with one gated shared expert (Qwen2-MoE names)."""

from ._common import GPTFamily

FAMILY = GPTFamily(
    "qwen3next",
    features=("qk_norm", "gated_attention", "moe", "shared_expert"),
    hf_modules=("linear_attn",),
    mtp="mtp",
)


def convert_qwen3next_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
