"""Llama 2/3 dense models: no qkv bias, no q/k norm (such parameters are rejected, not silently dropped)."""

from ._common import GPTFamily

FAMILY = GPTFamily("llama")


def convert_llama_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
