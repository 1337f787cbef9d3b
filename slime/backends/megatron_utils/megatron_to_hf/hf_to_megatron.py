"""Load an HF safetensors checkpoint into a (TP/PP/EP-sharded) Megatron model — the inverse of weight export.

Each rank walks its own parameters under their global names, rebuilds the full Megatron tensor from the HF
tensors it needs (read lazily with `safe_open`, so a rank touches only its slice of the files), pads the vocab
rows, and copies out its TP shard. Beyond slime v0.1.0, where an mbridge conversion step was required.
"""

import json
import os

import torch
from megatron.core import parallel_state as mpu
from safetensors import safe_open

from ..param_utils import canonical_name, is_lora_param, named_parameters

_VOCAB_PARAMS = ("module.module.embedding.word_embeddings.weight", "module.module.output_layer.weight")


class SafetensorsReader:
    """Lazy `hf_name -> tensor` over `model.safetensors` / sharded `model.safetensors.index.json` / any `*.safetensors`."""

    def __init__(self, hf_dir):
        self.hf_dir = hf_dir
        if not os.path.isdir(hf_dir):
            raise FileNotFoundError(f"--hf-checkpoint {hf_dir!r} is not a directory")
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.key_to_file = json.load(f)["weight_map"]
        else:
            self.key_to_file = {}
            for fname in sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors")):
                with safe_open(os.path.join(hf_dir, fname), framework="pt") as f:
                    self.key_to_file.update({k: fname for k in f.keys()})
        if not self.key_to_file:
            raise FileNotFoundError(
                f"--hf-checkpoint {hf_dir!r} has no *.safetensors weights; save the model with "
                "save_pretrained(safe_serialization=True)."
            )
        self._handles = {}
        self._recent = {}  # the last two tensors read (an expert's fc1 and fc2 come from two stacked tensors)
        from slime.utils.quantization import QuantScheme, hf_quantization_config

        qc = hf_quantization_config(hf_dir)
        self.scheme = QuantScheme(qc, f"--hf-checkpoint {hf_dir} quantization_config") if qc else None

    def _has(self, key):
        return key in self.key_to_file or (
            self.scheme is not None and key.endswith(".weight") and key + "_packed" in self.key_to_file
        )

    def get(self, key, fallback=None):
        """The tensor `key`; from a quantised checkpoint (FP8 with its scale, INT4 packed) its dequantised fp32
        value (q * s exactly, with the checkpoint's own block size), as the trainer starts from full precision."""
        if not self._has(key) and fallback is not None:
            key = fallback
        if not self._has(key):
            raise KeyError(f"HF checkpoint {self.hf_dir!r} has no tensor {key!r} (needed by the Megatron model)")
        if self.scheme is None:
            return self._read(key)
        from slime.utils import quantization as Q

        if key not in self.key_to_file:  # INT4: weight_packed / weight_scale / weight_shape [/ weight_zero_point]
            parts = {
                s: self._read(key + s[len("weight") :])
                for s in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
                if key + s[len("weight") :] in self.key_to_file
            }
            return Q.dequantize_int4(parts, self.scheme.group_size, self.scheme.symmetric, torch.float32)
        t = self._read(key)
        if t.dtype == Q.FP8_DTYPE:
            if key + "_scale_inv" in self.key_to_file:
                return Q.dequantize_fp8(t, self._read(key + "_scale_inv"), self.scheme.block_size, torch.float32)
            if key + "_scale" in self.key_to_file:
                return Q.dequantize_fp8(t, self._read(key + "_scale"), None, torch.float32)
            raise KeyError(f"HF checkpoint {self.hf_dir!r}: FP8 tensor {key!r} has no {key}_scale_inv or {key}_scale")
        return t

    def _read(self, key):
        if key in self._recent:  # stacked experts: each expert's parameter reads its slice of the same tensor
            return self._recent[key]
        fname = self.key_to_file[key]
        if fname not in self._handles:
            self._handles[fname] = safe_open(os.path.join(self.hf_dir, fname), framework="pt")
        tensor = self._handles[fname].get_tensor(key)
        self._recent = {**dict(list(self._recent.items())[-1:]), key: tensor}
        return tensor


def shard_for_rank(name, full, param, *, gated_linear_unit=True):
    """This rank's TP shard of the full Megatron tensor `full` (the inverse of `param_utils.all_gather_param`)."""
    name = canonical_name(name)
    tp = getattr(param, "tensor_model_parallel", False) and getattr(param, "parallel_mode", None) != "duplicated"
    if ".experts." in name:
        tp_size, tp_rank = mpu.get_expert_tensor_parallel_world_size(), mpu.get_expert_tensor_parallel_rank()
    else:
        tp_size, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    if not tp or tp_size == 1:
        tp_size, tp_rank = 1, 0
    if name in _VOCAB_PARAMS:  # pad vocab rows (Megatron's padded_vocab_size) with zeros
        rows = param.shape[0] * tp_size
        if full.shape[0] > rows:
            raise ValueError(f"{name}: HF vocab {full.shape[0]} exceeds the model's padded vocab {rows}")
        full = (
            torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])]) if full.shape[0] < rows else full
        )
    if tp_size > 1:
        dim = param.partition_dim
        if "linear_fc2.weight" in name and dim == 0:
            dim = 1
        if "linear_fc1.weight" in name and gated_linear_unit:
            gate, up = full.chunk(2, dim=0)
            full = torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
        else:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(
            f"{name}: HF checkpoint gives shape {tuple(full.shape)} for this rank but the Megatron parameter is "
            f"{tuple(param.shape)}; the model flags (--hidden-size, --num-query-groups, --kv-channels, ...) do not "
            "match the checkpoint's config.json"
        )
    return full


@torch.no_grad()
def hf_to_megatron(args, model, hf_checkpoint=None, model_name=None, skip_output_layer=False):
    """Copy `hf_checkpoint` (default `args.hf_checkpoint`) into every parameter of `model` (list of chunks);
    `skip_output_layer`: all but the output layer (the critic's value head, which the LM head does not fit)."""
    from . import get_family, resolve_model_name  # cycle: the package imports this module

    hf_dir = hf_checkpoint or args.hf_checkpoint
    reader = SafetensorsReader(hf_dir)
    family = get_family(resolve_model_name(args, model_name))
    gated = args.swiglu
    for name, param in named_parameters(args, model):
        # adapters are not in the HF base checkpoint: they keep their initialisation
        if (skip_output_layer and ".output_layer." in name) or is_lora_param(name):
            continue
        full = family.from_hf(args, name, reader.get)
        if full is None:
            raise ValueError(f"Megatron parameter {name!r} has no HF counterpart in the {family.name} converter")
        param.data.copy_(shard_for_rank(name, full, param, gated_linear_unit=gated))
