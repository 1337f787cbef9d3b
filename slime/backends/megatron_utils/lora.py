"""LoRA on the Megatron model: low-rank adapters on chosen linear layers of a frozen base (`--enable-lora`).

Each targeted layer keeps its base weight `W` (frozen, no gradient buffer, no optimizer state) and gains two
parameters, `lora_A` [rank, in] and `lora_B` [out, rank]; its output becomes `W x + (alpha / rank) * B A dropout(x)`,
as in peft. Under tensor parallelism the adapters are split like their base layer, so that TP=N computes what TP=1
does:
- column-parallel layers (`linear_qkv`, `linear_fc1`): `A` whole on every TP rank, `B` split by output rows like
  `W` (a gated fc1 keeps `[gate_shard; up_shard]` rows per rank, as its weight does);
- row-parallel layers (`linear_proj`, `linear_fc2`): `A` split by input columns like `W`, `B` whole on every rank;
  the partial `A x` is summed over the TP group before `B`.

A merged weight is computed shard by shard without communication: `W_shard + s * B_shard @ A` (column) or
`W_shard + s * B @ A_shard` (row).
"""

import functools
import logging
import math
import os
import re
import zlib

import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from slime.utils.device import get_device
from slime.utils.lora_utils import TARGETS, resolve_target_modules

from .megatron_to_hf import convert_to_hf, resolve_model_name
from .param_utils import (
    PREFIX,
    all_gather_param,
    canonical_name,
    is_lora_param,
    named_parameters,
    with_parallel_attrs,
)

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def layer_dims(args) -> dict:
    """(in_features, out_features) of each target, unsharded, from the model flags."""
    heads = args.num_attention_heads
    groups = (args.num_query_groups if args.group_query_attention else None) or heads
    head_dim = args.kv_channels or args.hidden_size // heads
    ffn = args.ffn_hidden_size
    return {
        "self_attention.linear_qkv": (args.hidden_size, (heads + 2 * groups) * head_dim),
        "self_attention.linear_proj": (heads * head_dim, args.hidden_size),
        "mlp.linear_fc1": (args.hidden_size, ffn * (2 if args.swiglu else 1)),
        "mlp.linear_fc2": (ffn, args.hidden_size),
    }


def scale(args) -> float:
    return args.lora_alpha / args.lora_rank


def adapter_names(weight_name: str):
    """(A name, B name) of the base weight `...<module>.weight`."""
    module = weight_name[: -len(".weight")]
    return module + ".lora_A", module + ".lora_B"


# ---- building ---------------------------------------------------------------------------------------------------


def apply_lora(args, chunk, vp_stage=None):
    """Add adapters to the targeted layers of one model chunk (a GPTModel, before any wrapper) and freeze
    everything else. Returns the global names of the wrapped layers."""
    targets = resolve_target_modules(args.lora_target_modules)
    offset = get_transformer_layer_offset(chunk.config, vp_stage=vp_stage)
    wrapped = []
    for name, module in list(chunk.named_modules()):
        m = _LAYER_RE.match(name)
        if not m or m.group(2) not in targets:
            continue
        if type(module) not in (ColumnParallelLinear, RowParallelLinear):
            raise ValueError(
                f"--enable-lora: layer {name} is a {type(module).__name__}; LoRA supports megatron-core's "
                "ColumnParallelLinear / RowParallelLinear (the local spec: --transformer-impl local)"
            )
        global_name = f"decoder.layers.{int(m.group(1)) + offset}.{m.group(2)}"
        _add_adapter(args, module, TARGETS[m.group(2)], global_name)
        wrapped.append(global_name)
    for pname, param in chunk.named_parameters():
        param.requires_grad = is_lora_param(pname)
    return wrapped


def check_wrapped(args, chunks, wrapped):
    """Each target module must match a layer of this rank's chunks (a custom spec or provider may lack it)."""
    has_layers = any(_LAYER_RE.match(n) for c in chunks for n, _ in c.named_modules())
    found = {_LAYER_RE.match(n).group(2) for n in wrapped}
    missing = [t for t in resolve_target_modules(args.lora_target_modules) if t not in found]
    if has_layers and missing:
        raise ValueError(f"--lora-target-modules: {', '.join(missing)} matches no layer of this model")


def log_lora_summary(args, chunks, wrapped):
    """One log line that LoRA is on: rank, alpha, targets, the wrapped layers and the trainable parameters of this
    rank's chunks (logged by global rank 0 only)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    params = [(n, p) for c in chunks for n, p in c.named_parameters()]
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    total = sum(p.numel() for _, p in params)
    logger.info(
        "LoRA is on (--enable-lora): rank %d, alpha %s, dropout %s, targets %s on %d layers, --lora-sync %s; "
        "trainable parameters %d of %d (%.3f%%) on rank 0",
        args.lora_rank,
        args.lora_alpha,
        args.lora_dropout,
        ",".join(resolve_target_modules(args.lora_target_modules)),
        len(wrapped),
        args.lora_sync,
        trainable,
        total,
        100.0 * trainable / max(total, 1),
    )


def _add_adapter(args, module, column, global_name):
    rank, tp = args.lora_rank, mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    weight = module.weight
    out_local, in_local = weight.shape
    in_full = in_local if column else in_local * tp
    # A as peft initialises it (kaiming-uniform, a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), drawn whole from a
    # generator seeded by the layer's global name, so every TP/PP layout gets the same adapter; B starts at zero.
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + zlib.crc32(global_name.encode()))
    bound = 1.0 / math.sqrt(in_full)
    a_full = torch.empty(rank, in_full).uniform_(-bound, bound, generator=gen)
    a = a_full if column else a_full.chunk(tp, dim=1)[tp_rank]
    module.lora_A = torch.nn.Parameter(a.to(weight.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(torch.zeros(out_local if column else weight.shape[0], rank, dtype=weight.dtype))
    sharded = module.lora_B if column else module.lora_A
    tensor_parallel.set_tensor_model_parallel_attributes(sharded, True, 0 if column else 1, 1)
    module.lora_scale = scale(args)
    module.lora_column = column
    module.lora_dropout = torch.nn.Dropout(args.lora_dropout) if args.lora_dropout > 0 else None
    module.register_forward_hook(_lora_hook, with_kwargs=True)
    gated = column and global_name.endswith("mlp.linear_fc1") and module.config.gated_linear_unit
    module.sharded_state_dict = functools.partial(_sharded_state_dict, module, column, gated)


def _sharded_state_dict(module, column, gated, prefix="", sharded_offsets=(), metadata=None):
    """The layer's checkpoint entries with the split adapter TP-sharded like the weight (megatron-core's own
    method would store it as replicated); a gated fc1's B keeps its [gate; up] rows apart, as the MLP does for W."""
    axes = {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}
    sd = make_sharded_tensors_for_checkpoint(
        module.state_dict(prefix="", keep_vars=True),
        prefix,
        axes,
        sharded_offsets,
        tp_group=module.tp_group,
        dp_cp_group=(metadata or {}).get("dp_cp_group"),
    )
    if gated:
        singleton = (metadata or {}).get("singleton_local_shards", False)
        sd[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(sd[f"{prefix}lora_B"], sharded_offsets, singleton)
    return sd


def _lora_hook(module, inputs, kwargs, output):
    x = inputs[0] if inputs else kwargs["input_"]
    out, bias = output
    delta = lora_delta(module, x)
    return out + delta.to(out.dtype), bias


def lora_delta(module, x):
    """`s * B A dropout(x)` laid out like the base layer's output on this rank (see the module docstring)."""
    sp = module.sequence_parallel
    a, b = module.lora_A, module.lora_B
    if module.lora_column:
        if sp:  # the base gathers the sequence itself; the adapter's input is gathered here, its grad split back
            x = tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        if module.lora_dropout is not None:  # x is the same on every TP rank: the default (TP-shared) RNG
            x = module.lora_dropout(x)
        h = tensor_parallel.copy_to_tensor_model_parallel_region(x.to(a.dtype) @ a.t())  # backward: sum over TP
        return module.lora_scale * (h @ b.t())
    if module.lora_dropout is not None:  # x is this rank's slice: the per-TP-rank RNG, as Megatron's dropout
        with tensor_parallel.get_cuda_rng_tracker().fork():
            x = module.lora_dropout(x)
    h = tensor_parallel.reduce_from_tensor_model_parallel_region(x.to(a.dtype) @ a.t())
    y = module.lora_scale * (h @ b.t())
    if sp:  # the base reduce-scatters over the sequence: keep this rank's part
        y = tensor_parallel.scatter_to_sequence_parallel_region(y)
    return y


# ---- merged weights ---------------------------------------------------------------------------------------------


def merged_shard(weight, a, b, s):
    """This rank's shard of `W + s * B A`, from its shards (column: B split; row: A split)."""
    return (weight.float() + s * (b.float() @ a.float())).to(weight.dtype)


def merge_for_sync(args, named_params):
    """`named_params` [(global name, local shard)] with every adapted base weight replaced by its merged shard
    (keeping its tensor-parallel attributes) and the adapters left out. Identity without --enable-lora."""
    if not args.enable_lora:
        yield from named_params
        return
    items = list(named_params)
    lookup = dict(items)
    s = scale(args)
    for name, param in items:
        if is_lora_param(name):
            continue
        a_name, b_name = adapter_names(name) if name.endswith(".weight") else (None, None)
        if a_name in lookup:
            merged = merged_shard(param.detach(), lookup[a_name].detach(), lookup[b_name].detach(), s)
            yield name, with_parallel_attrs(merged, param)
        else:
            yield name, param


def merged_from_dict(args, weights, name):
    """`weights[name]` (a CPU weight dict of local shards), merged with its adapters when it has them."""
    a_name, b_name = adapter_names(name) if args.enable_lora and name.endswith(".weight") else (None, None)
    if a_name in weights:
        return merged_shard(weights[name], weights[a_name], weights[b_name], scale(args))
    return weights[name]


def base_weight_name(adapter_name: str) -> str:
    return adapter_name.rsplit(".", 1)[0] + ".weight"


def is_column(name: str) -> bool:
    rest = _LAYER_RE.match(canonical_name(name)[len(PREFIX) :]).group(2)
    return TARGETS[rest.rsplit(".", 1)[0]]


# ---- PEFT export -----------------------------------------------------------------------------------------------


def full_adapters(args, model, weights=None) -> dict:
    """{global base weight name: (A full, B full)} of every adapted layer of the whole model, on every rank (CPU
    tensors; A/B gathered over TP like their base weight, then shared over PP). Collective over all ranks.
    `weights`: a CPU dict of this rank's shards to read instead of the live parameters (an offloaded model)."""
    import torch.distributed as dist

    local = {}
    params = dict(named_parameters(args, model))

    def shard(n):
        if weights is None:
            return params[n]
        # how to gather it: the live parameter's TP attributes
        return with_parallel_attrs(weights[n].to(get_device(int(os.environ.get("LOCAL_RANK", "0")))), params[n])

    for name in sorted(params):
        if not name.endswith(".lora_A"):
            continue
        base = base_weight_name(name)
        a, b = shard(name), shard(name[: -len("A")] + "B")
        # gather as the base weight would be gathered, so a gated fc1's B gets its [gate; up] rows back in order
        full_a = all_gather_param(base, a, gated_linear_unit=args.swiglu)
        full_b = all_gather_param(base, b, gated_linear_unit=args.swiglu)
        local[base] = (full_a.detach().float().cpu(), full_b.detach().float().cpu())
    if mpu.get_pipeline_model_parallel_world_size() > 1:
        gathered = [None] * mpu.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(gathered, local, group=mpu.get_pipeline_model_parallel_group())
        local = {k: v for part in gathered for k, v in part.items()}
    return local


def peft_tensors(args, adapters, model_name) -> dict:
    """PEFT's `adapter_model.safetensors` entries for `full_adapters()`: a fused Megatron layer gives each of its HF
    projections the shared A (column) and its rows of B, or its column slice of A (row)."""
    out = {}
    for base, (a, b) in adapters.items():
        bs = convert_to_hf(args, model_name, base, b)
        # column layers split B by output rows and share A; row layers are one HF module: A converts like W
        as_ = [(n, a) for n, _ in bs] if is_column(base) else convert_to_hf(args, model_name, base, a)
        for (hf_name, b_part), (_, a_part) in zip(bs, as_):
            module = "base_model.model." + hf_name[: -len(".weight")]
            out[module + ".lora_A.weight"] = a_part.contiguous()
            out[module + ".lora_B.weight"] = b_part.contiguous()
    return out


def peft_config(args, target_modules) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": args.hf_checkpoint,
        "r": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "lora_dropout": args.lora_dropout,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def export_peft(args, model, out_dir, model_name=None):
    """Write the adapters as a PEFT LoRA checkpoint (`adapter_config.json` + `adapter_model.safetensors`) into
    `out_dir` on global rank 0. Collective over all ranks."""
    import json
    import os

    import torch.distributed as dist
    from safetensors.torch import save_file

    model_name = resolve_model_name(args, model_name)
    tensors = peft_tensors(args, full_adapters(args, model), model_name)
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        modules = {k.split(".lora_")[0].rsplit(".", 1)[1] for k in tensors}
        tmp = os.path.join(out_dir, "adapter_model.safetensors.tmp")
        save_file({k: v.to(torch.float32).clone() for k, v in tensors.items()}, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, "adapter_model.safetensors"))
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump(peft_config(args, modules), f, indent=2)
    dist.barrier()
