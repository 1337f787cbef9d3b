"""MiMo (XiaomiMiMo/MiMo-7B): a Qwen2 decoder (qkv bias) plus multi-token-prediction layers `model.mtp_layers.*`.

The trainer builds no MTP block: MiMo's MTP layers are not trained. They stay in the HF checkpoint, the inference
server loads them from there, and weight updates leave them untouched (see docs/models.md).
"""

from ._common import GPTFamily

FAMILY = GPTFamily("mimo", features=("qkv_bias",))


def convert_mimo_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
