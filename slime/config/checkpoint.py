"""What the job saves and loads: HF exports, optimizer state, frozen parameters."""

import logging
import os
import re

from slime.config.base import Group

logger = logging.getLogger(__name__)


def add_optimizer_state_arguments(parser):
    g = Group(parser, "optimizer state")
    g.add_argument(
        "--reset-optimizer-states",
        action="store_true",
        default=False,
        help="Zero Adam's moments and step count at the start of every rollout's training.",
    )
    g.add_argument(
        "--use-stateless-adam",
        action="store_true",
        default=False,
        help="Adam that keeps no moments across steps: each update is Adam's first step, lr * g / (|g| + eps). "
        "Requires --optimizer adam and --no-save-optim.",
    )
    return parser


def check_optimizer_state_flags(args, error):
    if args.use_stateless_adam:
        if args.optimizer != "adam":
            error(f"--use-stateless-adam is an Adam variant: drop --optimizer {args.optimizer}.")
        if not args.no_save_optim:
            error("--use-stateless-adam keeps no Adam moments to save: add --no-save-optim.")


def add_param_freeze_arguments(parser):
    g = Group(parser, "frozen parameters")
    g.add_argument(
        "--only-train-params-name-list",
        type=str,
        nargs="*",
        default=None,
        help="Regexes (re.search) over Megatron parameter names, e.g. decoder.layers.3.mlp.linear_fc1.weight "
        "(global layer numbers; a tied output layer goes by the embedding's name): only the parameters matching one "
        "of them train; all others are frozen (no gradient, no optimizer state). Weight sync still sends every weight.",
    )
    g.add_argument(
        "--freeze-params-name-list",
        type=str,
        nargs="*",
        default=None,
        help="Regexes (re.search) over Megatron parameter names (as --only-train-params-name-list): the parameters "
        "matching one of them are frozen; all others train. Weight sync still sends every weight.",
    )
    return parser


def check_param_freeze_flags(args, error):
    only, freeze = args.only_train_params_name_list, args.freeze_params_name_list
    if only and freeze:
        error("You can only specify ONE of: --only-train-params-name-list, or --freeze-params-name-list.")
    for flag, patterns in (("--only-train-params-name-list", only), ("--freeze-params-name-list", freeze)):
        if patterns and args.enable_lora:
            error(f"{flag}: --enable-lora already freezes every weight but its adapters: drop one of the two.")
        for pattern in patterns or ():
            try:
                re.compile(pattern)
            except re.error as e:
                error(f"{flag}: {pattern!r} is not a regular expression ({e}).")
    from slime.backends.megatron_utils.arguments import check_param_patterns_match

    check_param_patterns_match(args, error)  # against the names the model will have, before Ray starts


def add_save_hf_arguments(parser):
    g = Group(parser, "HF checkpoint copies")
    g.add_argument(
        "--save-hf",
        type=str,
        default=None,
        help="At each checkpoint save (--save, --save-interval), also write the actor as an HF safetensors checkpoint "
        "(with --hf-checkpoint's config and tokenizer files) to this path, formatted with the rollout id, e.g. "
        "/ckpt/hf/iter_{rollout_id}; a path without {rollout_id} is overwritten at each save.",
    )
    return parser


def check_save_hf(args, error):
    if args.save_hf is None:
        return
    try:
        path = args.save_hf.format(rollout_id=0)
    except (KeyError, IndexError, ValueError) as e:
        error(f"--save-hf {args.save_hf}: not a path template with only {{rollout_id}} ({type(e).__name__}: {e}).")
    if args.save is None or args.save_interval is None:
        error("--save-hf writes an HF copy at each checkpoint save: it needs --save and --save-interval.")
    if not args.hf_checkpoint or not os.path.isdir(args.hf_checkpoint):
        error(
            f"--save-hf needs --hf-checkpoint as a local directory (its config and tokenizer are copied), got "
            f"{args.hf_checkpoint!r}."
        )
    if os.path.realpath(path) == os.path.realpath(args.hf_checkpoint):
        error(f"--save-hf {args.save_hf} would overwrite --hf-checkpoint {args.hf_checkpoint}: save elsewhere.")


def checkpoint_exists(path):
    return path is not None and os.path.exists(os.path.join(path, "latest_checkpointed_iteration.txt"))


def check_reference_checkpoint(args, error, check_paths):
    """KL needs the reference checkpoint. Without --ref-load the initial weights (--hf-checkpoint) are the reference."""
    if (args.kl_coef != 0 or args.use_kl_loss) and args.ref_load is not None and check_paths:
        if not os.path.exists(args.ref_load):
            error(f"--ref-load {args.ref_load} does not exist (needed by --use-kl-loss / --kl-coef).")
        if not checkpoint_exists(args.ref_load):
            logger.warning("--ref-load %s has no latest_checkpointed_iteration.txt", args.ref_load)


def resolve_load(args, error, check_paths):
    """--load without a checkpoint starts from the reference weights with a fresh optimizer."""
    # The check compares the first push with the weights the engines loaded from --hf-checkpoint; a resumed run
    # pushes its checkpoint's (trained) weights, so the comparison would fail for no fault of the weight sync.
    if args.check_weight_update_equal and args.load is not None and (not check_paths or checkpoint_exists(args.load)):
        error(
            f"--check-weight-update-equal compares the first weight push with --hf-checkpoint's weights, but "
            f"--load {args.load} resumes from a checkpoint whose weights differ: drop one of the two."
        )
    if args.load is None or (check_paths and not checkpoint_exists(args.load)):
        args.no_load_optim = args.no_load_rng = args.finetune = True
        args.load = args.ref_load
        if args.ref_ckpt_step is not None:
            args.ckpt_step = args.ref_ckpt_step
        if args.start_rollout_id is None:
            args.start_rollout_id = 0


def check_save(args, error):
    if args.save_interval is not None and args.save is None:
        error("--save-interval requires --save (the checkpoint directory).")
    if args.async_save and args.save is None:
        error("--async-save writes the checkpoints of --save in the background: it needs --save.")
    check_save_hf(args, error)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        error(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other: "
            "recompute the LR schedule from this run's flags, or keep the checkpoint's, not both."
        )
