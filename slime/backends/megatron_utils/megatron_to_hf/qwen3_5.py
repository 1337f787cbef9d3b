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
_VL_PREFIX = "model.language_model."
# the vision-language checkpoints: their tower (`model.visual.*`) is trained with --multimodal-keys
FAMILY = VisionLanguageFamily(
    "qwen3_5",
    vision_prefix="model.visual.",
    features=_FEATURES,
    hf_modules=("linear_attn",),
    prefix=_VL_PREFIX,
    mtp="mtp",
)
TEXT_FAMILY = GPTFamily("qwen3_5_text", features=_FEATURES, hf_modules=("linear_attn",), mtp="mtp")
MOE_FAMILY = VisionLanguageFamily(
    "qwen3_5_moe",
    vision_prefix="model.visual.",
    features=_MOE_FEATURES,
    hf_modules=("linear_attn",),
    prefix=_VL_PREFIX,
    mtp="mtp",
    stacked_experts=True,
)
MOE_TEXT_FAMILY = GPTFamily(
    "qwen3_5_moe_text", features=_MOE_FEATURES, hf_modules=("linear_attn",), mtp="mtp", stacked_experts=True
)


def convert_qwen3_5_to_hf(args, name, param):
    return (MOE_FAMILY if args.num_experts else FAMILY).to_hf(args, name, param)
