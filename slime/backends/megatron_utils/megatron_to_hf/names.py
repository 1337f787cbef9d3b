"""The Megatron parameter names a model of `--hf-checkpoint` may have, without building it: for start-up checks of
name patterns (`--freeze-params-name-list`, `--only-train-params-name-list`).

A superset of the real names, over both layer specs (local and Transformer Engine), every family's optional modules
and both expert layouts, with global layer numbers from the model flags; the HF checkpoint's own layer tensors add
the names of transformers modules wrapped in the attention slot (`self_attention.<HF layer-relative name>`). A
pattern that matches none of them matches no parameter of the model; one that matches only a name this model lacks
is still refused when the model is built (`model_provider.freeze_model_params`).
"""

import re

from ._common import _COPY_RULES, _MTP_NAMES

_TOP_LEVEL = (
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)
_LAYER_SUFFIXES = (
    "input_layernorm.bias",
    "pre_mlp_layernorm.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_proj.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc2.bias",
    "mlp.router.bias",
    "mlp.shared_experts.linear_fc1.weight",
)
_HF_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")


def _hf_names(hf_dir):
    from .hf_to_megatron import SafetensorsReader

    return list(SafetensorsReader(hf_dir).key_to_file)


def possible_param_names(args, hf_names=None):
    """Sorted superset of this model's global Megatron parameter names (without the DDP `module.` prefixes);
    `hf_names`: the HF checkpoint's tensor names (default: read from `args.hf_checkpoint`'s index or headers)."""
    if hf_names is None:
        hf_names = _hf_names(args.hf_checkpoint)
    layer = {k for rules in _COPY_RULES.values() for k in rules} | set(_LAYER_SUFFIXES)
    for name in hf_names:  # wrapped transformers modules keep their HF names under self_attention.
        if m := _HF_LAYER_RE.search(name):
            layer.add(f"self_attention.{m.group(2)}")
    for e in range(getattr(args, "num_experts", None) or 0):
        for fc in ("linear_fc1", "linear_fc2"):
            layer |= {f"mlp.experts.local_experts.{e}.{fc}.weight", f"mlp.experts.{fc}.weight{e}"}
    # a vision tower keeps its HF names (`visual.*`, or `model.visual.*` as Qwen3-VL's checkpoints name it)
    names = set(_TOP_LEVEL) | {
        n.removeprefix("model.") for n in hf_names if n.startswith(("visual.", "model.visual."))
    }
    for i in range(args.num_layers or 0):
        names |= {f"decoder.layers.{i}.{s}" for s in layer}
    for i in range(getattr(args, "mtp_num_layers", None) or 0):
        names |= {f"mtp.layers.{i}.{s}" for rules in _MTP_NAMES.values() for s in rules}
        names |= {f"mtp.layers.{i}.transformer_layer.{s}" for s in layer}
    return sorted(names)
