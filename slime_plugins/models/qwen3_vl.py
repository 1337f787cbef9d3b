"""Qwen3-VL, and Qwen3.5 with its vision tower, in the trainer: Qwen2.5-VL's design (qwen2_5_vl.py: megatron-core's
`GPTModel`, or Qwen3.5's hybrid layers, with transformers' vision tower on the first pipeline stage) plus what they
change:

- **Interleaved MRoPE**: the rotary frequencies go to (temporal, height, width) in turn, `t h w t h w ... t t`
  (`mrope_section` counts each axis's share), not in three contiguous runs as Qwen2-VL's and megatron-core's.
- **DeepStack** (Qwen3-VL): the tower also returns features from some of its middle layers (`deepstack_visual_indexes`);
  the i-th is added at the image tokens to the output of decoder layer i. Those decoder layers must sit on the first
  pipeline stage, next to the tower.
- Qwen3-VL's language model is Qwen3's (per-head q/k RMSNorm, no qkv bias). Both families' checkpoints name it
  `model.language_model.*` and the tower `model.visual.*` (the trainer's `visual.*`).
"""

import torch

from .qwen2_5_vl import Qwen2_5VLModel, RankLocalMultimodalRotaryEmbedding, at_image_tokens, vlm_model_provider


class InterleavedMultimodalRotaryEmbedding(RankLocalMultimodalRotaryEmbedding):
    """megatron-core's multimodal RoPE with transformers' Qwen3-VL frequency layout (`recomposition_frequencies`):
    frequency j follows axis j % 3 while that axis has frequencies left (`mrope_section`), the temporal axis after.
    Like its parent, it takes each CP rank's own positions."""

    def forward(self, position_ids, mrope_section, cp_group=None):
        seq = position_ids.to(device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = seq[..., None].float() * self.inv_freq  # [3, b, s, dim/2]
        picked = freqs[0].clone()
        for axis in (1, 2):
            taken = slice(axis, mrope_section[axis] * 3, 3)
            picked[..., taken] = freqs[axis, ..., taken]
        emb = torch.cat((picked, picked), dim=-1)  # rotate-half layout, as megatron-core applies it
        return emb[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, dim]


def deepstack_layout_problem(levels, first_stage_layers):
    """Why the first pipeline stage (global 0-based `first_stage_layers`, with the vision tower) cannot add `levels`
    DeepStack features, or None."""
    missing = sorted(set(range(levels)) - set(first_stage_layers))
    if not missing:
        return None
    return (
        f"Qwen3-VL adds DeepStack vision features to the outputs of decoder layers 0..{levels - 1}, which must be on "
        f"the first pipeline stage with the vision tower, but layer {missing[0]} is not: put at least {levels} layers "
        "there (--decoder-first-pipeline-num-layers)"
    )


class Qwen3_5VLModel(Qwen2_5VLModel):
    """Qwen3.5 with its vision tower: interleaved MRoPE over the hybrid decoder's rotary share, no DeepStack."""

    video_run_per_frame = True

    @staticmethod
    def hf_classes(hf_config):
        if hf_config.model_type == "qwen3_5_moe":
            from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m  # heavy

            return m.Qwen3_5MoeModel, m.Qwen3_5MoeVisionModel
        from transformers.models.qwen3_5 import modeling_qwen3_5 as m  # heavy

        return m.Qwen3_5Model, m.Qwen3_5VisionModel

    def __init__(self, hf_config, **kwargs):
        super().__init__(hf_config, **kwargs)
        if not hf_config.text_config.rope_parameters.get("mrope_interleaved", True):
            raise ValueError(
                f"{type(self).__name__}: rope_parameters.mrope_interleaved=false is not this model's RoPE"
            )
        # same frequencies (inv_freq) as megatron-core's, laid out as Qwen3-VL's and Qwen3.5's
        self.rotary_pos_emb.__class__ = InterleavedMultimodalRotaryEmbedding


class Qwen3VLModel(Qwen3_5VLModel):
    """Qwen3-VL (dense or MoE) with DeepStack."""

    @staticmethod
    def hf_classes(hf_config):
        if hf_config.model_type == "qwen3_vl_moe":
            from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe as m  # heavy

            return m.Qwen3VLMoeModel, m.Qwen3VLMoeVisionModel
        from transformers.models.qwen3_vl import modeling_qwen3_vl as m  # heavy

        return m.Qwen3VLModel, m.Qwen3VLVisionModel

    def __init__(self, hf_config, **kwargs):
        super().__init__(hf_config, **kwargs)
        self._deepstack = None
        levels = min(len(hf_config.vision_config.deepstack_visual_indexes), self.config.num_layers)
        problem = deepstack_layout_problem(levels, [layer.layer_number - 1 for layer in self.decoder.layers])
        if problem and self.pre_process:
            raise ValueError(problem)
        for layer in self.decoder.layers:
            if layer.layer_number - 1 < levels:
                layer.register_forward_hook(self._add_deepstack(layer.layer_number - 1))

    def forward(self, *args, **kwargs):
        self._deepstack = None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._deepstack = None

    def _with_vision(self, embeddings, parts, local=None):
        # each level dense over the sequence (images' and videos' features at their own tokens), held as the hidden
        # states are: this CP rank's positions, scattered under --sequence-parallel
        levels = []
        for level in range(len(parts[0][1].deepstack_features)):
            dense = torch.zeros_like(embeddings)
            for mask, vision in parts:
                dense = at_image_tokens(dense, mask, vision.deepstack_features[level])
            levels.append(self._to_rank(dense, local))
        self._deepstack = levels
        return super()._with_vision(embeddings, parts, local)

    def _add_deepstack(self, index):
        def hook(_layer, _inputs, output):
            if self._deepstack is None:  # a text-only micro-batch
                return output
            hidden, context = output
            return hidden + self._deepstack[index].to(hidden.dtype), context

        return hook


def get_qwen3_vl_model_provider(args, config, vp_stage=None):
    """Current slime's `--spec` protocol: a model provider for `--hf-checkpoint`'s Qwen3-VL."""
    return vlm_model_provider(Qwen3VLModel, args, config)
