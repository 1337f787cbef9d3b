"""What the job reports: metrics, W&B, TensorBoard, profiling, debug dumps and CI checks."""

import datetime
import importlib.util
import os

from slime.config.base import Group, reset_arg
from slime.observability.profile_utils import TARGETS as PROFILE_TARGETS
from slime.utils.device import memory_history_module


def add_metric_arguments(parser):
    g = Group(parser, "metrics")
    g.add_argument(
        "--log-reward-category",
        type=str,
        default=None,
        help="Key of a dict reward naming each sample's category (e.g. its failure kind): the fraction of each "
        "category is logged per rollout as rollout/error_cat/<category>.",
    )
    return parser


def add_correct_samples_arguments(parser):
    g = Group(parser, "correct-sample metrics")
    g.add_argument(
        "--log-correct-samples",
        action="store_true",
        default=False,
        help="Log metrics of the samples whose raw reward is 1, per rollout: rollout/correct_response_lengths "
        "(mean), rollout/correct_length/p25..p100 (fraction in each quarter of --rollout-max-response-len) and "
        "rollout/correct_entropy (mean per-sample -log p of their response tokens, when the trainer computed "
        "log-probs before training).",
    )
    return parser


def add_tensorboard_arguments(parser):
    g = Group(parser, "tensorboard")
    g.add_argument(
        "--use-tensorboard",
        action="store_true",
        default=False,
        help="Also write every metric logged to W&B as a TensorBoard scalar, on the same step axis.",
    )
    g.add_argument(
        "--tb-project-name",
        type=str,
        default=None,
        help="Logs go to tensorboard_log/<project>/<experiment> ($TENSORBOARD_DIR, when set, wins). Default: "
        "slime, so that --use-tensorboard alone logs (current slime stops at its first log without a project or "
        "$TENSORBOARD_DIR).",
    )
    g.add_argument(
        "--tb-experiment-name", type=str, default=None, help="Default: the start time, %%Y%%m%%d_%%H%%M%%S."
    )
    return parser


def resolve_tb_dir(args, error):
    """`args.tb_dir`: the one TensorBoard directory of the run (None without --use-tensorboard), resolved once here so
    every process that logs (trainer, rollout controller) writes into the same run."""
    args.tb_dir = None
    if not args.use_tensorboard:
        return
    env_dir = os.environ.get("TENSORBOARD_DIR")
    if args.tb_project_name is None and not env_dir:
        args.tb_project_name = "slime"
    if args.tb_project_name is not None and args.tb_experiment_name is None:
        args.tb_experiment_name = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    args.tb_dir = os.path.abspath(
        env_dir or os.path.join("tensorboard_log", args.tb_project_name, args.tb_experiment_name)
    )


def add_profile_arguments(parser):
    g = Group(parser, "profiling (with Megatron-LM's --use-pytorch-profiler / --record-memory-history)")
    g.add_argument(
        "--profile-target",
        type=str,
        nargs="+",
        choices=list(PROFILE_TARGETS),
        default=["train_overall"],
        help="What --use-pytorch-profiler traces, one profiler step per rollout: the whole trainer, its training "
        "steps, or its log-prob forwards.",
    )
    g.add_argument("--memory-snapshot-dir", type=str, default=".", help="Where --record-memory-history writes.")
    g.add_argument(
        "--memory-snapshot-num-steps",
        type=int,
        default=None,
        help="Rollouts to record memory over (default: until the run ends; required by memray).",
    )
    g.add_argument(
        "--memory-recorder",
        choices=["torch", "memray"],
        default="torch",
        help="torch: the CUDA caching allocator's history (GPU); memray: every allocation of the process.",
    )
    return parser


def check_profiling(args, error):
    if args.use_pytorch_profiler:
        if not args.tensorboard_dir:
            error("--use-pytorch-profiler writes its traces to --tensorboard-dir: set it.")
        if len(args.profile_target) > 1:
            error(
                f"--profile-target {' '.join(args.profile_target)}: torch runs one profiler per thread at a time, and "
                "the targets overlap in time; profile one target per run."
            )
        if not 0 <= args.profile_step_start < args.profile_step_end:
            error(
                f"--profile-step-start {args.profile_step_start} / --profile-step-end {args.profile_step_end}: the "
                "profiler records rollouts [start, end), so 0 <= start < end."
            )
    if not args.record_memory_history:
        return
    if "train_overall" not in args.profile_target:
        error("--record-memory-history records the whole trainer: add train_overall to --profile-target.")
    if args.memory_recorder == "torch" and memory_history_module() is None:
        error(
            "--record-memory-history --memory-recorder torch records the CUDA caching allocator, which a CPU run "
            "does not have: use --memory-recorder memray."
        )
    if args.memory_recorder == "memray":
        if args.memory_snapshot_num_steps is None:
            error("--memory-recorder memray writes its file when recording stops: set --memory-snapshot-num-steps.")
        if importlib.util.find_spec("memray") is None:
            error("--memory-recorder memray needs the memray package: pip install 'slime[profile]' (or memray).")


def add_wandb_arguments(parser):
    g = Group(parser, "wandb")
    g.add_argument("--use-wandb", action="store_true", default=False)
    g.add_argument("--wandb-mode", choices=["online", "offline", "disabled"], default=None)
    g.add_argument("--wandb-dir", type=str, default=None)
    g.add_argument("--wandb-key", type=str, default=None)
    g.add_argument("--wandb-host", type=str, default=None)
    g.add_argument("--wandb-team", type=str, default=None)
    g.add_argument("--wandb-group", type=str, default=None)
    reset_arg(parser, "--wandb-project", type=str, default=None)
    g.add_argument("--disable-wandb-random-suffix", dest="wandb_random_suffix", action="store_false", default=True)
    g.add_argument("--wandb-always-use-train-step", action="store_true", default=False)
    g.add_argument(
        "--log-multi-turn",
        action="store_true",
        default=False,
        help="Log multi_turn/* per rollout (current slime's names): response lengths with and without the loss "
        "mask's observation tokens, the fraction at --rollout-max-response-len, and turns per sample "
        "(metadata round_number).",
    )
    g.add_argument(
        "--log-passrate",
        action="store_true",
        default=False,
        help="Log pass@k (k = 1, 2, 4, ... up to the group size; unbiased estimate over raw rewards equal to 1) of "
        "every training rollout as passrate/pass@k and of every eval dataset as eval/<name>-pass@k.",
    )
    g.add_argument("--wandb-run-id", type=str, default=None)
    g.add_argument(
        "--metrics-path",
        type=str,
        default=None,
        help="Append per-rollout metrics (rollout/eval/train) as JSON lines to this file.",
    )
    return parser


def add_debug_arguments(parser):
    g = Group(parser, "debug")
    g.add_argument("--save-debug-rollout-data", type=str, default=None, help="Path format with {rollout_id}.")
    g.add_argument(
        "--load-debug-rollout-data",
        type=str,
        default=None,
        help="Path format with {rollout_id}; implies --debug-train-only.",
    )
    g.add_argument(
        "--load-debug-rollout-data-subsample",
        type=float,
        default=None,
        help="With --load-debug-rollout-data: replay only this fraction of each dump (half from its start, half "
        "from its end).",
    )
    g.add_argument("--debug-rollout-only", action="store_true", default=False, help="No Megatron.")
    g.add_argument("--debug-train-only", action="store_true", default=False, help="No inference engines.")
    g.add_argument("--save-debug-train-data", type=str, default=None, help="Path format with {rollout_id}, {rank}.")
    g.add_argument("--dump-details", type=str, default=None, help="Dir for rollout and train debug dumps.")
    return parser


def add_ci_arguments(parser):
    g = Group(parser, "ci")
    g.add_argument("--ci-test", action="store_true", default=False, help="Assert on first-step metrics.")
    g.add_argument(
        "--ci-disable-kl-checker",
        action="store_true",
        default=False,
        help="With --ci-test: skip the first-step checks that the policy equals the reference and the rollout "
        "policy (ppo_kl, pg_clipfrac, kl_loss, log_probs == ref_log_probs).",
    )
    g.add_argument(
        "--ci-train-rollout-logprob-abs-diff-threshold",
        type=float,
        default=0.1,
        help="With --ci-test: every step's train/train_rollout_logprob_abs_diff must be at most this.",
    )
    g.add_argument(
        "--ci-save-grad-norm",
        type=str,
        default=None,
        help="Save each step's grad norm to this path template ({role}, {rollout_id}, {step_id}).",
    )
    g.add_argument(
        "--ci-load-grad-norm",
        type=str,
        default=None,
        help="Assert each step's grad norm matches the one saved at this path template (1%% or 0.01).",
    )
    return parser


def resolve_debug_modes(args, error):
    """--dump-details is shorthand for both debug dumps; replaying rollouts means no engines."""
    if args.dump_details is not None:
        args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.pt")
        args.save_debug_train_data = os.path.join(args.dump_details, "train_data", "{rollout_id}_{rank}.pt")
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    # checked before the cluster is sized so the message names the real conflict
    if args.debug_rollout_only and args.debug_train_only:
        error("--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) are mutually exclusive.")
