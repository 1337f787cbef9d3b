"""Qwen3.5: the Qwen3-Next hybrid (Gated DeltaNet layers wrapped from transformers, gated full attention) with a
dense MLP, or (Qwen3.5-MoE) Qwen3-Next's softmax top-k experts and gated shared expert in every layer. Text-only
checkpoints (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`) keep the decoder under `model.`; the published
vision-language ones (`Qwen3_5(Moe)ForConditionalGeneration`) under `model.language_model.` (their vision tower,
`model.visual.*`, is trained only with --multimodal-keys; otherwise the inference engine keeps the checkpoint's).
Qwen3.5-MoE experts are exported one tensor per expert (what transformers saves, Qwen3-Next's names); the published
checkpoints stack them (`mlp.experts.gate_up_proj` / `mlp.experts.down_proj`), which loading also reads (see
`GPTFamily`). MTP layers (`mtp_num_hidden_layers`) sit outside the decoder's prefix, as in Qwen3-Next: `mtp.fc`,
`mtp.pre_fc_norm_{embedding,hidden}`, `mtp.norm` and a full-attention decoder layer `mtp.layers.{i}.`."""

from ._common import GPTFamily
from .qwen2_5_vl import VisionLanguageFamily

_FEATURES = ("qk_norm", "gated_attention")
_MOE_FEATURES = (*_FEATURES, "moe", "shared_expert")
_HYBRID = dict(hf_modules=("linear_attn",), mtp="mtp")
# the vision-language checkpoints: the decoder under `model.language_model.`, the tower (`model.visual.*`, trained
# with --multimodal-keys) beside it
_VL = dict(_HYBRID, prefix="model.language_model.", vision_prefix="model.visual.")
FAMILY = VisionLanguageFamily("qwen3_5", features=_FEATURES, **_VL)
TEXT_FAMILY = GPTFamily("qwen3_5_text", features=_FEATURES, **_HYBRID)
MOE_FAMILY = VisionLanguageFamily("qwen3_5_moe", features=_MOE_FEATURES, stacked_experts=True, **_VL)
MOE_TEXT_FAMILY = GPTFamily("qwen3_5_moe_text", features=_MOE_FEATURES, stacked_experts=True, **_HYBRID)


def convert_qwen3_5_to_hf(args, name, param):
    return (MOE_FAMILY if args.num_experts else FAMILY).to_hf(args, name, param)
