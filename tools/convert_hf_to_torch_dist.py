"""Convert an HF checkpoint into a Megatron torch_dist "release" checkpoint that `--load` / `--ref-load` accept.

    source scripts/models/qwen3-4B.sh
    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint /root/Qwen3-4B --save /root/Qwen3-4B_torch_dist
    torchrun --nproc-per-node 8 tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --tensor-model-parallel-size 2 ...

Writes `{save}/release/` (torch_dist shards + common.pt) and `{save}/latest_checkpointed_iteration.txt` = `release`.
Flags are slime's own (`slime.utils.arguments.parse_args`); the RL-only flags it requires get harmless defaults here.
Under torchrun the pipeline size defaults to world size / --tensor-model-parallel-size (as slime, where TP is 1).
torch_dist stores tensors in global coordinates, so the result loads under any TP/PP layout.
"""

import os
import sys
import tempfile

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from slime.utils.device import dist_backend, set_device


# parse_args validates a whole training job; these satisfy its RL-only requirements. User flags come after and win.
def _job_defaults(world_size):
    w = str(world_size)  # batch sizes divisible by any data-parallel size the validator may assume
    return [
        "--debug-train-only",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        w,
        "--global-batch-size",
        w,
        "--micro-batch-size",
        "1",
        "--lr",
        "0",
        "--actor-num-nodes",
        "1",
        "--actor-num-gpus-per-node",
        w,
    ]


def _given(argv, flag):
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def get_args(argv, world_size):
    for flag in ("--hf-checkpoint", "--save"):
        if not _given(argv, flag):
            sys.exit(f"convert_hf_to_torch_dist: {flag} is required (the HF model dir and the output checkpoint dir).")
    from slime.config import parse_args  # heavy: after the flag checks

    args = parse_args(argv=_job_defaults(world_size) + list(argv))
    if not os.path.isdir(args.hf_checkpoint):
        sys.exit(f"convert_hf_to_torch_dist: --hf-checkpoint {args.hf_checkpoint} is not a directory.")
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size or 1
    if not _given(argv, "--pipeline-model-parallel-size"):
        args.pipeline_model_parallel_size = world_size // (tp * cp)  # slime: use every rank for the pipeline
    pp = args.pipeline_model_parallel_size
    if args.num_layers % pp:
        sys.exit(
            f"convert_hf_to_torch_dist: --num-layers {args.num_layers} is not divisible by the pipeline size {pp} "
            f"(world size {world_size} / --tensor-model-parallel-size {tp}); pass --pipeline-model-parallel-size."
        )
    args.virtual_pipeline_model_parallel_size = None
    args.no_save_optim = args.no_save_rng = True  # weights only: a release checkpoint is loaded as finetune
    return args


def _init_distributed(world_size):
    if dist.is_initialized():
        return False
    set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "MASTER_ADDR" in os.environ:  # torchrun
        dist.init_process_group(dist_backend(), rank=int(os.environ.get("RANK", 0)), world_size=world_size)
    else:  # a plain single process: a file store needs no free port
        store = os.path.join(tempfile.mkdtemp(prefix="slime-convert-"), "store")
        dist.init_process_group(dist_backend(), init_method=f"file://{store}", rank=0, world_size=1)
    return True


def main(argv=None):
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    args = get_args(sys.argv[1:] if argv is None else argv, world_size)
    # heavy (Megatron): after the flag checks
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils import initialize
    from slime.backends.megatron_utils.checkpoint import save_checkpoint
    from slime.backends.megatron_utils.megatron_to_hf import hf_to_megatron
    from slime.backends.megatron_utils.model import get_model

    owns_group = _init_distributed(world_size)
    try:
        initialize.init(args)
        model = get_model(args, wrap_with_ddp=False)
        hf_to_megatron(args, model)
        path = save_checkpoint(args, "release", model, None, None, with_optimizer=False)
        if dist.get_rank() == 0:
            print(f"saved {args.hf_checkpoint} as a release checkpoint in {path}")
    finally:  # leave the process as we found it, so main() can run again (one process converting several models)
        mpu.destroy_model_parallel()
        initialize._GLOO_GROUP = None
        if owns_group:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
