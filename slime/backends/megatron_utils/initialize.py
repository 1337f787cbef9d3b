"""Megatron initialisation on top of an already-initialised torch.distributed (`TrainRayActor.init` does that).

Process groups from the parallelism flags (order tp-cp-ep-dp-pp, as slime), one global gloo group for CPU-side
collectives (objects, barriers), seeds `seed + 100*pp_rank` (+10*dp_rank with --data-parallel-random-init), the
model-parallel RNG tracker (the CPU tracker via `cpu_compat` on CPU), and the `--custom-megatron-init-path` hook.
"""

import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

from slime.utils.user_errors import user_function

from . import cpu_compat

_GLOO_GROUP = None


def set_megatron_globals(args):
    """megatron-core's process-wide switches that Megatron-LM sets from its flags: `--enable-experimental`."""
    from megatron.core.config import set_experimental_flag

    set_experimental_flag(bool(getattr(args, "enable_experimental", False)))


def init(args):
    """Set up Megatron's parallel state, the gloo group, seeds and the custom init hook for this rank."""
    global _GLOO_GROUP
    cpu_compat.apply()
    set_megatron_globals(args)
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised (TrainRayActor.init) before megatron_utils.init")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"world size {world} is not divisible by --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}"
        )
    args.data_parallel_size = world // (tp * pp * cp)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
            context_parallel_size=cp,
            expert_model_parallel_size=args.expert_model_parallel_size,
            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
            order="tp-cp-ep-dp-pp",
        )
    if _GLOO_GROUP is None:
        _GLOO_GROUP = dist.new_group(backend="gloo")

    seed = args.seed + 100 * mpu.get_pipeline_model_parallel_rank()
    if args.data_parallel_random_init:
        seed += 10 * mpu.get_data_parallel_rank()
    set_random_seed(seed)

    if args.custom_megatron_init_path:
        user_function("--custom-megatron-init-path", args.custom_megatron_init_path)(args)


def set_random_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def get_gloo_group():
    if _GLOO_GROUP is None:
        raise RuntimeError("megatron_utils.init(args) has not run: no gloo group yet")
    return _GLOO_GROUP


def is_megatron_main_rank():
    """The rank that logs: data-parallel 0, tensor-parallel 0, context-parallel 0, last pipeline stage."""
    return (
        mpu.get_data_parallel_rank(with_context_parallel=True) == 0
        and mpu.get_tensor_model_parallel_rank() == 0
        and mpu.is_pipeline_last_stage(ignore_virtual=True)
    )
