"""Megatron parameters as whole tensors with global names: the common input of weight sync and HF export.

`named_parameters` renames local shards to their *global* position (pipeline-stage layer offset, expert-parallel
expert offset) and always uses the `module.module.` prefix slime's converters expect, whatever wrappers (DDP,
Float16Module) the model has. `all_gather_param` rebuilds the full tensor from TP shards; `remove_padding` strips
the vocab padding Megatron adds to embedding/output rows.
"""

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

PREFIX = "module.module."
_LAYER_RE = re.compile(r"^module\.module\.decoder\.layers\.(\d+)\.(.+)$")
_MTP_LAYER_RE = re.compile(r"^(module\.module\.mtp\.layers\.\d+\.transformer_layer\.)(.+)$")
_LOCAL_EXPERT_RE = re.compile(r"^((?:.*\.)?mlp\.experts\.local_experts\.)(\d+)(\..+)$")  # SequentialMLP (local spec)
_GROUPED_EXPERT_RE = re.compile(r"^((?:.*\.)?mlp\.experts\.linear_fc[12]\.weight)(\d+)$")  # TEGroupedMLP


def canonical_name(name: str) -> str:
    """`module.module.<path>` regardless of how many wrapper levels `name` came through."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return PREFIX + name


def is_lora_param(name: str) -> bool:
    """A LoRA adapter (`--enable-lora`), which the HF base checkpoint does not hold."""
    return name.endswith(".lora_A") or name.endswith(".lora_B")


def unwrap_model(module):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def named_parameters(args, model):
    """Yield `(global_name, param)` for every parameter of every model chunk (plus MoE `expert_bias` buffers).

    `model` is the list of (virtual-pipeline) chunks Megatron returns, or a single module.
    """
    chunks = model if isinstance(model, (list, tuple)) else [model]
    ep_size = mpu.get_expert_model_parallel_world_size()
    ep_rank = mpu.get_expert_model_parallel_rank()
    num_experts = args.num_experts or 0
    experts_per_rank = num_experts // ep_size if num_experts else 0
    for vp_stage, chunk in enumerate(chunks):
        inner = unwrap_model(chunk)
        vp = vp_stage if len(chunks) > 1 else None
        layer_offset = get_transformer_layer_offset(inner.config, vp_stage=vp)
        items = list(inner.named_parameters())
        items += [(n, b) for n, b in inner.named_buffers() if "expert_bias" in n]
        for name, param in items:
            yield _globalize(canonical_name(name), layer_offset, ep_rank * experts_per_rank), param


def _globalize(name, layer_offset, expert_offset):
    if m := _MTP_LAYER_RE.match(name):  # MTP layers (last stage only) are numbered within the block
        return m.group(1) + _global_expert(m.group(2), expert_offset)
    m = _LAYER_RE.match(name)
    if not m:
        return name  # embedding, final norm, output layer
    layer_idx, rest = int(m.group(1)) + layer_offset, m.group(2)
    return f"{PREFIX}decoder.layers.{layer_idx}.{_global_expert(rest, expert_offset)}"


def _global_expert(rest, expert_offset):
    if expert_offset:
        if em := _LOCAL_EXPERT_RE.match(rest):
            rest = f"{em.group(1)}{int(em.group(2)) + expert_offset}{em.group(3)}"
        elif em := _GROUPED_EXPERT_RE.match(rest):
            rest = f"{em.group(1)}{int(em.group(2)) + expert_offset}"
    return rest


_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "parallel_mode")


def with_parallel_attrs(tensor, param):
    """`tensor` (a copy of `param`'s shard) with `param`'s tensor-parallel attributes, which tell
    `all_gather_param` how to gather it."""
    for attr in _TP_ATTRS:
        if hasattr(param, attr):
            setattr(tensor, attr, getattr(param, attr))
    return tensor


def expert_parallel_copies(args, name, param):
    """[(global_name, shard)] of `param` on every expert-parallel rank: itself when it is not a routed-expert
    parameter or EP is 1, else the same local expert of each EP rank (collective over the EP group). The shards keep
    `param`'s tensor-parallel attributes, so `all_gather_param` then gathers each over expert-TP."""
    ep = mpu.get_expert_model_parallel_world_size()
    if ep == 1 or ".experts." not in name:
        return [(name, param)]
    parts = [torch.empty_like(param.data) for _ in range(ep)]
    dist.all_gather(parts, param.data.contiguous(), group=mpu.get_expert_model_parallel_group())
    per_rank = args.num_experts // ep
    out = []
    for r, part in enumerate(parts):
        out.append((_with_expert(name, lambda e: r * per_rank + e % per_rank), with_parallel_attrs(part, param)))
    return out


def _with_expert(name, fn):
    """`name` with its expert index e replaced by fn(e) (local-spec and grouped-GEMM spellings)."""
    m = _LAYER_RE.match(name)
    rest = m.group(2)
    if em := _LOCAL_EXPERT_RE.match(rest):
        rest = f"{em.group(1)}{fn(int(em.group(2)))}{em.group(3)}"
    elif em := _GROUPED_EXPERT_RE.match(rest):
        rest = f"{em.group(1)}{fn(int(em.group(2)))}"
    return f"{PREFIX}decoder.layers.{m.group(1)}.{rest}"


def all_gather_param(name, param, *, gated_linear_unit=True):
    """The full (TP-unsharded) tensor of `param`; non-TP params come back as `param.data` (no copy).

    Gated MLPs keep `[gate_shard; up_shard]` per TP rank in `linear_fc1.weight`; gathering re-interleaves them
    into `[gate; up]` so the converters can split the full tensor in two.
    """
    if "expert_bias" in name:
        return param.data if isinstance(param, torch.nn.Parameter) else param
    if not getattr(param, "tensor_model_parallel", False) or getattr(param, "parallel_mode", None) == "duplicated":
        return param.data
    if ".experts." in name:
        tp_size, tp_group = mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_group()
    else:
        tp_size, tp_group = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_group()
    if tp_size == 1:
        return param.data
    gated_fc1 = "linear_fc1.weight" in name and gated_linear_unit
    # The local spec marks gated fc1 with stride 2 ([gate; up] per shard), which the re-interleave below handles.
    if getattr(param, "partition_stride", 1) != 1 and not gated_fc1:
        raise ValueError(f"{name}: partition_stride {param.partition_stride} is not supported for TP gathering")
    partitions = [torch.empty_like(param.data) for _ in range(tp_size)]
    dist.all_gather(partitions, param.data.contiguous(), group=tp_group)
    partition_dim = param.partition_dim
    if gated_fc1:
        halves = [p.chunk(2, dim=0) for p in partitions]
        partitions = [h[0] for h in halves] + [h[1] for h in halves]
    if "linear_fc2.weight" in name and partition_dim == 0:
        partition_dim = 1  # grouped-MoE fc2 reports partition_dim 0 but is row-parallel (slime works around it too)
    return torch.cat(partitions, dim=partition_dim)


def remove_padding(name, param, vocab_size):
    """Cut embedding / output-layer rows back to the tokenizer's `vocab_size` (Megatron pads for TP divisibility)."""
    if vocab_size and canonical_name(name) in (
        PREFIX + "embedding.word_embeddings.weight",
        PREFIX + "output_layer.weight",
    ):
        return param[:vocab_size]
    return param
