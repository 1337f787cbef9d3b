"""The one place that chooses the compute device and the collective backend.

GPU clusters: CUDA + NCCL, CUDA IPC for colocated weight sync.  CPU machines: the same code on CPU + gloo,
torch shared-memory handles instead of CUDA IPC. Override with SLIME_DEVICE=cpu|cuda.
"""
import functools
import os

import torch


@functools.lru_cache(None)
def device_type() -> str:
    forced = os.environ.get("SLIME_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


def is_cpu() -> bool:
    return device_type() == "cpu"


def get_device(local_rank: int = 0) -> torch.device:
    return torch.device("cpu") if is_cpu() else torch.device("cuda", local_rank)


def dist_backend() -> str:
    return "gloo" if is_cpu() else "nccl"


def default_dtype(bf16: bool) -> torch.dtype:
    # CPU training runs in fp32 by default: bf16 matmuls on CPU are slow and lose parity with HF references.
    return torch.bfloat16 if bf16 and not is_cpu() else torch.float32
