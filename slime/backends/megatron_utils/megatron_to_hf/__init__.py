"""Megatron <-> HF weight conversion, dispatched by `--model-name` substring (slime's order and names).

`convert_to_hf(args, model_name, name, param)` takes a *full* (TP-gathered, padding-removed) Megatron tensor with
its global name and returns `[(hf_name, tensor)]`. `hf_to_megatron(args, model)` is the reverse: it fills a
(possibly TP/PP/EP-sharded) Megatron model from an HF safetensors checkpoint, so `--hf-checkpoint` alone can
initialise training. Each family module keeps slime's `convert_<family>_to_hf(args, name, param)` for users who build
their own converters on it.
"""

from . import (
    deepseekv3,
    glm4,
    glm4moe,
    llama,
    mimo,
    minimax_m2,
    qwen2,
    qwen2_5_vl,
    qwen2moe,
    qwen3_5,
    qwen3_vl,
    qwen3moe,
    qwen3next,
)
from .hf_to_megatron import hf_to_megatron

# Checked in this order on the lowercased name without "_"/"-": "qwen3moe" must win over "qwen3", "glm4moe" over "glm4",
# "qwen3next" / "qwen35..." over "qwen3", "qwen35text" (text-only checkpoint) over "qwen35" (vision-language one),
# "qwen35moe..." over "qwen35", "qwen25vl" and "qwen2moe" over "qwen2", "qwen3vlmoe" over "qwen3vl" over "qwen3".
_FAMILIES = [
    (("qwen3next",), qwen3next.FAMILY),
    (("qwen35moetext",), qwen3_5.MOE_TEXT_FAMILY),
    (("qwen35moe",), qwen3_5.MOE_FAMILY),
    (("qwen35text",), qwen3_5.TEXT_FAMILY),
    (("qwen35",), qwen3_5.FAMILY),
    (("glm4moe",), glm4moe.FAMILY),
    (("glm4",), glm4.FAMILY),
    (("qwen3moe",), qwen3moe.FAMILY),
    (("qwen25vl",), qwen2_5_vl.FAMILY),
    (("qwen2moe",), qwen2moe.FAMILY),
    (("qwen3vlmoe",), qwen3_vl.MOE_FAMILY),
    (("qwen3vl",), qwen3_vl.FAMILY),
    (("qwen2", "qwen3"), qwen2.FAMILY),
    (("deepseekv3",), deepseekv3.FAMILY),
    (("llama",), llama.FAMILY),
    (("mimo",), mimo.FAMILY),
    (("minimaxm2",), minimax_m2.FAMILY),
]


def get_family(model_name):
    key = (model_name or "").lower().replace("_", "").replace("-", "")
    for substrings, family in _FAMILIES:
        if any(s in key for s in substrings):
            return family
    supported = ", ".join(s for subs, _ in _FAMILIES for s in subs)
    raise ValueError(
        f"--model-name {model_name!r}: no Megatron->HF converter matches it (supported substrings: {supported}). "
        "Set --model-name to one of them, or to the lowercased HF config class name (e.g. qwen3config)."
    )


def resolve_model_name(args, model_name=None):
    """`model_name`, else `args.model_name`, else the lowercased HF config class of `args.hf_checkpoint`."""
    name = model_name or args.model_name
    if name:
        return name
    hf_dir = args.hf_checkpoint
    if not hf_dir:
        raise ValueError("Cannot pick a weight converter: set --model-name (e.g. qwen3) or --hf-checkpoint.")
    from transformers import AutoConfig  # heavy

    return type(AutoConfig.from_pretrained(hf_dir, trust_remote_code=True)).__name__.lower()


def convert_to_hf(args, model_name, name, param, quantization_config=None):
    """`[(hf_name, tensor)]` of one full Megatron tensor; with the engine checkpoint's `quantization_config`, quantised
    by slime.utils.quantization exactly as tools/convert_hf_to_fp8.py / convert_hf_to_int4_direct.py write it
    (the tensors SGLang's parameters expect: it never quantises what it receives)."""
    scheme = _scheme(quantization_config) if quantization_config else None
    converted = get_family(model_name).to_hf(args, name, param)
    if converted is None:
        raise ValueError(
            f"Megatron parameter {name!r} has no HF counterpart in the {get_family(model_name).name} converter "
            f"(model name {model_name!r}); the model has a layer this family does not know."
        )
    if scheme is not None:
        from slime.utils.quantization import quantize_named_tensors

        converted = list(quantize_named_tensors(converted, scheme))
    return converted


_SCHEMES = {}


def _scheme(quantization_config):
    """The parsed config, once per distinct config. Per-tensor and per-channel FP8 cannot be updated online in
    SGLang (it folds and transposes them after loading), so a sync into them is refused."""
    import json

    from slime.utils.quantization import QuantScheme

    key = json.dumps(quantization_config, sort_keys=True)
    if key not in _SCHEMES:
        scheme = QuantScheme(quantization_config, "--hf-checkpoint quantization_config")
        if scheme.kind in ("fp8_tensor", "fp8_channel"):
            raise ValueError(
                f"--hf-checkpoint quantization_config is {scheme.kind}: SGLang cannot take weight updates into it; "
                "use a blockwise FP8 checkpoint (tools/convert_hf_to_fp8.py --strategy block)"
            )
        _SCHEMES[key] = scheme
    return _SCHEMES[key]


__all__ = ["convert_to_hf", "hf_to_megatron", "get_family", "resolve_model_name"]
