"""MiMo (XiaomiMiMo/MiMo-7B): a Qwen2 decoder (qkv bias) plus multi-token-prediction layers `model.mtp_layers.*`
(the trainer's MTP block with `--mtp-num-layers`, see slime/backends/megatron_utils/mtp.py)."""

from ._common import GPTFamily

FAMILY = GPTFamily("mimo", features=("qkv_bias",), mtp="mtp_layers")


def convert_mimo_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
