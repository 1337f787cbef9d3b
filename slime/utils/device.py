"""The one place that chooses the compute device and acts on it.

GPU clusters: CUDA + NCCL, CUDA IPC for colocated weight sync.  CPU machines: the same code on CPU + gloo,
torch shared-memory handles instead of CUDA IPC. Override with SLIME_DEVICE=cpu|cuda.

Callers use the operations below (set_device, current_device, synchronize, empty_cache, pin_memory,
dist_backend, default_dtype, rng_state) and never branch on the device themselves: each one is what the
CUDA call is on a GPU, and the CPU equivalent (usually nothing) on a CPU machine. The second half names each
decision the device makes for the rest of slime (flag defaults, Ray resources, how tensor handles travel).
"""

import functools
import gc
import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings

import torch


def _detect_device() -> str:
    forced = os.environ.get("SLIME_DEVICE")
    if forced:
        return forced
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(None)
def device_type() -> str:
    return _detect_device()


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


def profiler_activities() -> list:
    """What torch.profiler records: host operators, plus CUDA kernels on a GPU."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    return acts if is_cpu() else acts + [torch.profiler.ProfilerActivity.CUDA]


def memory_history_module():
    """torch.cuda.memory (the caching allocator's recorded history); None on CPU, which has no such allocator."""
    return None if is_cpu() else torch.cuda.memory


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
    """The training dtype: bf16 when asked for on GPU; always fp32 on CPU (see `bf16_by_default`)."""
    return torch.bfloat16 if bf16 and bf16_by_default() else torch.float32


def rng_state():
    """The device RNG state for a checkpoint (None without CUDA)."""
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def set_rng_state(state) -> None:
    """Restore what `rng_state` saved; a checkpoint written without CUDA (or read without it) skips this."""
    if state is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


# What the device decides for the rest of slime.

# megatron-core warns at import time, in every process that imports it (the driver, each trainer, the rollout
# controller), that Transformer Engine / Apex are missing and it falls back to torch code. On CPU that fallback is the
# design, so the warnings are silenced there and the driver says so once instead (`note_cpu_fallbacks`).
_MISSING_GPU_KERNELS = r"(Transformer Engine and Apex are|Transformer Engine is|Apex is) not installed"
_noted_cpu_fallbacks = False


def _cpu_process() -> bool:
    """Whether this process is a CPU run, decided before megatron-core is imported and without asking CUDA (that
    would initialise the driver in a process that may fork GPU workers later): a CPU-only torch build, or
    SLIME_DEVICE=cpu. It does not fix the device: a process may still set SLIME_DEVICE after importing slime."""
    forced = os.environ.get("SLIME_DEVICE")
    return forced == "cpu" or (not forced and not torch.backends.cuda.is_built())


def quiet_expected_warnings() -> None:
    """On CPU, drop megatron-core's "Transformer Engine / Apex are not installed" import warnings (expected there);
    on GPU they stay, as a missing kernel is worth knowing about. Run at `import slime`, before megatron-core."""
    if _cpu_process():
        warnings.filterwarnings("ignore", message=_MISSING_GPU_KERNELS, category=UserWarning)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then(module)` right after module `name` executes, before any importer can read its names."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and so that the lookup below finds the real spec
        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.then(module)

        spec.loader.exec_module = exec_module
        return spec


def eager_megatron_fusions() -> None:
    """On CPU, megatron-core's fused helpers (activations, norms, MoE routing, gated attention's output gate) run
    eagerly rather than through `torch.compile`, its default: decorating them imports TorchDynamo (about 4 s in every
    process that imports megatron-core), and each first call would compile C++ for the CPU. Same math, as the PyTorch
    fallbacks a CPU run uses anyway; on GPU megatron's default stays. Run at `import slime`, before megatron-core."""
    if _cpu_process() and "megatron.core.jit" not in sys.modules:
        sys.meta_path.insert(0, _AfterImport("megatron.core.jit", lambda jit: jit.disable_jit_fuser()))


def note_cpu_fallbacks(logger: logging.Logger) -> None:
    """Once per process, on CPU: the one line that replaces megatron-core's per-process warnings."""
    global _noted_cpu_fallbacks
    if is_cpu() and not _noted_cpu_fallbacks:
        _noted_cpu_fallbacks = True
        logger.warning(  # warning: the level a driver shows without any logging set-up
            "CPU run: megatron-core uses its PyTorch fallbacks (torch AdamW, torch norms, local multi-tensor ops) "
            "because Transformer Engine and Apex are GPU-only; this is expected on CPU, not a problem."
        )


def bf16_by_default() -> bool:
    """Whether training defaults to bf16: True on GPU; False on CPU (fp32: CPU bf16 is slow and drifts from HF)."""
    return not is_cpu()


def default_transformer_impl() -> str:
    """Megatron's default `--transformer-impl`: "transformer_engine" on GPU, "local" on CPU."""
    return "local" if is_cpu() else "transformer_engine"


def transformer_engine_usable() -> bool:
    """Whether Transformer Engine layers can be built: on GPU when transformer_engine is installed; never on CPU."""
    return not is_cpu() and importlib.util.find_spec("transformer_engine") is not None


def gradient_accumulation_fusion_by_default() -> bool:
    """Megatron's default `--gradient-accumulation-fusion`: True on GPU, False on CPU (the fused kernel is CUDA)."""
    return not is_cpu()


def sequence_parallel_possible() -> bool:
    """Whether `--sequence-parallel` can run: True on GPU; False on CPU (the local norms cannot split the sequence)."""
    return not is_cpu()


def auto_inference_server(sglang_installed: bool) -> str:
    """What `--inference-server auto` means: "sglang" on GPU when it is installed, else "cpu" (always on CPU)."""
    return "sglang" if sglang_installed and not is_cpu() else "cpu"


def local_ray_resources(num_gpus: int) -> dict:
    """`ray.init` resources of a local Ray: none on GPU (Ray detects them); on CPU `num_gpus` logical GPUs."""
    if not is_cpu():
        return {}
    # logical CPUs are free: enough that every bundle gets one even on a 2-core machine
    return dict(num_gpus=num_gpus, num_cpus=max(8, 2 * num_gpus + 4), object_store_memory=1 << 30)


def trainer_env() -> dict:
    """Env vars of a trainer process: none on GPU; on CPU one intra-op thread and gloo on loopback (unless set)."""
    if not is_cpu():
        return {}
    return dict(
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )


def allocator_hook_possible() -> bool:
    """Whether torch_memory_saver's hook can offload a trainer: True on GPU; False on CPU (it copies storages)."""
    return not is_cpu()


def shared_memory_handles() -> bool:
    """Whether tensor handles are host shared-memory fds: True on CPU; False on GPU (CUDA IPC of device buffers)."""
    return is_cpu()


def handles_need_sglang() -> bool:
    """Whether tensor handles need SGLang's own serializer: True on GPU (real SGLang); False on CPU (our server)."""
    return not is_cpu()


def default_gdn_backend() -> str:
    """`--qwen-gdn-backend` default: flash-linear-attention's Triton kernels on GPU, the plain-torch chunked rule on
    CPU (slime_plugins/models/qwen_gdn_backend.py)."""
    return "torch" if is_cpu() else "fla"


def default_tree_attention_backend() -> str:
    """`--tree-attention-backend` default: FlexAttention's block-sparse kernel on GPU (blocks no query sees are
    skipped), the local spec's dense-mask attention on CPU (FlexAttention has no CPU backward)."""
    return "dense" if is_cpu() else "flex"


def compile_kernels() -> bool:
    """Whether kernels written for torch.compile (FlexAttention, its block masks) are compiled: True on GPU, where
    that is what makes them fused; False on CPU, where they run eagerly (no C++ toolchain assumed)."""
    return not is_cpu()
