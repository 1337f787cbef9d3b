"""Qwen3-VL: the Qwen3 decoder (q/k norm) under the checkpoint's `model.language_model.` names, and the vision tower,
`visual.*` in the trainer (slime_plugins/models/qwen3_vl.py), under `model.visual.*`: copied as they are, with no TP
gather (every rank holds the whole tower). These are transformers' own names, which SGLang's Qwen3-VL loader takes.
Qwen3-VL-MoE: the Qwen3-MoE decoder (routed experts, no shared one), its experts stacked in its checkpoints as
`mlp.experts.gate_up_proj` [E, H, 2I] and `mlp.experts.down_proj` [E, I, H]."""

from .qwen2_5_vl import VisionLanguageFamily

_VL = dict(vision_prefix="model.visual.", prefix="model.language_model.")
FAMILY = VisionLanguageFamily("qwen3_vl", features=("qk_norm",), **_VL)
MOE_FAMILY = VisionLanguageFamily("qwen3_vl_moe", features=("qk_norm", "moe"), stacked_experts="transposed", **_VL)


def convert_qwen3_vl_to_hf(args, name, param):
    return (MOE_FAMILY if args.num_experts else FAMILY).to_hf(args, name, param)
