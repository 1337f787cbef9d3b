"""Qwen3-VL: the Qwen3 decoder (q/k norm) under the checkpoint's `model.language_model.` names, and the vision tower,
`visual.*` in the trainer (slime_plugins/models/qwen3_vl.py), under `model.visual.*`: copied as they are, with no TP
gather (every rank holds the whole tower). These are transformers' own names, which SGLang's Qwen3-VL loader takes."""

from .qwen2_5_vl import VisionLanguageFamily

FAMILY = VisionLanguageFamily(
    "qwen3_vl", vision_prefix="model.visual.", features=("qk_norm",), prefix="model.language_model."
)


def convert_qwen3_vl_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
