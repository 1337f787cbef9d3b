"""What the trainer, the rollout and the engines share about LoRA (`--enable-lora`): which layers take adapters,
the name the policy's adapter is served under, and the wire format of an adapter-only update (`--lora-sync adapter`).
Free of megatron-core, so the rollout side and start-up checks import it cheaply."""

import base64
import hashlib
import pickle

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
