"""What the trainer, the rollout and the engines share about LoRA (`--enable-lora`): which layers take adapters,
the name the policy's adapter is served under, and the wire format of an adapter-only update (`--lora-sync adapter`).
Free of megatron-core, so the rollout side and start-up checks import it cheaply."""

import base64
import functools
import hashlib
import json
import os
import pickle
import struct

import torch

from slime.utils.device import handles_need_sglang
from slime.utils.tensor_serialization import serializer_classes

# Megatron module (layer-relative path) -> whether it is column parallel; the names --lora-target-modules accepts.
TARGETS = {
    "self_attention.linear_qkv": True,
    "self_attention.linear_proj": False,
    "mlp.linear_fc1": True,
    "mlp.linear_fc2": False,
}
# HF (peft) names -> the Megatron module that holds them. q/k/v and gate/up are fused in Megatron, so they come
# together (one shared A, B split by rows): naming one of a fused set without the others is refused.
HF_NAMES = {
    "q_proj": "self_attention.linear_qkv",
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1",
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
}
SHORT_NAMES = {path.rsplit(".", 1)[1]: path for path in TARGETS}  # linear_qkv -> self_attention.linear_qkv

# The name the engines serve the policy's adapter under (`--lora-sync adapter`): every rollout request names it.
ADAPTER_NAME = "slime_policy"


def resolve_target_modules(names) -> list:
    """`--lora-target-modules` values (Megatron names, HF names, `all-linear`, comma lists) -> sorted Megatron
    paths. Raises ValueError naming what is wrong."""
    flat = [n.strip() for v in names for n in v.split(",") if n.strip()]
    out = set()
    for n in flat:
        if n in ("all-linear", "all_linear"):
            out.update(TARGETS)
        elif n in TARGETS:
            out.add(n)
        elif n in SHORT_NAMES:
            out.add(SHORT_NAMES[n])
        elif n in HF_NAMES:
            fused = sorted(k for k, v in HF_NAMES.items() if v == HF_NAMES[n])
            if not set(fused) <= set(flat) and len(fused) > 1:
                megatron = HF_NAMES[n].rsplit(".", 1)[1]
                raise ValueError(
                    f"{n} is fused with {'/'.join(f for f in fused if f != n)} in Megatron's {megatron}: "
                    f"name all of {', '.join(fused)} (or {megatron})"
                )
            out.add(HF_NAMES[n])
        else:
            known = ", ".join(["all-linear", *SHORT_NAMES, *HF_NAMES])
            raise ValueError(f"{n!r} matches no layer LoRA supports (known: {known})")
    if not out:
        raise ValueError("no module named")
    return sorted(out)


def hf_target_modules(args) -> list:
    """The HF projections the run's adapters cover (an engine's `--lora-target-modules`)."""
    targets = set(resolve_target_modules(args.lora_target_modules))
    return sorted(hf for hf, megatron in HF_NAMES.items() if megatron in targets)


def generate_fields(args) -> dict:
    """The `/generate` fields that select the policy: its adapter under `--lora-sync adapter`, else nothing."""
    return {"lora_path": ADAPTER_NAME} if args.enable_lora and args.lora_sync == "adapter" else {}


def tensor_sha256(t: torch.Tensor) -> str:
    """SGLang's per-tensor checksum of an adapter (`expected_checksums`): sha256 of the tensor's raw bytes."""
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def serialize_by_value(tensors: dict) -> str:
    """`{name: tensor}` (one dtype) as a `load_format="flattened_bucket"` payload pickled with the bytes inside
    (base64), not as process-local handles, so any engine on any host can load it; SGLang's restricted unpickler
    accepts this form. One flat buffer: a single storage to rebuild, whatever the number of tensors."""
    _, bucket_cls, _ = serializer_classes(require_sglang=handles_need_sglang())  # SGLang's classes on GPU machines
    bucket = bucket_cls(named_tensors=[(n, t.detach().cpu()) for n, t in tensors.items()])
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    return base64.b64encode(pickle.dumps(payload, protocol=4)).decode()


# ------------------------------------------------------------------ the base an adapter checkpoint was trained on

_SAMPLE_BLOCKS, _BLOCK = 16, 4096


@functools.lru_cache(maxsize=4)
def _fingerprint(path: str) -> str | None:
    import xxhash

    h, found = xxhash.xxh3_128(), False
    for fname in sorted(os.listdir(path)):
        if not fname.endswith(".safetensors"):
            continue
        with open(os.path.join(path, fname), "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            for name in sorted(n for n in header if n != "__metadata__"):
                info = header[name]
                begin, end = info["data_offsets"]
                size = end - begin
                h.update(json.dumps([name, info["dtype"], info["shape"], size]).encode())
                starts = (
                    [0]
                    if size <= _SAMPLE_BLOCKS * _BLOCK
                    else [(size - _BLOCK) * i // (_SAMPLE_BLOCKS - 1) for i in range(_SAMPLE_BLOCKS)]
                )
                for start in starts:
                    f.seek(8 + header_len + begin + start)
                    h.update(f.read(min(size - start, _BLOCK if len(starts) > 1 else size)))
                found = True
    return h.hexdigest() if found else None


def base_identity(hf_checkpoint: str) -> dict:
    """What an adapter checkpoint records of its frozen base (`lora_base`): the `--hf-checkpoint` path, for messages,
    and a fingerprint of its weights, which decides: xxh3-128 over every safetensors tensor's name, dtype and shape
    and 16 blocks of 4 KiB spread over its bytes (all of a small tensor). A copy of the base elsewhere, re-saved
    with another config or index, matches; another base of the same architecture (a fine-tune, a merged adapter: both
    move every element of the weights they touch) does not. Reading ~64 KiB per tensor keeps it cheap for any model
    size, where hashing every byte would read the whole base at every save. None: no safetensors files to read."""
    return {"path": str(hf_checkpoint), "fingerprint": _fingerprint(os.path.realpath(hf_checkpoint))}


def check_base(recorded, hf_checkpoint: str, ckpt: str) -> str | None:
    """Raise ValueError (one line, naming both bases) when the adapter checkpoint `ckpt` recorded another base than
    `hf_checkpoint`. Returns a warning when the identity cannot be checked (a checkpoint that recorded only a path,
    or a base without safetensors files), else None."""
    current = base_identity(hf_checkpoint)
    if isinstance(recorded, str):  # written before the fingerprint was recorded
        return (
            f"--load {ckpt} records its LoRA base only as a path ({recorded}), not its weights: cannot check that "
            f"--hf-checkpoint {hf_checkpoint} is that base"
        )
    if not isinstance(recorded, dict) or not recorded.get("fingerprint") or not current["fingerprint"]:
        return f"--load {ckpt}: cannot fingerprint the LoRA base (no safetensors weights): not checked"
    if recorded["fingerprint"] != current["fingerprint"]:
        raise ValueError(
            f"--load {ckpt}: its LoRA adapters were trained on the base {recorded.get('path')} (weights fingerprint "
            f"{recorded['fingerprint']}), but --hf-checkpoint {hf_checkpoint} is another base (fingerprint "
            f"{current['fingerprint']}): resume on the base they were trained on"
        )
    return None
