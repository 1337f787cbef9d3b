"""Qwen3.5 dense: the Qwen3-Next hybrid (Gated DeltaNet layers wrapped from transformers, gated full attention)
with a dense MLP. Text-only checkpoints (`Qwen3_5ForCausalLM`) keep the decoder under `model.`; the published
vision-language ones (`Qwen3_5ForConditionalGeneration`) under `model.language_model.` (the vision tower is not
trained: the inference engine keeps the checkpoint's)."""

from ._common import GPTFamily

_FEATURES = ("qk_norm", "gated_attention")
FAMILY = GPTFamily("qwen3_5", features=_FEATURES, hf_modules=("linear_attn",), prefix="model.language_model.")
TEXT_FAMILY = GPTFamily("qwen3_5_text", features=_FEATURES, hf_modules=("linear_attn",))


def convert_qwen3_5_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
