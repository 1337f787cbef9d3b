"""Qwen3.5 (dense or MoE) with its vision tower, trained on images: the hybrid decoder (qwen3_5.py's layer spec),
transformers' vision tower on the first pipeline stage and interleaved MRoPE (`Qwen3_5VLModel`, qwen3_vl.py).

`--spec slime_plugins.models.qwen3_5_vl get_qwen3_5_vl_model_provider`, current slime's path (its `-vl` model
scripts name it); what `--hf-checkpoint` implies with `--multimodal-keys`.
"""

from .qwen2_5_vl import vlm_model_provider
from .qwen3_5 import get_qwen3_5_spec
from .qwen3_vl import Qwen3_5VLModel


def get_qwen3_5_vl_model_provider(args, config, vp_stage=None):
    return vlm_model_provider(Qwen3_5VLModel, args, config, get_qwen3_5_spec)
