"""PPO's critic: its flags and the checks of its own parallel layout and batch (`--megatron-config-path` role critic)."""

import os

from slime.config.base import Group
from slime.config.checkpoint import checkpoint_exists
from slime.utils.checkpoint_tracker import checkpoint_dir, read_tracker


def add_critic_arguments(parser):
    """PPO with a critic (--advantage-estimator ppo): GAE and the value loss."""
    g = Group(parser, "critic")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE lambda (PPO with a critic); --gamma discounts.")
    g.add_argument(
        "--value-clip",
        type=float,
        default=0.2,
        help="The critic's new values stay within this distance of its old ones in the clipped value loss.",
    )
    g.add_argument(
        "--num-critic-only-steps",
        type=int,
        default=0,
        help="The first N rollouts train only the critic (the policy is not updated); >= --num-rollout: critic only.",
    )
    return parser


_CRITIC_PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


def check_critic(args, error, user_load, check_paths):
    """--advantage-estimator ppo: the critic mirrors the actor's GPUs; its parallel sizes must divide them, and a
    resumed run must find the critic's part of the checkpoint it resumes."""
    args.use_critic = args.advantage_estimator == "ppo"
    args.critic_num_nodes, args.critic_num_gpus_per_node = args.actor_num_nodes, args.actor_num_gpus_per_node
    if not args.use_critic:
        return
    if args.value_clip <= 0:
        error(f"--value-clip {args.value_clip}: the value clip must be > 0")
    if not 0 <= args.lambd <= 1 or not 0 <= args.gamma <= 1:
        error(f"--gamma {args.gamma} / --lambd {args.lambd}: both must lie in [0, 1]")
    if args.num_critic_only_steps < 0:
        error(f"--num-critic-only-steps {args.num_critic_only_steps} must be >= 0")
    overrides = args.critic_overrides
    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    sizes = {k: int(overrides.get(k, getattr(args, k)) or 1) for k in _CRITIC_PARALLEL_KEYS}
    product = sizes["tensor_model_parallel_size"] * sizes["pipeline_model_parallel_size"]
    product *= sizes["context_parallel_size"]
    if world % product:
        shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
        error(
            f"--megatron-config-path {args.megatron_config_path}: the critic's {shown} (product {product}) does not "
            f"divide its {world} GPUs (the critic mirrors the actor's --actor-num-nodes x --actor-num-gpus-per-node)"
        )
    _check_critic_model_split(args, error, sizes)
    if args.global_batch_size is not None:  # None only with --debug-rollout-only: nothing trains
        _resolve_critic_batch(args, error, world // product)
    if check_paths and user_load and checkpoint_exists(user_load) and not args.finetune:
        iteration = args.ckpt_step if args.ckpt_step is not None else read_tracker(user_load)
        critic_dir = checkpoint_dir(os.path.join(user_load, "critic"), iteration)
        if iteration != "release" and not os.path.isdir(critic_dir):
            error(
                f"--load {user_load}: resuming rollout {iteration} with --advantage-estimator ppo, but the critic's "
                f"checkpoint {critic_dir} is missing"
            )


def _check_critic_model_split(args, error, sizes):
    """The critic role's own tensor / pipeline sizes must split the model as the actor's must (heads and query
    groups over TP, layers over PP); sequence parallelism needs TP > 1, so a critic at TP 1 goes without it."""
    where = f"--megatron-config-path {args.megatron_config_path}: the critic's"
    overrides, tp, pp = (
        args.critic_overrides,
        sizes["tensor_model_parallel_size"],
        sizes["pipeline_model_parallel_size"],
    )
    if "tensor_model_parallel_size" in overrides and args.num_attention_heads:
        if args.num_attention_heads % tp:
            error(
                f"{where} tensor_model_parallel_size {tp} does not divide --num-attention-heads {args.num_attention_heads}"
            )
        if args.group_query_attention and args.num_query_groups % tp:
            error(
                f"{where} tensor_model_parallel_size {tp} does not divide --num-query-groups {args.num_query_groups}"
            )
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    if "pipeline_model_parallel_size" in overrides and args.num_layers and not uneven and args.num_layers % pp:
        error(f"{where} pipeline_model_parallel_size {pp} does not divide --num-layers {args.num_layers}")
    if tp == 1 and overrides.get("sequence_parallel", args.sequence_parallel):
        overrides["sequence_parallel"] = False


def _resolve_critic_batch(args, error, critic_dp):
    """The critic role's own `global_batch_size` or `num_steps_per_rollout` (several critic optimizer steps over the
    same rollout): derived and checked as the actor's are, both kept in `critic_overrides` so that the critic's copy
    of the arguments agrees with itself; the critic's batch must also split over its own data-parallel ranks."""
    overrides, where = args.critic_overrides, f"--megatron-config-path {args.megatron_config_path}: the critic's"
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    for key in ("global_batch_size", "num_steps_per_rollout", "micro_batch_size"):
        value = overrides.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            error(f"{where} {key} {value!r} must be a positive integer")
    gbs, steps = overrides.get("global_batch_size"), overrides.get("num_steps_per_rollout")
    if steps is not None:
        if samples % steps:
            error(
                f"{where} num_steps_per_rollout {steps} does not divide the rollout's --rollout-batch-size x "
                f"--n-samples-per-prompt = {samples} samples"
            )
        if gbs is not None and gbs != samples // steps:
            error(f"{where} global_batch_size {gbs} contradicts its num_steps_per_rollout {steps} ({samples} samples)")
        gbs = samples // steps
    if gbs is None:
        gbs = args.global_batch_size
    elif samples % gbs:
        error(
            f"{where} global_batch_size {gbs} does not divide the rollout's --rollout-batch-size x "
            f"--n-samples-per-prompt = {samples} samples"
        )
    mbs = overrides.get("micro_batch_size", args.micro_batch_size)
    if gbs % (mbs * critic_dp):
        error(
            f"{where} global_batch_size {gbs} is not divisible by its micro_batch_size {mbs} x its data-parallel "
            f"size {critic_dp}"
        )
    if "global_batch_size" in overrides or steps is not None:
        overrides.update(global_batch_size=gbs, num_steps_per_rollout=samples // gbs)
