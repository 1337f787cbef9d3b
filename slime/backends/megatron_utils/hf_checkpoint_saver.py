"""`--save-hf`: the trained model as an HF safetensors checkpoint, written at each checkpoint save (under
--enable-lora: the merged model, plus the adapters in PEFT's format in its `adapter/` subdirectory).

The tensors are the ones weight sync sends the engines (the same Megatron->HF converters, TP shards gathered, experts
of every expert-parallel rank); each pipeline stage's source rank writes its stage, and rank 0 publishes the directory
with an index and the non-weight files of `--hf-checkpoint` (config, tokenizer), so transformers loads it as is.
"""

import os
import shutil

import torch.distributed as dist
from megatron.core import parallel_state as mpu
from safetensors.torch import save_file

from slime.backends.megatron_utils.initialize import get_gloo_group
from slime.backends.megatron_utils.lora import export_peft
from slime.backends.megatron_utils.megatron_to_hf import get_family
from slime.backends.megatron_utils.megatron_to_hf._common import CheckpointLayout
from slime.backends.megatron_utils.param_utils import named_parameters
from slime.backends.megatron_utils.update_weight.update_weight_from_disk import gather_stage, is_pp_src_rank
from slime.utils import disk_delta


def save_hf_path(args, rollout_id) -> str:
    """Where checkpoint `rollout_id` goes: `--save-hf` with `{rollout_id}` filled in (as current slime formats it)."""
    return args.save_hf.format(rollout_id=rollout_id)


def save_hf_model_to_path(args, output_dir, model, *, model_name, vocab_size, quantization_config=None) -> None:
    """Write `model` as an HF checkpoint in `output_dir` (replacing one there). Collective: every trainer rank calls
    it. The directory appears whole, in one rename, once every stage is written."""
    group = get_gloo_group()
    final = os.path.abspath(str(output_dir))
    partial = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.partial")
    if dist.get_rank() == 0:  # a save killed half-way left this behind: start afresh
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    dist.barrier(group=group)
    tensors = gather_stage(args, named_parameters(args, model), model_name, vocab_size, quantization_config)
    layout = CheckpointLayout(get_family(model_name), args.num_experts)  # e.g. Qwen3-VL-MoE's stacked experts
    tensors = {n: t for name, tensor in tensors.items() for n, t in layout.add(name, tensor)}
    layout.close()
    weight_map = {}
    if is_pp_src_rank():
        fname = f"pp{mpu.get_pipeline_model_parallel_rank():03d}.safetensors"
        save_file(tensors, os.path.join(partial, fname), metadata={"format": "pt"})
        weight_map = dict.fromkeys(tensors, fname)
    maps = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(maps, weight_map, group=group)
    if dist.get_rank() == 0:
        merged = {n: f for m in maps for n, f in m.items()}
        disk_delta.publish(partial, final, merged, {"format": "pt"}, args.hf_checkpoint, checksums=False)
    dist.barrier(group=group)
    if args.enable_lora:  # next to the merged model, the adapters alone as peft / SGLang's --lora-paths load them
        export_peft(args, model, os.path.join(final, "adapter"), model_name)
