"""The whole command line: slime's flag groups, Megatron-LM's flags and SGLang's (`--sglang-*`), parsed into one
`argparse.Namespace` and validated in one pass (`parse_args`)."""

import argparse
import logging
import os
import secrets
import sys

from slime.backends.megatron_utils.arguments import (
    lora_validate_args,
    megatron_defaults,
    megatron_training_available,
    megatron_validate_args,
    parse_with_megatron,
    set_default_megatron_args,
)
from slime.backends.megatron_utils.hf_config import HF_DROPOUT_KEYS, apply_hf_config
from slime.backends.megatron_utils.megatron_flags import add_megatron_arguments
from slime.backends.sglang_utils.arguments import add_sglang_arguments
from slime.backends.sglang_utils.arguments import validate_args as sglang_validate_args
from slime.backends.sglang_utils.sglang_config import (
    add_sglang_config_arguments,
)
from slime.config.algorithm import (
    add_algo_arguments,
    add_linear_attention_arguments,
    add_lora_arguments,
    add_loss_variant_arguments,
    add_mtp_training_arguments,
    add_opd_arguments,
    add_ref_update_arguments,
    add_routing_replay_arguments,
)
from slime.config.checkpoint import add_optimizer_state_arguments, add_param_freeze_arguments, add_save_hf_arguments
from slime.config.cluster import (
    add_cluster_arguments,
    add_fault_tolerance_arguments,
    add_network_arguments,
    add_train_env_arguments,
    resolve_inference_server,
)
from slime.config.critic import add_critic_arguments, check_critic
from slime.config.data import (
    add_batch_memory_arguments,
    add_context_length_arguments,
    add_data_arguments,
    add_eval_arguments,
)
from slime.config.megatron import (
    add_custom_megatron_hooks_arguments,
    add_custom_megatron_plugins_arguments,
    apply_megatron_config,
)
from slime.config.observability import (
    add_ci_arguments,
    add_correct_samples_arguments,
    add_debug_arguments,
    add_metric_arguments,
    add_profile_arguments,
    add_tensorboard_arguments,
    add_wandb_arguments,
    check_profiling,
)
from slime.config.rollout import (
    add_consistency_arguments,
    add_external_engine_arguments,
    add_reward_model_arguments,
    add_rollout_arguments,
    add_rollout_buffer_arguments,
    check_reward_dependencies,
)
from slime.config.validate import slime_validate_args
from slime.config.weight_sync import add_weight_sync_arguments, check_weight_sync
from slime.utils.flag_support import add_refused_arguments, refuse_unsupported, warn_no_effect
from slime.utils.startup_checks import check_inputs

logger = logging.getLogger(__name__)


def get_slime_extra_args_provider(add_custom_arguments=None):
    def add_slime_arguments(parser):
        if add_custom_arguments is not None:
            add_custom_arguments(parser)  # first, so it can pre-empt slime's names
        for add in (
            add_cluster_arguments,
            add_rollout_arguments,
            add_data_arguments,
            add_batch_memory_arguments,
            add_eval_arguments,
            add_algo_arguments,
            add_loss_variant_arguments,
            add_consistency_arguments,
            add_routing_replay_arguments,
            add_critic_arguments,
            add_wandb_arguments,
            add_tensorboard_arguments,
            add_profile_arguments,
            add_save_hf_arguments,
            add_metric_arguments,
            add_correct_samples_arguments,
            add_optimizer_state_arguments,
            add_param_freeze_arguments,
            add_ref_update_arguments,
            add_train_env_arguments,
            add_context_length_arguments,
            add_debug_arguments,
            add_sglang_arguments,
            add_network_arguments,
            add_reward_model_arguments,
            add_rollout_buffer_arguments,
            add_custom_megatron_hooks_arguments,
            add_weight_sync_arguments,
            add_external_engine_arguments,
            add_sglang_config_arguments,
            add_fault_tolerance_arguments,
            add_ci_arguments,
            add_custom_megatron_plugins_arguments,
            add_mtp_training_arguments,
            add_lora_arguments,
            add_opd_arguments,
            add_linear_attention_arguments,
            add_refused_arguments,  # last: parses the refused upstream flags no group above declares
        ):
            add(parser)
        if "--padded-vocab-size" not in parser._option_string_actions:
            parser.add_argument("--padded-vocab-size", type=int, default=None)
        return parser

    return add_slime_arguments


def _given_flags(argv):
    """Option strings present on the command line (`--x v` and `--x=v`)."""
    return {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}


def build_parser(add_slime_arguments):
    parser = argparse.ArgumentParser(
        prog=os.path.basename(sys.argv[0]) or "slime",
        usage="%(prog)s [options]",
        allow_abbrev=False,
        description="slime: RL post-training with Megatron + SGLang (slime, Megatron-LM and --sglang-* options).",
    )
    add_megatron_arguments(parser)
    add_slime_arguments(parser)
    return parser


def parse_args(add_custom_arguments=None, argv=None, *, check_paths=True, asynchronous=False):
    """Parse and validate the job's arguments. `argv` defaults to sys.argv[1:]. `asynchronous=True`: for
    train_async.py, whose overlap of generation and training rules out --colocate / --offload.

    `check_paths=False` validates a launch script meant for another machine: no checkpoint / HF paths are read,
    and with `--inference-server auto` the CPU-server compatibility check is skipped."""
    add_slime_arguments = get_slime_extra_args_provider(add_custom_arguments)
    with_megatron = megatron_training_available()
    if with_megatron:
        args, parser = parse_with_megatron(add_slime_arguments, argv)
    else:
        parser = build_parser(add_slime_arguments)
        args = parser.parse_args(argv)
    error = _one_line_error(parser)
    overridden = apply_megatron_config(args, parser, error, check_paths)
    refuse_unsupported(args, parser, error)
    warn_no_effect(args, parser, logger.warning)
    user_load = args.load  # validation replaces a --load without a checkpoint by --ref-load

    if args.hf_checkpoint:
        given = _given_flags(argv) | {"--" + key.replace("_", "-") for key in overridden}
        apply_hf_config(args, error, check_paths, given)
    for dest in HF_DROPOUT_KEYS:  # no HF config to read: Megatron's default
        if getattr(args, dest) is None:
            setattr(args, dest, 0.1)
    if args.ci_test and (args.attention_dropout > 0 or args.hidden_dropout > 0):
        error(
            f"--ci-test checks that the first step reproduces the rollout's log-probs, which dropout breaks: "
            f"--attention-dropout {args.attention_dropout} --hidden-dropout {args.hidden_dropout}; set both to 0."
        )
    args.rank = 0
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node
    set_default_megatron_args(args)
    slime_validate_args(args, error, check_paths=check_paths, asynchronous=asynchronous)
    args.asynchronous = asynchronous  # train_async.py: the weight-version gate allows the previous push too
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node  # debug-rollout-only may resize the actors
    if with_megatron:
        if not args.debug_rollout_only:
            from megatron.training.arguments import validate_args as megatron_validate  # optional: Megatron-LM

            megatron_validate(args)
    else:
        megatron_defaults(args)
        if not args.debug_rollout_only:
            megatron_validate_args(args, error)
    args.variable_seq_lengths = True
    lora_validate_args(args, error)
    if args.moe_token_dispatcher_type == "allgather":
        args.moe_token_dispatcher_type = "alltoall"
    # A dry run with --inference-server auto validates for the target machine, whose server we cannot know.
    check_cpu_server = check_paths or args.inference_server == "cpu"
    resolve_inference_server(args, error)
    check_weight_sync(args, error, check_paths)
    check_profiling(args, error)
    sglang_validate_args(args, parser, check_cpu_server=check_cpu_server)
    if args.sglang_served_model_name is None:
        # This run's identity: every engine must echo it in /get_server_info before it gets traffic or weights, so a
        # server of another run that happens to answer on an engine's port is never used (see SGLangEngine.init).
        args.sglang_served_model_name = f"slime-run-{secrets.token_hex(8)}"
    check_critic(args, error, user_load, check_paths)
    if check_paths:
        check_inputs(args, error, user_load)
        check_reward_dependencies(args, error)
    return args


def _one_line_error(parser):
    """argparse's exit (status 2, `prog: error: ...` on stderr) without the usage line: validation errors are about
    values, not syntax, so the one line that names the culprit is all the user needs."""

    def error(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    return error


def main():
    """`python -m slime.config [train.py | train_async.py] ARGS...` (and upstream's `python -m slime.utils.arguments`):
    a launch script's dry run, parse and validate only (with train_async.py's checks when the first argument names
    it), paths not read; prints "ok"."""
    argv = sys.argv[1:]
    driver = argv.pop(0) if argv[:1] in (["train.py"], ["train_async.py"]) else "train.py"
    parse_args(argv=argv, check_paths=False, asynchronous=driver == "train_async.py")
    print("ok")
