"""The one place that chooses the compute device and acts on it.

GPU clusters: CUDA + NCCL, CUDA IPC for colocated weight sync.  CPU machines: the same code on CPU + gloo,
torch shared-memory handles instead of CUDA IPC. Override with SLIME_DEVICE=cpu|cuda.

Callers use the operations below (set_device, current_device, synchronize, empty_cache, pin_memory,
dist_backend, default_dtype, rng_state) and never branch on the device themselves: each one is what the
CUDA call is on a GPU, and the CPU equivalent (usually nothing) on a CPU machine.
"""

import functools
import gc
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


def local_rank(ray_local_rank: int) -> int:
    """The process's device index: the GPU Ray gave it, or 0 on a CPU machine (every rank shares the one CPU)."""
    return 0 if is_cpu() else ray_local_rank


def set_device(local_rank: int) -> None:
    """Bind this process to its GPU; nothing to bind on CPU."""
    if not is_cpu():
        torch.cuda.set_device(get_device(local_rank))


def current_device() -> torch.device:
    """Where this process's tensors live: its current GPU, or the CPU."""
    return torch.device("cpu") if is_cpu() else torch.device("cuda", torch.cuda.current_device())


def synchronize() -> None:
    """Wait for queued device work (async copies included); CPU work is already done."""
    if not is_cpu():
        torch.cuda.synchronize()


def empty_cache() -> None:
    """Return the caching allocator's free blocks to the GPU; the CPU has no such cache."""
    if not is_cpu():
        torch.cuda.empty_cache()


def pin_memory() -> bool:
    """Whether host staging buffers are page-locked (and device<->host copies non-blocking): only with a GPU."""
    return not is_cpu()


def dist_backend() -> str:
    return "gloo" if is_cpu() else "nccl"


def clear_memory() -> None:
    """Return the allocator's cached blocks to the device (after a sync and a GC): no-op on CPU."""
    if is_cpu():
        return
    synchronize()
    gc.collect()
    empty_cache()


def default_dtype(bf16: bool) -> torch.dtype:
    # CPU training runs in fp32 by default: bf16 matmuls on CPU are slow and lose parity with HF references.
    return torch.bfloat16 if bf16 and not is_cpu() else torch.float32


def rng_state():
    """The device RNG state for a checkpoint (None without CUDA)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_rng_state(state) -> None:
    """Restore what `rng_state` saved; a checkpoint written without CUDA (or read without it) skips this."""
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
