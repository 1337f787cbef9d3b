"""slime's command line: slime's own flags, Megatron-LM's flags, and SGLang's as `--sglang-*`.

`parse_args(add_custom_arguments=None, argv=None)` returns one `argparse.Namespace` for the whole job. With
Megatron-LM on PYTHONPATH, Megatron's own parser provides its flags (full pass-through, as slime). Otherwise (the
megatron-core PyPI wheel) slime provides a Megatron-compatible group with Megatron-LM's flag names, meanings and
defaults, so `scripts/models/*.sh` arrays work unchanged. User mistakes exit with status 2 and one message naming
the flag(s) at fault.

    python -m slime.utils.arguments ARGS...   # parse + validate only, prints "ok" (launch scripts' dry run)
"""

import argparse
import importlib.util
import logging
import os
import re
import secrets
import sys

import torch
import yaml

from slime.backends.sglang_utils.arguments import add_sglang_arguments, sglang_available
from slime.backends.sglang_utils.arguments import validate_args as sglang_validate_args
from slime.utils.device import (
    auto_inference_server,
    bf16_by_default,
    default_transformer_impl,
    dist_backend,
    gradient_accumulation_fusion_by_default,
    sequence_parallel_possible,
)
from slime.utils.eval_config import from_prompt_data, load_eval_config
from slime.utils.startup_checks import DEFAULT_ROLLOUT_FUNCTION, check_inputs, check_value_ranges

logger = logging.getLogger(__name__)

FULLY_ASYNC_ROLLOUT_FUNCTION = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
# slime's rollout functions that generate from the data source's prompts, and the data sources that read
# --prompt-data (v0.1.0's import path included)
PROMPT_DATA_ROLLOUT_FUNCTIONS = (
    DEFAULT_ROLLOUT_FUNCTION,
    FULLY_ASYNC_ROLLOUT_FUNCTION,
    "slime.rollout.sft_rollout.generate_rollout",
)
DEFAULT_DATA_SOURCES = (
    "slime.rollout.data_source.RolloutDataSourceWithBuffer",
    "slime.rollout.data_source.RolloutDataSource",
    "slime.ray.rollout_data_source.RolloutDataSourceWithBuffer",
    "slime.ray.rollout_data_source.RolloutDataSource",
)


class _Group:
    """An argument group that skips flags already defined, so the user's custom arguments (added first) and
    Megatron's own flags win over slime's definitions of the same name."""

    def __init__(self, parser, title):
        self._parser = parser
        self._group = parser.add_argument_group(title)

    def add_argument(self, *flags, **kwargs):
        if any(f in self._parser._option_string_actions for f in flags):
            return None
        return self._group.add_argument(*flags, **kwargs)


def reset_arg(parser, name, **kwargs):
    """Change the default of an existing (Megatron) option, or add it (slime's defaults for Megatron flags)."""
    for action in parser._actions:
        if name in action.option_strings:
            if "default" in kwargs:
                action.default = kwargs["default"]
                parser.set_defaults(**{action.dest: kwargs["default"]})
            return action
    return parser.add_argument(name, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# slime's own argument groups
# ---------------------------------------------------------------------------------------------------------------


def add_cluster_arguments(parser):
    g = _Group(parser, "cluster")
    g.add_argument("--actor-num-nodes", type=int, default=1, help="Number of nodes for training actors.")
    g.add_argument("--actor-num-gpus-per-node", type=int, default=8, help="GPUs per node for training actors.")
    g.add_argument(
        "--rollout-num-gpus",
        type=int,
        default=None,
        help="GPUs for inference engines in total; forced to the actor total with --colocate.",
    )
    g.add_argument(
        "--rollout-num-gpus-per-engine", type=int, default=1, help="GPUs per inference engine (SGLang's tp size)."
    )
    g.add_argument("--rollout-num-gpus-per-node", type=int, default=8, help="GPUs per node for inference engines.")
    g.add_argument(
        "--colocate",
        action="store_true",
        default=False,
        help="Training and inference share the GPUs (implies --offload).",
    )
    g.add_argument(
        "--offload",
        action="store_true",
        default=False,
        help="Offload training weights/optimizer while rolling out (and engines while training).",
    )
    g.add_argument(
        "--inference-server",
        choices=["auto", "sglang", "cpu"],
        default="auto",
        help="Inference engine: SGLang, or slime's CPU server. auto = sglang when it is installed and a "
        "GPU exists, else cpu. Resolved to sglang|cpu in args.inference_server.",
    )
    return parser


def add_rollout_arguments(parser):
    g = _Group(parser, "rollout")
    g.add_argument(
        "--hf-checkpoint",
        type=str,
        default=None,
        help="HF model dir: inference engine init and tokenizer; Megatron architecture flags not given "
        "are inferred from its config.json.",
    )
    g.add_argument(
        "--model-name",
        type=str,
        default=None,
        help="Model family for Megatron->HF conversion; default: lowercased HF config class name.",
    )
    g.add_argument(
        "--rollout-function-path",
        type=str,
        default=DEFAULT_ROLLOUT_FUNCTION,
        help="generate_rollout(args, rollout_id, data_buffer, evaluation=False) by dotted path.",
    )
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument(
        "--rollout-max-prompt-len",
        type=int,
        default=None,
        help="Drop prompts longer than this (tokens) when the dataset loads.",
    )
    g.add_argument("--rollout-max-response-len", type=int, default=1024, help="max_new_tokens of a rollout.")
    g.add_argument("--rollout-skip-special-tokens", action="store_true", default=False)
    g.add_argument("--rollout-stop", type=str, nargs="+", default=None, help="Stop strings.")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None, help="Stop token ids.")
    g.add_argument("--rollout-shuffle", action="store_true", default=False, help="Shuffle prompts every epoch.")
    g.add_argument("--rollout-seed", type=int, default=42)
    g.add_argument(
        "--over-sampling-batch-size",
        type=int,
        default=None,
        help="Prompts sampled per round with dynamic sampling; default --rollout-batch-size.",
    )
    g.add_argument("--over-sampling-filter-input-size", type=int, default=None)
    g.add_argument("--over-sampling-filter-path", type=str, default=None)
    g.add_argument(
        "--dynamic-sampling-filter-path",
        type=str,
        default=None,
        help="fn(args, samples) -> bool keeping a group, e.g. "
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std.",
    )
    g.add_argument(
        "--partial-rollout",
        action="store_true",
        default=False,
        help="Keep aborted partial generations in the buffer and continue them next rollout.",
    )
    g.add_argument(
        "--custom-generate-function-path",
        type=str,
        default=None,
        help="async generate(args, sample, sampling_params) replacing the default single-turn generate.",
    )
    g.add_argument("--buffer-filter-path", type=str, default=None)
    g.add_argument(
        "--update-weight-buffer-size", type=int, default=512 * 1024**2, help="Bytes per weight-update bucket."
    )
    g.add_argument(
        "--update-weight-transport",
        choices=["auto", "broadcast", "shm"],
        default="auto",
        help="Disaggregated weight sync: 'broadcast' over the weight-update process group (NCCL/gloo); "
        "'shm' hands flattened buckets to the engines as shared-memory handles (CPU, engines on "
        "the trainer's host); 'auto' = shm where it applies (like NCCL's intra-node SHM transport), "
        "else broadcast.",
    )
    g.add_argument("--update-weights-interval", type=int, default=1, help="Rollouts between weight updates (async).")
    g.add_argument(
        "--max-staleness",
        "--max-policy-version-lag",
        dest="max_staleness",
        type=int,
        default=1,
        help="Fully async rollout: no sample trained at policy version v was started before version v-K. "
        "Enforced by pacing the admission of new prompt groups (finished work is never discarded); "
        "0 = on-policy.",
    )
    g.add_argument(
        "--update-weight-timeout",
        type=float,
        default=300,
        help="Seconds a weight update may take before it fails naming the engine.",
    )
    g.add_argument(
        "--check-weight-update-equal",
        action="store_true",
        default=False,
        help="Check the weight push with SGLang's /weights_checker: the engines snapshot the weights "
        "they loaded from --hf-checkpoint and scramble them, and after the first push every engine "
        "must hold exactly the snapshot again (the trainer must start from that checkpoint).",
    )
    g.add_argument("--keep-old-actor", action="store_true", default=False)
    g.add_argument(
        "--rollout-data-postprocess-path",
        type=str,
        default=None,
        help="fn(args, rollout_id, rollout_data) on every trainer rank after log-probs and advantages "
        "(slime v0.1.0's fn(args) also works).",
    )
    g.add_argument(
        "--data-source-path",
        type=str,
        default="slime.rollout.data_source.RolloutDataSourceWithBuffer",
        help="DataSource class built as cls(args); rollout functions receive the instance.",
    )
    g.add_argument(
        "--rollout-sample-hook-path",
        type=str,
        action="append",
        default=[],
        help="hook(args, sample, **kw) -> Sample | None on every generated sample before its reward "
        "(kw: rollout_id, evaluation, as declared). Repeatable; applied in order.",
    )
    g.add_argument(
        "--rollout-sample-filter-path",
        type=str,
        default=None,
        help="fn(args, groups) on the kept groups of the default rollout; sets sample.remove_sample.",
    )
    g.add_argument(
        "--rollout-all-samples-process-path",
        type=str,
        default=None,
        help="fn(args, all_groups, data_source) on every group that finished in the default rollout.",
    )
    g.add_argument(
        "--custom-convert-samples-to-train-data-path",
        type=str,
        default=None,
        help="fn(args, samples) -> train-data dict, replacing the conversion and reward post-processing.",
    )
    g.add_argument(
        "--custom-rollout-log-function-path",
        type=str,
        default=None,
        help="fn(rollout_id, args, samples, rollout_extra_metrics, rollout_time); truthy skips the "
        "default rollout logging.",
    )
    g.add_argument(
        "--custom-eval-rollout-log-function-path",
        type=str,
        default=None,
        help="fn(rollout_id, args, data, extra_metrics); truthy skips the default eval logging.",
    )
    return parser


def add_data_arguments(parser):
    g = _Group(parser, "data")
    g.add_argument("--num-rollout", type=int, default=None, help="Number of rollouts (train steps of the loop).")
    g.add_argument("--num-epoch", type=int, default=None, help="Epochs over --prompt-data (if --num-rollout unset).")
    g.add_argument(
        "--disable-rollout-global-dataset",
        dest="rollout_global_dataset",
        action="store_false",
        default=True,
        help="Do not load --prompt-data (a custom rollout function brings its own).",
    )
    g.add_argument("--prompt-data", type=str, default=None, help="Prompt file (.jsonl/.json/.parquet).")
    g.add_argument("--apply-chat-template", action="store_true", default=False)
    g.add_argument("--input-key", type=str, default="input", help="Column holding the prompt.")
    g.add_argument("--label-key", type=str, default=None)
    g.add_argument("--metadata-key", type=str, default="metadata")
    g.add_argument("--tool-key", type=str, default=None, help="Column with tools for the chat template.")
    g.add_argument("--start-rollout-id", type=int, default=None)
    g.add_argument("--rollout-batch-size", type=int, required=True, help="Prompts per rollout (required).")
    g.add_argument("--n-samples-per-prompt", type=int, default=1)
    reset_arg(
        parser,
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step; rollout-batch-size*n-samples-per-prompt must be a multiple.",
    )
    reset_arg(parser, "--micro-batch-size", type=int, default=1)
    g.add_argument(
        "--num-steps-per-rollout",
        type=int,
        default=None,
        help="Optimizer steps per rollout; sets --global-batch-size.",
    )
    g.add_argument(
        "--balance-data",
        action="store_true",
        default=False,
        help="Balance tokens across DP ranks (Karmarkar-Karp), keeping groups together.",
    )
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False)
    g.add_argument("--max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None)
    return parser


def add_eval_arguments(parser):
    g = _Group(parser, "eval")
    g.add_argument("--eval-function-path", type=str, default=None, help="Default: --rollout-function-path.")
    reset_arg(parser, "--eval-interval", type=int, default=None)
    g.add_argument(
        "--eval-prompt-data",
        type=str,
        nargs="+",
        default=None,
        help="name path [name path ...]; a single path is named 'aime'.",
    )
    g.add_argument("--eval-input-key", type=str, default=None)
    g.add_argument("--eval-label-key", type=str, default=None)
    g.add_argument("--eval-tool-key", type=str, default=None)
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    g.add_argument("--eval-temperature", type=float, default=None)
    g.add_argument("--eval-top-p", type=float, default=None)
    g.add_argument("--eval-top-k", type=int, default=None)
    g.add_argument("--eval-max-response-len", type=int, default=None)
    g.add_argument("--eval-min-new-tokens", type=int, default=None)
    g.add_argument(
        "--eval-custom-rm-path",
        type=str,
        default=None,
        help="The reward function of the default eval (default: --custom-rm-path).",
    )
    g.add_argument(
        "--eval-config",
        type=str,
        default=None,
        help="YAML/JSON file of eval datasets with per-dataset settings (`defaults`, `datasets`); replaces "
        "--eval-prompt-data. See docs/usage.md.",
    )
    return parser


def add_algo_arguments(parser):
    g = _Group(parser, "algorithm")
    g.add_argument(
        "--ref-load",
        type=str,
        default=None,
        help="Reference model checkpoint (also the initial weights when --load has no checkpoint).",
    )
    g.add_argument("--ref-ckpt-step", type=int, default=None)
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None, help="Default: --eps-clip.")
    g.add_argument("--eps-clip-c", type=float, default=None, help="Dual-clip lower bound (> 1).")
    g.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty in the reward (REINFORCE++).")
    g.add_argument("--use-kl-loss", action="store_true", default=False)
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=["kl", "k1", "k2", "k3", "low_var_kl"], default="kl")
    g.add_argument("--loss-type", choices=["policy_loss", "sft_loss", "custom_loss"], default="policy_loss")
    g.add_argument("--custom-loss-function-path", type=str, default=None)
    g.add_argument(
        "--custom-advantage-function-path",
        type=str,
        default=None,
        help="fn(args, rollout_data) setting rollout_data['advantages'] and ['returns'] instead of "
        "--advantage-estimator (rollout_data['kl'] is computed first).",
    )
    g.add_argument(
        "--custom-tis-function-path",
        type=str,
        default=None,
        help="With --use-tis: fn(*, args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, "
        "total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics).",
    )
    g.add_argument(
        "--custom-pg-loss-reducer-function-path",
        type=str,
        default=None,
        help="factory(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reducer "
        "used for pg_loss only (e.g. Dr.GRPO's constant denominator).",
    )
    g.add_argument(
        "--advantage-estimator",
        default="grpo",
        choices=["grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"],
    )
    g.add_argument(
        "--disable-compute-advantages-and-returns",
        dest="compute_advantages_and_returns",
        action="store_false",
        default=True,
    )
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--gamma", type=float, default=1.0)
    g.add_argument("--normalize-advantages", action="store_true", default=False)
    g.add_argument(
        "--disable-grpo-std-normalization",
        dest="grpo_std_normalization",
        action="store_false",
        default=True,
        help="Dr.GRPO: do not divide advantages by the group std.",
    )
    g.add_argument("--disable-rewards-normalization", dest="rewards_normalization", action="store_false", default=True)
    g.add_argument("--use-rollout-entropy", action="store_true", default=False)
    g.add_argument("--use-tis", action="store_true", default=False, help="Truncated importance sampling.")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)
    g.add_argument(
        "--tis-mode",
        choices=["truncate", "mask"],
        default="truncate",
        help="--use-tis weights exp(old - rollout log-prob): 'truncate' clamps them to [--tis-clip-low, "
        "--tis-clip]; 'mask' keeps them inside that range and zeroes the tokens outside (IcePop).",
    )
    return parser


def add_wandb_arguments(parser):
    g = _Group(parser, "wandb")
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
    g.add_argument("--log-multi-turn", action="store_true", default=False)
    g.add_argument("--log-passrate", action="store_true", default=False)
    g.add_argument("--wandb-run-id", type=str, default=None)
    g.add_argument(
        "--metrics-path",
        type=str,
        default=None,
        help="Append per-rollout metrics (rollout/eval/train) as JSON lines to this file.",
    )
    return parser


def add_debug_arguments(parser):
    g = _Group(parser, "debug")
    g.add_argument("--save-debug-rollout-data", type=str, default=None, help="Path format with {rollout_id}.")
    g.add_argument(
        "--load-debug-rollout-data",
        type=str,
        default=None,
        help="Path format with {rollout_id}; implies --debug-train-only.",
    )
    g.add_argument("--debug-rollout-only", action="store_true", default=False, help="No Megatron.")
    g.add_argument("--debug-train-only", action="store_true", default=False, help="No inference engines.")
    g.add_argument("--save-debug-train-data", type=str, default=None, help="Path format with {rollout_id}, {rank}.")
    g.add_argument("--dump-details", type=str, default=None, help="Dir for rollout and train debug dumps.")
    return parser


def add_network_arguments(parser):
    g = _Group(parser, "network")
    g.add_argument("--http-proxy", type=str, default=None)
    g.add_argument("--use-http2", action="store_true", default=False)
    return parser


def add_reward_model_arguments(parser):
    g = _Group(parser, "reward model")
    g.add_argument(
        "--rm-type", type=str, default=None, help="deepscaler | dapo | math | f1 | remote_rm | boxed_<type>."
    )
    g.add_argument("--reward-key", type=str, default=None, help="Key of a dict reward used for training.")
    g.add_argument("--eval-reward-key", type=str, default=None, help="Default: --reward-key.")
    g.add_argument("--group-rm", action="store_true", default=False, help="Reward a whole group at once.")
    g.add_argument("--rm-url", type=str, default=None, help="URL of a remote reward model (remote_rm).")
    g.add_argument("--custom-rm-path", type=str, default=None)
    g.add_argument("--custom-reward-post-process-path", type=str, default=None)
    return parser


def add_rollout_buffer_arguments(parser):
    g = _Group(parser, "rollout buffer")
    g.add_argument("--rollout-buffer-url", type=str, default=None)
    g.add_argument("--fetch-trajectory-retry-times", type=int, default=-1, help="-1 retries forever.")
    g.add_argument("--min-batch-collection-ratio", type=float, default=1)
    g.add_argument("--rollout-task-type", type=str, default="math")
    g.add_argument("--loss-mask-type", choices=["qwen", "distill_qwen"], default="qwen")
    return parser


def add_custom_megatron_hooks_arguments(parser):
    g = _Group(parser, "megatron hooks")
    g.add_argument(
        "--custom-model-provider-path",
        type=str,
        default=None,
        help="provider(pre_process, post_process[, vp_stage]) -> GPTModel, replacing slime's model builder.",
    )
    g.add_argument(
        "--custom-update-weight-post-write-path",
        type=str,
        default=None,
        help="hook(args, version_dir, rollout_engines) after a disk weight sync is written (current slime's "
        "disk transport; not available here).",
    )
    g.add_argument(
        "--megatron-config-path",
        type=str,
        default=None,
        help="YAML `megatron: [{name, role: actor, overrides: {lr: 1e-6, ...}}]` over the command line.",
    )
    g.add_argument(
        "--custom-config-path",
        type=str,
        default=None,
        help="YAML mapping whose entries are set on args after validation (knobs for custom functions).",
    )
    g.add_argument("--custom-megatron-init-path", type=str, default=None, help="fn(args) after Megatron init.")
    g.add_argument(
        "--custom-megatron-before-log-prob-hook-path", type=str, default=None, help="fn(args, model, store_prefix)."
    )
    g.add_argument(
        "--custom-megatron-before-train-step-hook-path",
        type=str,
        default=None,
        help="fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler).",
    )
    return parser


def add_mtp_training_arguments(parser):
    g = _Group(parser, "multi-token prediction")
    reset_arg(parser, "--mtp-num-layers", type=int, default=None)
    reset_arg(parser, "--mtp-loss-scaling-factor", type=float, default=0.2)  # current slime's default
    g.add_argument(
        "--enable-mtp-training",
        action="store_true",
        default=False,
        help="Update the MTP layers' parameters in training (needs --mtp-num-layers).",
    )
    return parser


def add_fault_tolerance_arguments(parser):
    g = _Group(parser, "fault tolerance")
    g.add_argument(
        "--use-fault-tolerance",
        action="store_true",
        default=False,
        help="Replace an inference engine that died or hangs (and restart a dead router) instead of "
        "failing the run; see docs/fault_tolerance.md.",
    )
    g.add_argument(
        "--rollout-health-check-interval",
        type=float,
        default=30.0,
        help="Seconds between two rounds of engine health checks (/health_generate).",
    )
    g.add_argument(
        "--rollout-health-check-timeout",
        type=float,
        default=30.0,
        help="Seconds one engine's /health_generate may take before the engine counts as hung.",
    )
    g.add_argument(
        "--rollout-health-check-first-wait",
        type=float,
        default=0.0,
        help="Grace period before the first health check after each resume (e.g. kernel compilation).",
    )
    g.add_argument(
        "--rollout-request-timeout",
        type=float,
        default=None,
        help="Seconds one /generate request of the default rollout may take; on timeout it is retried, "
        "and counted in rollout/timeouts/requests.",
    )
    g.add_argument(
        "--rollout-group-timeout",
        type=float,
        default=None,
        help="Seconds one prompt group of the default rollout may take; a group over it is dropped "
        "(logged, counted in rollout/timeouts/groups) and its prompt is served again.",
    )
    return parser


def add_ci_arguments(parser):
    g = _Group(parser, "ci")
    g.add_argument("--ci-test", action="store_true", default=False, help="Assert on first-step metrics.")
    return parser


def add_custom_megatron_plugins_arguments(parser):
    g = _Group(parser, "megatron plugins")
    g.add_argument("--post-self-attn-layernorm", action="store_true", default=False, help="GLM4 extra norm.")
    g.add_argument("--post-mlp-layernorm", action="store_true", default=False, help="GLM4 extra norm.")
    return parser


def get_slime_extra_args_provider(add_custom_arguments=None):
    def add_slime_arguments(parser):
        if add_custom_arguments is not None:
            add_custom_arguments(parser)  # first, so it can pre-empt slime's names
        for add in (
            add_cluster_arguments,
            add_rollout_arguments,
            add_data_arguments,
            add_eval_arguments,
            add_algo_arguments,
            add_wandb_arguments,
            add_debug_arguments,
            add_sglang_arguments,
            add_network_arguments,
            add_reward_model_arguments,
            add_rollout_buffer_arguments,
            add_custom_megatron_hooks_arguments,
            add_fault_tolerance_arguments,
            add_ci_arguments,
            add_custom_megatron_plugins_arguments,
            add_mtp_training_arguments,
        ):
            add(parser)
        if "--padded-vocab-size" not in parser._option_string_actions:
            parser.add_argument("--padded-vocab-size", type=int, default=None)
        return parser

    return add_slime_arguments


# ---------------------------------------------------------------------------------------------------------------
# Megatron-LM-compatible flags, for when megatron.training is not importable (megatron-core wheel only)
# ---------------------------------------------------------------------------------------------------------------


def moe_freq_type(x):
    """Megatron's `--moe-layer-freq`: an int N (every N-th layer is MoE) or a list expression like "[0]*3+[1]*58"."""
    if isinstance(x, int):
        return x
    x = x.strip()
    if x.isdigit():
        return int(x)
    if not re.fullmatch(r"[\[\]\d\s,*+()]+", x):
        raise argparse.ArgumentTypeError(f"{x!r} is neither an int nor a list expression like [0]*3+[1]*58")
    try:
        value = eval(x, {"__builtins__": {}}, {})  # charset checked above: digits, brackets, * + , only
    except Exception as e:
        raise argparse.ArgumentTypeError(f"cannot evaluate {x!r}: {e}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"{x!r} does not evaluate to a list")
    return value


def add_megatron_arguments(parser):
    """Megatron-LM flag names, meanings and defaults (a default of None below is resolved later where Megatron's
    default depends on the machine or on the HF config: see `_megatron_defaults`)."""
    g = parser.add_argument_group("megatron: model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--encoder-num-layers", type=int, default=None)
    g.add_argument("--decoder-num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument(
        "--ffn-hidden-size",
        type=int,
        default=None,
        help="Default 4*hidden (swiglu: 8/3*hidden rounded down to a multiple of 64).",
    )
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", type=int, default=None, help="Head dim; default hidden/heads.")
    g.add_argument("--group-query-attention", action="store_true", default=False)
    g.add_argument("--num-query-groups", type=int, default=1)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="Default --seq-length.")
    g.add_argument("--seq-length", type=int, default=None, help="Default 4096 (slime packs variable lengths).")
    g.add_argument(
        "--position-embedding-type",
        choices=["learned_absolute", "rope", "mrope", "relative", "none"],
        default="learned_absolute",
    )
    g.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        default=False,
        help="Same as --position-embedding-type rope.",
    )
    g.add_argument("--rotary-base", type=int, default=None, help="RoPE theta (default 10000).")
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--rotary-interleaved", action="store_true", default=False)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None)
    g.add_argument("--use-rope-scaling", action="store_true", default=False, help="Llama-3.x RoPE scaling.")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0)
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None, help="Default: yarn with MLA, else rope.")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false", default=True)
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false", default=True)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=None, help="Default 1e-5.")
    g.add_argument("--apply-layernorm-1p", action="store_true", default=False)
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true", default=False)
    g.add_argument("--openai-gelu", action="store_true", default=False)
    g.add_argument("--squared-relu", action="store_true", default=False)
    g.add_argument("--swiglu", action="store_true", default=False)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=False)
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false", default=True)
    g.add_argument("--add-qkv-bias", action="store_true", default=False)
    g.add_argument("--qk-layernorm", action="store_true", default=False)
    g.add_argument(
        "--attention-dropout",
        type=float,
        default=None,
        help="Default: the HF config's attention dropout (0.0 for Qwen/Llama), else Megatron's 0.1.",
    )
    g.add_argument(
        "--hidden-dropout",
        type=float,
        default=None,
        help="Default: the HF config's hidden dropout (0.0 when it has none), else Megatron's 0.1.",
    )
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--use-cpu-initialization", action="store_true", default=None)
    g.add_argument(
        "--transformer-impl",
        choices=["local", "transformer_engine"],
        default=None,
        help="Default transformer_engine on GPU, local on CPU.",
    )
    g.add_argument("--spec", type=str, nargs="*", default=None, help="Module and function of a custom layer spec.")
    g.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"], default="auto")
    g.add_argument("--attention-softmax-in-fp32", action="store_true", default=False)
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true", default=False)
    g.add_argument("--use-flash-attn", action="store_true", default=False)
    g.add_argument("--use-mcore-models", action="store_true", default=False, help="Deprecated no-op (mcore is used).")
    g.add_argument("--use-legacy-models", action="store_true", default=False)
    g.add_argument("--multi-latent-attention", action="store_true", default=False)
    g.add_argument("--q-lora-rank", type=int, default=None)
    g.add_argument("--kv-lora-rank", type=int, default=32)
    g.add_argument("--qk-head-dim", type=int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--rotary-scaling-factor", type=float, default=1.0)
    g.add_argument("--mscale", type=float, default=1.0)
    g.add_argument("--mscale-all-dim", type=float, default=0.0)
    for flag, dest in (
        ("--no-masked-softmax-fusion", "masked_softmax_fusion"),
        ("--no-bias-gelu-fusion", "bias_gelu_fusion"),
        ("--no-bias-swiglu-fusion", "bias_swiglu_fusion"),
        ("--no-bias-dropout-fusion", "bias_dropout_fusion"),
        ("--no-persist-layer-norm", "persist_layer_norm"),
        ("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion"),
    ):
        g.add_argument(flag, dest=dest, action="store_false", default=None if "gradient" in flag else True)
    g.add_argument("--cross-entropy-loss-fusion", action="store_true", default=False)
    g.add_argument(
        "--mtp-num-layers", type=int, default=None, help="Multi-token-prediction layers (MiMo, DeepSeek-V3)."
    )
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1, help="Weight of the MTP loss.")

    g = parser.add_argument_group("megatron: mixture of experts")
    g.add_argument("--num-experts", type=int, default=None)
    g.add_argument("--moe-layer-freq", type=moe_freq_type, default=1)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="Default --ffn-hidden-size.")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None)
    g.add_argument("--moe-shared-expert-overlap", action="store_true", default=False)
    g.add_argument(
        "--moe-router-load-balancing-type",
        default="aux_loss",
        choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
    )
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-pre-softmax", action="store_true", default=False)
    g.add_argument("--moe-router-num-groups", type=int, default=None)
    g.add_argument("--moe-router-group-topk", type=int, default=None)
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None)
    g.add_argument("--moe-router-enable-expert-bias", action="store_true", default=False)
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None)
    g.add_argument("--moe-grouped-gemm", action="store_true", default=False)
    g.add_argument("--moe-use-legacy-grouped-gemm", action="store_true", default=False)
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-input-jitter-eps", type=float, default=None)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    g.add_argument("--moe-enable-deepep", action="store_true", default=False)
    g.add_argument("--moe-per-layer-logging", action="store_true", default=False)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None)
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true", default=False)
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs")
    g.add_argument("--moe-permute-fusion", action="store_true", default=False)
    g.add_argument("--moe-layer-recompute", action="store_true", default=False)

    g = parser.add_argument_group("megatron: parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true", default=False)
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true", default=False)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["p2p"],
        choices=["p2p", "all_gather", "a2a"],
        help="Transformer Engine's CP attention exchange, one for all layers or one per layer. Without TE "
        "(CPU) CP attention always all-gathers keys and values.",
    )
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument(
        "--expert-tensor-parallel-size", type=int, default=None, help="Default --tensor-model-parallel-size."
    )
    g.add_argument("--sequence-parallel", action="store_true", default=False)
    g.add_argument("--use-distributed-optimizer", action="store_true", default=False)
    g.add_argument("--overlap-grad-reduce", action="store_true", default=False)
    g.add_argument("--overlap-param-gather", action="store_true", default=False)
    g.add_argument("--tp-comm-overlap", action="store_true", default=False)
    g.add_argument(
        "--distributed-backend", choices=["nccl", "gloo"], default=None, help="Default nccl on GPU, gloo on CPU."
    )
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)
    g.add_argument("--local-rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")))

    g = parser.add_argument_group("megatron: optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument(
        "--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"], default="linear"
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float, default=None)
    g.add_argument("--end-weight-decay", type=float, default=None)
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    # Megatron-LM's spelling first; the all-hyphen one is accepted too
    g.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        default=False,
        help="On --load, recompute the LR/WD schedule from this run's flags.",
    )
    g.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        default=False,
        help="On --load, keep the checkpoint's LR/WD schedule.",
    )
    g.add_argument("--optimizer-cpu-offload", action="store_true", default=False)
    g.add_argument("--optimizer-offload-fraction", type=float, default=1.0)
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true", default=False)
    g.add_argument("--use-precision-aware-optimizer", action="store_true", default=False)

    g = parser.add_argument_group("megatron: precision")
    g.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 training; default on with a GPU, off on CPU.",
    )
    g.add_argument("--fp16", action="store_true", default=False)
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=float, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None)

    g = parser.add_argument_group("megatron: training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--recompute-activations", action="store_true", default=False)
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-modules", type=str, nargs="*", default=None)
    g.add_argument("--calculate-per-token-loss", action="store_true", default=False)
    g.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        default=True,
    )
    g.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false", default=True)
    g.add_argument("--data-parallel-random-init", action="store_true", default=False)
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--manual-gc", action="store_true", default=False)
    g.add_argument("--manual-gc-interval", type=int, default=0)
    g.add_argument("--deterministic-mode", action="store_true", default=False)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=int, default=None)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--log-timers-to-tensorboard", action="store_true", default=False)
    g.add_argument("--log-params-norm", action="store_true", default=False)
    g.add_argument("--log-num-zeros-in-grad", action="store_true", default=False)
    g.add_argument("--log-throughput", action="store_true", default=False)
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0)
    g.add_argument("--wandb-project", type=str, default="")
    g.add_argument("--wandb-exp-name", type=str, default="")
    g.add_argument("--wandb-save-dir", type=str, default="")

    g = parser.add_argument_group("megatron: checkpointing")
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true", default=None)
    g.add_argument("--no-save-rng", action="store_true", default=None)
    g.add_argument("--no-load-optim", action="store_true", default=None)
    g.add_argument("--no-load-rng", action="store_true", default=None)
    g.add_argument("--finetune", action="store_true", default=False)
    g.add_argument("--ckpt-step", type=int, default=None)
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist", "zarr", "torch_dcp"], default="torch_dist")
    g.add_argument("--pretrained-checkpoint", type=str, default=None)
    g.add_argument("--use-checkpoint-args", action="store_true", default=False)
    g.add_argument("--exit-on-missing-checkpoint", action="store_true", default=False)
    g.add_argument("--auto-detect-ckpt-format", action="store_true", default=False)
    g.add_argument(
        "--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false", default=True
    )
    g.add_argument("--ckpt-fully-parallel-load", action="store_true", default=False)
    g.add_argument("--async-save", action="store_true", default=None)
    g.add_argument("--ckpt-assume-constant-structure", action="store_true", default=False)
    g.add_argument("--dist-ckpt-strictness", type=str, default="assume_ok_unexpected")
    g.add_argument("--non-persistent-save-interval", type=int, default=None)

    g = parser.add_argument_group("megatron: tokenizer and data")
    g.add_argument(
        "--tokenizer-type",
        type=str,
        default=None,
        choices=[
            "BertWordPieceLowerCase",
            "BertWordPieceCase",
            "GPT2BPETokenizer",
            "SentencePieceTokenizer",
            "GPTSentencePieceTokenizer",
            "HuggingFaceTokenizer",
            "Llama2Tokenizer",
            "TikTokenizer",
            "MultimodalTokenizer",
            "NullTokenizer",
            "NullMultimodalTokenizer",
        ],
    )
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default=None)
    g.add_argument("--num-workers", type=int, default=2)
    return parser


# ---------------------------------------------------------------------------------------------------------------
# HF config -> Megatron architecture (inference and consistency check)
# ---------------------------------------------------------------------------------------------------------------


def _rope_theta(cfg):
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    return theta


def _rope_parameters(cfg) -> dict:
    """RoPE settings of an HF config: transformers 5 keeps them (theta, scaling, partial rotary) in
    `rope_parameters`; older configs have `rope_scaling` and top-level `partial_rotary_factor`."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    if getattr(cfg, "partial_rotary_factor", None) is not None:
        rope.setdefault("partial_rotary_factor", cfg.partial_rotary_factor)
    return rope


# RoPE-scaling parameters Megatron hard-codes (llama3 scaler; MLA yarn defaults): an HF config with other values
# cannot be trained faithfully, so it is refused at start-up.
_FIXED_ROPE_PARAMS = {
    "llama3": {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
}


def _hf_architecture(cfg) -> dict:
    """Megatron flag values (by dest) that describe the HF model `cfg` (Qwen2/3, Llama 2/3, Qwen3-MoE, GLM-4,
    GLM-4.5, DeepSeek-V3, MiMo). Raises ValueError for HF settings Megatron cannot reproduce."""
    model_type = getattr(cfg, "model_type", "") or ""
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    rope = _rope_parameters(cfg)
    arch = {
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": getattr(cfg, "intermediate_size", None),
        "num_attention_heads": heads,
        "group_query_attention": kv_heads != heads,
        "num_query_groups": kv_heads,
        "kv_channels": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "norm_epsilon": getattr(cfg, "rms_norm_eps", None),
        "rotary_base": _rope_theta(cfg),
        "untie_embeddings_and_output_weights": not getattr(cfg, "tie_word_embeddings", False),
        "swiglu": getattr(cfg, "hidden_act", None) == "silu",
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "qk_layernorm": model_type.startswith("qwen3") or bool(getattr(cfg, "use_qk_norm", False)),
        "add_qkv_bias": model_type in ("qwen2", "qwen2_moe", "mimo") or bool(getattr(cfg, "attention_bias", False)),
        "add_bias_linear": False,
        "position_embedding_type": "rope",
        "rotary_percent": float(rope.get("partial_rotary_factor", 1.0)),
        "use_rope_scaling": rope["rope_type"] == "llama3",
    }
    if arch["norm_epsilon"] is not None:
        arch["normalization"] = "RMSNorm"
    if arch["rotary_base"] is not None:
        arch["rotary_base"] = int(arch["rotary_base"])
    fixed = _FIXED_ROPE_PARAMS.get(rope["rope_type"], {})
    for key, value in fixed.items():
        if key in rope and float(rope[key]) != float(value):
            raise ValueError(
                f"rope_parameters.{key}={rope[key]} ({rope['rope_type']} RoPE): Megatron-Core only "
                f"implements {key}={value}"
            )
    if rope["rope_type"] not in ("default", "llama3") and not (
        rope["rope_type"] == "yarn" and model_type == "deepseek_v3"
    ):
        raise ValueError(f"rope_parameters.rope_type={rope['rope_type']!r} is not supported for {model_type!r}")
    if arch["use_rope_scaling"]:
        arch["rope_scaling_factor"] = float(rope.get("factor", 8.0))
    if model_type == "glm4":  # every layer has post-attention and post-MLP norms; RoPE pairs are interleaved
        arch.update(post_self_attn_layernorm=True, post_mlp_layernorm=True, rotary_interleaved=True)
    if model_type == "deepseek_v3":
        arch.update(
            multi_latent_attention=True,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_head_dim=cfg.qk_nope_head_dim,
            qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim,
            kv_channels=cfg.v_head_dim,
            qk_layernorm=True,
            rope_type="yarn" if rope["rope_type"] == "yarn" else "rope",
        )
        if rope["rope_type"] == "yarn":
            arch.update(
                rotary_scaling_factor=float(rope["factor"]),
                mscale=float(rope.get("mscale", 1.0)),
                mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
            )
    if getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None):
        arch.update(
            num_experts=getattr(cfg, "num_experts", None) or cfg.num_local_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None) or arch["ffn_hidden_size"],
        )
        if getattr(cfg, "shared_expert_intermediate_size", None):
            arch["moe_shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    if getattr(cfg, "n_routed_experts", None):  # DeepSeek-V3 / GLM-4.5 routing
        if not getattr(cfg, "norm_topk_prob", True):
            raise ValueError("norm_topk_prob=False: Megatron-Core always renormalises sigmoid top-k scores")
        first_dense = getattr(cfg, "first_k_dense_replace", 0) or 0
        groups = getattr(cfg, "n_group", None) or 1
        arch.update(
            num_experts=cfg.n_routed_experts,
            moe_router_topk=cfg.num_experts_per_tok,
            moe_ffn_hidden_size=cfg.moe_intermediate_size,
            moe_layer_freq=[0] * first_dense + [1] * (cfg.num_hidden_layers - first_dense),
            moe_shared_expert_intermediate_size=(cfg.n_shared_experts or 0) * cfg.moe_intermediate_size or None,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_pre_softmax=True,
            moe_router_dtype="fp32",
            moe_router_topk_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0)),
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=cfg.topk_group if groups > 1 else None,
        )
    return arch


# (HF attribute shown in messages, Megatron flag, dest): pairs that must agree (flags given next to --hf-checkpoint),
# RoPE variants, MoE routing and MLA dimensions included.
_HF_CHECKS = (
    ("hidden_size", "--hidden-size", "hidden_size"),
    ("num_attention_heads", "--num-attention-heads", "num_attention_heads"),
    ("num_hidden_layers", "--num-layers", "num_layers"),
    ("intermediate_size", "--ffn-hidden-size", "ffn_hidden_size"),
    ("tie_word_embeddings", "--untie-embeddings-and-output-weights", "untie_embeddings_and_output_weights"),
    ("rms_norm_eps", "--norm-epsilon", "norm_epsilon"),
    ("rope_theta", "--rotary-base", "rotary_base"),
    ("num_key_value_heads", "--num-query-groups", "num_query_groups"),
    ("rope_parameters.partial_rotary_factor", "--rotary-percent", "rotary_percent"),
    ("rope_parameters.rope_type", "--use-rope-scaling", "use_rope_scaling"),
    ("rope_parameters.factor", "--rope-scaling-factor", "rope_scaling_factor"),
    ("attention_bias", "--add-qkv-bias", "add_qkv_bias"),
    ("use_qk_norm", "--qk-layernorm", "qk_layernorm"),
    ("model_type", "--post-self-attn-layernorm", "post_self_attn_layernorm"),
    ("model_type", "--post-mlp-layernorm", "post_mlp_layernorm"),
    ("model_type", "--rotary-interleaved", "rotary_interleaved"),
    ("num_experts", "--num-experts", "num_experts"),
    ("num_experts_per_tok", "--moe-router-topk", "moe_router_topk"),
    ("moe_intermediate_size", "--moe-ffn-hidden-size", "moe_ffn_hidden_size"),
    (
        "n_shared_experts*moe_intermediate_size",
        "--moe-shared-expert-intermediate-size",
        "moe_shared_expert_intermediate_size",
    ),
    ("first_k_dense_replace", "--moe-layer-freq", "moe_layer_freq"),
    ("scoring", "--moe-router-score-function", "moe_router_score_function"),
    ("e_score_correction_bias", "--moe-router-enable-expert-bias", "moe_router_enable_expert_bias"),
    ("routed_scaling_factor", "--moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor"),
    ("n_group", "--moe-router-num-groups", "moe_router_num_groups"),
    ("topk_group", "--moe-router-group-topk", "moe_router_group_topk"),
    ("model_type", "--multi-latent-attention", "multi_latent_attention"),
    ("q_lora_rank", "--q-lora-rank", "q_lora_rank"),
    ("kv_lora_rank", "--kv-lora-rank", "kv_lora_rank"),
    ("qk_nope_head_dim", "--qk-head-dim", "qk_head_dim"),
    ("qk_rope_head_dim", "--qk-pos-emb-head-dim", "qk_pos_emb_head_dim"),
    ("v_head_dim", "--v-head-dim", "v_head_dim"),
    ("rope_parameters.factor", "--rotary-scaling-factor", "rotary_scaling_factor"),
    ("rope_parameters.mscale", "--mscale", "mscale"),
    ("rope_parameters.mscale_all_dim", "--mscale-all-dim", "mscale_all_dim"),
)
_BOOL_FLAGS = {
    "untie_embeddings_and_output_weights",
    "use_rope_scaling",
    "add_qkv_bias",
    "qk_layernorm",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
    "rotary_interleaved",
    "multi_latent_attention",
    "moe_router_enable_expert_bias",
}


def _layer_pattern(freq, num_layers):
    """`--moe-layer-freq` as a per-layer 0/1 list."""
    return list(freq) if isinstance(freq, list) else [1 if i % freq == 0 else 0 for i in range(num_layers)]


def _hf_mismatches(args, arch, cfg):
    """'--flag mine but hf_key=theirs' for every checked flag the user set differently from the HF config."""
    out = []
    for hf_name, flag, dest in _HF_CHECKS:
        hf_value = arch.get(dest)
        mine = getattr(args, dest)
        if dest == "num_query_groups" and not args.group_query_attention:
            mine = args.num_attention_heads
        if dest == "rope_scaling_factor" and not arch.get("use_rope_scaling"):
            continue
        if dest == "moe_layer_freq" and hf_value is not None and args.num_layers:
            mine = _layer_pattern(mine, args.num_layers)
            if mine != hf_value:
                out.append(f"{flag} {mine} but first_k_dense_replace={hf_value.count(0)}")
            continue
        if dest in _BOOL_FLAGS:
            if hf_value is not None and bool(mine) != bool(hf_value):
                shown = {
                    "untie_embeddings_and_output_weights": not hf_value,
                    "use_rope_scaling": _rope_parameters(cfg)["rope_type"],
                }.get(dest, cfg.model_type if hf_name == "model_type" else hf_value)
                out.append(f"{flag} is {'set' if mine else 'not set'} but {hf_name}={shown}")
            continue
        if hf_value is None or mine is None:
            continue
        if (
            abs(float(mine) - float(hf_value)) > 1e-12 * max(1.0, abs(float(hf_value)))
            if isinstance(hf_value, float) or isinstance(mine, float)
            else mine != hf_value
        ):
            out.append(f"{flag} {mine} but {hf_name}={hf_value}")
    return out


# HF config keys of the dropout probabilities, per Megatron flag; a config without any has no such dropout.
_HF_DROPOUT_KEYS = {
    "attention_dropout": ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"),
    "hidden_dropout": ("hidden_dropout", "hidden_dropout_prob", "resid_pdrop"),
}


def _dropout_from_hf(args, cfg, given):
    """Megatron's default dropout (0.1) is not what the HF model was trained with and perturbs RL's first-step
    invariants: flags the user did not give take the HF config's value."""
    for dest, keys in _HF_DROPOUT_KEYS.items():
        flag = "--" + dest.replace("_", "-")
        if flag in given:
            continue
        value = next((float(getattr(cfg, k)) for k in keys if getattr(cfg, k, None) is not None), 0.0)
        setattr(args, dest, value)
        logger.info(
            "%s %s taken from --hf-checkpoint %s/config.json (flag not given)", flag, value, args.hf_checkpoint
        )


def _given_flags(argv):
    """Option strings present on the command line (`--x v` and `--x=v`)."""
    return {a.split("=", 1)[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}


def _apply_hf_config(args, error, check_paths, given=frozenset()):
    """Fill Megatron architecture flags the user did not give from `--hf-checkpoint`'s config.json, and check
    that the ones given agree with it. Also defaults `--model-name` to the lowercased HF config class name and
    the dropout flags not given to the HF config's dropout."""
    path = args.hf_checkpoint
    if not os.path.exists(path) and not check_paths:
        return  # dry run of a launch script for another machine: nothing to read
    from transformers import AutoConfig  # heavy

    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=True)
    except Exception as e:
        error(
            f"--hf-checkpoint {path}: cannot read an HF model config there ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Point it at a directory with config.json."
        )
    if args.model_name is None:
        args.model_name = type(cfg).__name__.lower()
    _dropout_from_hf(args, cfg, given)
    if not hasattr(cfg, "num_hidden_layers") or not hasattr(cfg, "num_attention_heads"):
        return  # not a decoder LLM config we know how to map; Megatron flags must be given
    try:
        arch = _hf_architecture(cfg)
    except ValueError as e:
        error(f"--hf-checkpoint {path}/config.json: {e}.")
    infer_all = args.num_layers is None  # no MODEL_ARGS at all: the HF config is the whole description
    for dest, value in arch.items():
        if value is None or not hasattr(args, dest):
            continue
        if infer_all or getattr(args, dest) is None:
            setattr(args, dest, value)
    mismatches = _hf_mismatches(args, arch, cfg)
    if getattr(cfg, "num_nextn_predict_layers", 0):
        logger.info(
            "--hf-checkpoint %s has %d multi-token-prediction layer(s) (num_nextn_predict_layers): slime does "
            "not train them (no MTP block is built): the inference engine keeps the checkpoint's MTP weights "
            "and weight updates pass them through untouched.",
            path,
            cfg.num_nextn_predict_layers,
        )
    if mismatches:
        error(
            f"Megatron model flags disagree with --hf-checkpoint {path}/config.json: {'; '.join(mismatches)}. "
            "Fix the MODEL_ARGS (or drop them to infer everything from the HF config)."
        )


# ---------------------------------------------------------------------------------------------------------------
# Defaults and validation
# ---------------------------------------------------------------------------------------------------------------


def _vocab_size_with_padding(vocab_size, args):
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return (vocab_size + multiple - 1) // multiple * multiple


def set_default_megatron_args(args):
    """Megatron defaults slime sets after parsing (bf16 only with a GPU: CPU training runs in fp32)."""
    args.use_distributed_optimizer = True
    if args.bf16 is None:
        args.bf16 = bf16_by_default() and not args.fp16
    if args.seq_length is None:
        args.seq_length = 4096
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.rope_type is None:
        args.rope_type = "yarn" if args.multi_latent_attention else "rope"
    if args.vocab_size and not args.padded_vocab_size:
        args.padded_vocab_size = _vocab_size_with_padding(args.vocab_size, args)
    if not args.tokenizer_model and not args.tokenizer_type:
        args.tokenizer_model = args.hf_checkpoint
        args.tokenizer_type = "HuggingFaceTokenizer"
    return args


def _checkpoint_exists(path):
    return path is not None and os.path.exists(os.path.join(path, "latest_checkpointed_iteration.txt"))


def slime_validate_args(args, error, check_paths=True, asynchronous=False):
    """slime's flag rules (its `slime_validate_args`, in its order) plus `--save-interval` needs `--save`, the
    cluster shape and the combinations the loss and the default rollout cannot run with. `asynchronous`: the job is
    train_async.py's (no colocation)."""
    check_value_ranges(args, error)  # first: the arithmetic below divides by these
    # KL needs the reference checkpoint. Without --ref-load the initial weights (--hf-checkpoint) are the reference.
    if (args.kl_coef != 0 or args.use_kl_loss) and args.ref_load is not None and check_paths:
        if not os.path.exists(args.ref_load):
            error(f"--ref-load {args.ref_load} does not exist (needed by --use-kl-loss / --kl-coef).")
        if not _checkpoint_exists(args.ref_load):
            logger.warning("--ref-load %s has no latest_checkpointed_iteration.txt", args.ref_load)
    # Nothing to resume from: start from the reference weights, fresh optimizer.
    if args.load is None or (check_paths and not _checkpoint_exists(args.load)):
        args.no_load_optim = args.no_load_rng = args.finetune = True
        args.load = args.ref_load
        if args.ref_ckpt_step is not None:
            args.ckpt_step = args.ref_ckpt_step
        if args.start_rollout_id is None:
            args.start_rollout_id = 0
    # eval data: an --eval-config file (it replaces --eval-prompt-data), or name/path pairs
    args.eval_datasets = None
    if args.eval_config and (check_paths or os.path.exists(args.eval_config)):
        args.eval_datasets = load_eval_config(args.eval_config, args, error)
        args.eval_prompt_data = [x for d in args.eval_datasets for x in (d.name, d.path)]
    if args.eval_interval is not None and not args.eval_prompt_data:
        error("--eval-interval needs --eval-prompt-data (name path [name path ...]) or --eval-config.")
    if args.eval_prompt_data is not None and args.eval_datasets is None:
        if len(args.eval_prompt_data) == 1:
            args.eval_prompt_data = ["aime", args.eval_prompt_data[0]]
        if len(args.eval_prompt_data) % 2 != 0:
            error(
                f"--eval-prompt-data takes name/path pairs; got {len(args.eval_prompt_data)} values: "
                f"{' '.join(args.eval_prompt_data)}"
            )
        args.eval_datasets = from_prompt_data(args)
    # one KL at a time
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        error("--kl-coef (KL in the reward) and --kl-loss-coef (KL loss) cannot both be non-zero; pick one.")
    # REINFORCE++ advantages are only meaningful whitened
    if (
        args.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
        and not args.normalize_advantages
    ):
        error(f"--advantage-estimator {args.advantage_estimator} requires --normalize-advantages.")
    # dynamic batches are sized in tokens
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        error("--use-dynamic-batch-size requires --max-tokens-per-gpu.")
    if args.log_probs_max_tokens_per_gpu is None:
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu
    # clip defaults and the dual-clip bound
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.eps_clip_c is not None and args.eps_clip_c <= 1.0:
        error(f"--eps-clip-c {args.eps_clip_c}: the dual-clip lower bound must be > 1.")
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key
    # --dump-details is shorthand for both debug dumps
    if args.dump_details is not None:
        args.save_debug_rollout_data = os.path.join(args.dump_details, "rollout_data", "{rollout_id}.pt")
        args.save_debug_train_data = os.path.join(args.dump_details, "train_data", "{rollout_id}_{rank}.pt")
    # replaying rollouts means no engines
    if args.load_debug_rollout_data is not None:
        args.debug_train_only = True
    # checked before the resizing below so the message names the real conflict
    if args.debug_rollout_only and args.debug_train_only:
        error("--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) are mutually exclusive.")
    actor_total = args.actor_num_nodes * args.actor_num_gpus_per_node
    # rollout-only runs size the "actors" to the engines and never offload
    if args.debug_rollout_only:
        if args.colocate and args.rollout_num_gpus is None:
            args.rollout_num_gpus = actor_total
        elif args.rollout_num_gpus is None:
            error("--debug-rollout-only needs --rollout-num-gpus (or --colocate) to size the inference engines.")
        else:
            args.actor_num_gpus_per_node = min(8, args.rollout_num_gpus)
            args.actor_num_nodes = args.rollout_num_gpus // args.actor_num_gpus_per_node
        args.colocate = args.offload = False
    if asynchronous and (args.colocate or args.offload):
        error(
            f"{'--colocate' if args.colocate else '--offload'}: train_async.py overlaps generation with training, so "
            "the trainers and the engines cannot share GPUs; drop it, or use train.py for a colocated run."
        )
    # colocated engines use exactly the actor GPUs and must offload
    if args.colocate:
        args.offload = True
        if args.rollout_num_gpus != actor_total:
            if args.rollout_num_gpus is not None:
                logger.warning(
                    "--colocate: rollout_num_gpus %s -> %s (the actor GPUs)", args.rollout_num_gpus, actor_total
                )
            args.rollout_num_gpus = actor_total
    if not args.debug_train_only:
        if args.rollout_num_gpus is None:
            error("--rollout-num-gpus is required unless --colocate or --debug-train-only.")
        if args.rollout_num_gpus % args.rollout_num_gpus_per_engine != 0:
            error(
                f"--rollout-num-gpus {args.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
                f"{args.rollout_num_gpus_per_engine}."
            )
    # eval uses the rollout function unless told otherwise
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    # batch arithmetic: a rollout splits into whole optimizer steps
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None:
        gbs = samples // args.num_steps_per_rollout
        if args.global_batch_size is not None and args.global_batch_size != gbs:
            error(
                f"--global-batch-size {args.global_batch_size} contradicts --num-steps-per-rollout "
                f"{args.num_steps_per_rollout} (rollout-batch-size*n-samples-per-prompt/steps = {gbs})."
            )
        if gbs == 0 or samples % args.num_steps_per_rollout != 0:
            error(
                f"--num-steps-per-rollout {args.num_steps_per_rollout} does not divide rollout-batch-size*"
                f"n-samples-per-prompt = {samples}."
            )
        args.global_batch_size = gbs
    if args.global_batch_size is None:
        if not args.debug_rollout_only:
            error("--global-batch-size (or --num-steps-per-rollout) is required.")
    elif samples % args.global_batch_size != 0:
        error(
            f"--rollout-batch-size {args.rollout_batch_size} x --n-samples-per-prompt {args.n_samples_per_prompt} "
            f"= {samples} samples is not divisible by --global-batch-size {args.global_batch_size}."
        )
    # a group of one has no std
    if args.n_samples_per_prompt == 1:
        args.grpo_std_normalization = False
    # over-sampling submits at least a batch
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    if args.over_sampling_batch_size < args.rollout_batch_size:
        error(
            f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{args.rollout_batch_size}."
        )
    # how long to train
    if args.num_epoch is not None:
        if args.num_rollout is not None:
            logger.warning("Both --num-epoch and --num-rollout are set; --num-epoch is ignored.")
        elif not args.rollout_global_dataset:
            error("--num-epoch needs the global dataset (drop --disable-rollout-global-dataset or use --num-rollout).")
    elif args.num_rollout is None:
        error("one of --num-rollout or --num-epoch is required.")
    if args.save_interval is not None and args.save is None:
        error("--save-interval requires --save (the checkpoint directory).")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        error(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other: "
            "recompute the LR schedule from this run's flags, or keep the checkpoint's, not both."
        )
    _validate_algorithm_and_rollout(args, error)
    _check_mtp(args, error)
    if args.custom_tis_function_path and not args.use_tis:
        error(f"--custom-tis-function-path {args.custom_tis_function_path} is called only with --use-tis; add it.")
    if args.custom_update_weight_post_write_path:
        error(
            "--custom-update-weight-post-write-path runs after current slime's disk weight transport writes a "
            "weight version; this slime sends weights by broadcast, shared memory or CUDA IPC and never writes "
            "one: drop the flag."
        )
    _apply_custom_config(args, error, check_paths)


def _read_yaml(flag, path, error):
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        error(f"{flag} {path}: cannot read it as YAML ({type(e).__name__}: {e})")


def _apply_megatron_config(args, error, check_paths):
    """--megatron-config-path: YAML `megatron: [{name, role, overrides: {dest: value}}]`; the actor role's overrides
    replace the command-line values (the trainers are the only Megatron role here). Returns the keys set."""
    path = args.megatron_config_path
    if not path or (not check_paths and not os.path.exists(path)):
        return []
    config = _read_yaml("--megatron-config-path", path, error)
    roles = config.get("megatron") if isinstance(config, dict) else None
    if not isinstance(roles, list) or not all(isinstance(r, dict) for r in roles):
        error(f"--megatron-config-path {path}: expected a top-level list `megatron: [{{name, role, overrides}}]`")
    if len({r.get("role", "actor") for r in roles}) != len(roles):
        error(f"--megatron-config-path {path}: at most one entry per role")
    overridden = []
    for entry in roles:
        role = entry.get("role", "actor")
        if role != "actor":
            error(f"--megatron-config-path {path}: role {role!r}: this slime trains only the actor (no critic / PPO)")
        overrides = entry.get("overrides", entry.get("args")) or {}
        for key, value in overrides.items():
            if key in ("num_nodes", "num_gpus_per_node"):  # cluster shape comes from the command line
                continue
            if not hasattr(args, key):
                error(f"--megatron-config-path {path}: {key!r} is not an argument (use argparse names, e.g. lr)")
            current = getattr(args, key)
            if isinstance(value, str) and isinstance(current, (int, float)) and not isinstance(current, bool):
                try:
                    value = type(current)(float(value)) if isinstance(current, int) else float(value)
                except ValueError:
                    error(f"--megatron-config-path {path}: {key}={value!r} is not a number")
            setattr(args, key, value)
            overridden.append(key)
    return overridden


def _apply_custom_config(args, error, check_paths):
    """--custom-config-path: a flat YAML mapping set onto args last, so derived values are not re-derived."""
    path = args.custom_config_path
    if not path or (not check_paths and not os.path.exists(path)):
        return
    config = _read_yaml("--custom-config-path", path, error)
    if not isinstance(config, dict) or not all(isinstance(k, str) for k in config):
        error(f"--custom-config-path {path}: expected a mapping of names to values, got {type(config).__name__}")
    for key, value in config.items():
        setattr(args, key, value)


def _validate_algorithm_and_rollout(args, error):
    """Flag combinations the loss and the default rollout cannot run with, found here instead of mid-run."""
    if args.loss_type == "custom_loss" and not args.custom_loss_function_path:
        error("--loss-type custom_loss needs --custom-loss-function-path pkg.module.fn (the loss to call).")
    if args.advantage_estimator == "rloo" and not args.rewards_normalization:
        error(
            "--advantage-estimator rloo builds its leave-one-out baseline from group-mean-centred rewards; "
            "drop --disable-rewards-normalization."
        )
    if (
        args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION
        and not args.rollout_global_dataset
        and not args.debug_train_only
    ):
        error(
            f"--disable-rollout-global-dataset: the default --rollout-function-path {DEFAULT_ROLLOUT_FUNCTION} "
            "reads its prompts from --prompt-data; keep the dataset or give your own rollout function."
        )
    if (
        args.rollout_function_path in PROMPT_DATA_ROLLOUT_FUNCTIONS
        and args.data_source_path in DEFAULT_DATA_SOURCES
        and args.rollout_global_dataset
        and args.prompt_data is None
        and not args.debug_train_only  # also set by --load-debug-rollout-data: rollouts are replayed, not generated
    ):
        error(
            f"--prompt-data is required: --rollout-function-path {args.rollout_function_path} takes its prompts "
            "from the default data source, which reads them from --prompt-data."
        )
    if args.group_rm and args.eval_prompt_data and args.eval_function_path == DEFAULT_ROLLOUT_FUNCTION:
        error(
            "--group-rm with --eval-prompt-data: the default eval scores samples one by one; drop --group-rm or "
            "set --eval-function-path."
        )
    if args.rm_type and not args.custom_rm_path:
        # lazy: the reward hub's imports cost ~1 s
        from slime.rollout.rm_hub import RM_TYPES  # heavy

        rm_type = args.rm_type.removeprefix("boxed_")
        if rm_type not in RM_TYPES:
            error(
                f"--rm-type {args.rm_type}: unknown; expected one of {', '.join(RM_TYPES)} (optionally prefixed "
                "boxed_), or --custom-rm-path."
            )
        if rm_type == "remote_rm" and not args.rm_url:
            error("--rm-type remote_rm needs --rm-url (the HTTP endpoint of your reward model server).")
    if args.rollout_function_path == FULLY_ASYNC_ROLLOUT_FUNCTION:
        if args.update_weights_interval != 1:
            error(
                f"--update-weights-interval {args.update_weights_interval}: the fully async rollout pushes the "
                "weights after every step; bound the lag with --max-staleness instead."
            )
        if not args.rollout_global_dataset:
            error("the fully async rollout needs the global dataset: drop --disable-rollout-global-dataset.")
        if args.over_sampling_batch_size > args.rollout_batch_size or args.partial_rollout:
            logger.warning(
                "fully async rollout: --over-sampling-batch-size and --partial-rollout are not used; "
                "admission is paced by --max-staleness and interrupted samples always resume"
            )


def _check_mtp(args, error):
    if args.mtp_num_layers is not None and args.mtp_num_layers < 1:
        error(f"--mtp-num-layers {args.mtp_num_layers}: give a positive number of MTP layers, or drop the flag.")
    if args.mtp_loss_scaling_factor < 0:
        error(f"--mtp-loss-scaling-factor {args.mtp_loss_scaling_factor} must be >= 0.")
    if args.enable_mtp_training and not args.mtp_num_layers:
        error("--enable-mtp-training needs --mtp-num-layers (the number of MTP layers to train).")
    if args.enable_mtp_training:
        error(
            "--enable-mtp-training: slime does not train multi-token-prediction layers; they are passed through "
            "untouched (see docs/models.md). Drop the flag."
        )
    if args.mtp_num_layers:
        logger.info(
            "--mtp-num-layers %d: the trainer builds no MTP block (MTP layers are not trained); the inference "
            "engine keeps the checkpoint's MTP weights and weight updates pass them through untouched.",
            args.mtp_num_layers,
        )


def _megatron_defaults(args):
    """Megatron defaults that depend on the machine or on other flags (what Megatron's validate_args derives)."""
    if args.norm_epsilon is None:
        args.norm_epsilon = 1e-5
    if args.rotary_base is None:
        args.rotary_base = 10000
    if args.transformer_impl is None:
        args.transformer_impl = default_transformer_impl()
    if args.gradient_accumulation_fusion is None:
        args.gradient_accumulation_fusion = gradient_accumulation_fusion_by_default()
    if args.distributed_backend is None:
        args.distributed_backend = dist_backend()
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if args.recompute_activations:
        args.recompute_granularity = "selective"
    if args.hidden_size is not None:
        if args.ffn_hidden_size is None:
            args.ffn_hidden_size = int(4 * args.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * args.hidden_size
        if args.kv_channels is None and args.num_attention_heads:
            args.kv_channels = args.hidden_size // args.num_attention_heads
    if args.num_experts is not None and args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    for name in ("no_save_optim", "no_save_rng", "no_load_optim", "no_load_rng", "async_save"):
        if getattr(args, name) is None:
            setattr(args, name, False)
    if args.use_cpu_initialization is None:
        args.use_cpu_initialization = False


def megatron_validate_args(args, error):
    """The checks of Megatron's validate_args that matter for slime, with flag-naming messages."""
    missing = [
        f
        for f, d in (
            ("--num-layers", "num_layers"),
            ("--hidden-size", "hidden_size"),
            ("--num-attention-heads", "num_attention_heads"),
        )
        if getattr(args, d) is None
    ]
    if missing:
        error(
            f"{', '.join(missing)} required: give the model's MODEL_ARGS (scripts/models/*.sh) or "
            "--hf-checkpoint to infer them from its config.json."
        )
    if args.lr is None:
        error("--lr is required for training.")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    model_parallel = tp * pp * cp
    if args.world_size % model_parallel != 0:
        error(
            f"world size {args.world_size} (--actor-num-nodes x --actor-num-gpus-per-node) is not divisible by "
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x --context-parallel-size {cp}."
        )
    args.data_parallel_size = args.world_size // model_parallel
    if args.global_batch_size is not None and args.global_batch_size % (
        args.micro_batch_size * args.data_parallel_size
    ):
        error(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size}."
        )
    if args.fp16 and args.bf16:
        error("--fp16 and --bf16 are mutually exclusive.")
    _check_lr_warmup(args, error)
    if args.recompute_granularity == "full" and args.recompute_method is None:
        error("--recompute-granularity full requires --recompute-method (uniform or block).")
    if args.recompute_method is not None and args.recompute_granularity != "full":
        error("--recompute-method is only used with --recompute-granularity full.")
    if args.num_attention_heads % tp:
        error(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}."
        )
    if args.group_query_attention and args.num_query_groups % tp:
        error(f"--num-query-groups {args.num_query_groups} is not divisible by --tensor-model-parallel-size {tp}.")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        error(
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}; "
            "give --kv-channels."
        )
    uneven = args.decoder_first_pipeline_num_layers is not None or args.decoder_last_pipeline_num_layers is not None
    if not uneven and args.num_layers % pp:
        error(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}.")
    args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage is not None:
        per_stage = args.num_layers // pp
        if pp == 1 or per_stage % args.num_layers_per_virtual_pipeline_stage:
            error(
                f"--num-layers-per-virtual-pipeline-stage {args.num_layers_per_virtual_pipeline_stage} needs "
                f"--pipeline-model-parallel-size > 1 and must divide the {per_stage} layers per pipeline stage."
            )
        args.virtual_pipeline_model_parallel_size = per_stage // args.num_layers_per_virtual_pipeline_stage
    ep = args.expert_model_parallel_size
    if ep > 1 and args.num_experts is None:
        error(f"--expert-model-parallel-size {ep} needs a MoE model (--num-experts).")
    if args.num_experts is not None and args.num_experts % ep:
        error(f"--num-experts {args.num_experts} is not divisible by --expert-model-parallel-size {ep}.")
    if tp == 1:
        args.sequence_parallel = False
    if args.sequence_parallel and not sequence_parallel_possible():
        # Megatron's local (non-TE) norms cannot do sequence parallelism; it only saves activation memory.
        logger.warning("--sequence-parallel ignored on CPU (needs Transformer Engine / Apex norms)")
        args.sequence_parallel = False
    args.params_dtype = torch.half if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32


def _check_lr_warmup(args, error):
    """Megatron-LM's rule: the two warmup flags exclude each other only in iteration-based training (--train-iters);
    otherwise (slime's case: the length comes from --num-rollout) --lr-warmup-fraction wins over --lr-warmup-iters,
    as in Megatron's LR scheduler."""
    if args.lr_warmup_fraction is None or args.lr_warmup_iters == 0:
        return
    if args.train_iters:
        error("--lr-warmup-fraction and --lr-warmup-iters: give only one with --train-iters (Megatron-LM's rule).")
    logger.info(
        "--lr-warmup-fraction %s wins over --lr-warmup-iters %s (Megatron-LM's rule)",
        args.lr_warmup_fraction,
        args.lr_warmup_iters,
    )


def _resolve_inference_server(args, error):
    if args.inference_server == "auto":
        args.inference_server = auto_inference_server(sglang_available())
    elif args.inference_server == "sglang" and not sglang_available():
        error(
            "--inference-server sglang: SGLang is not installed here (pip install 'slime[sglang]' on a GPU machine), "
            "or use --inference-server cpu."
        )


def _megatron_training_available():
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


def _build_parser(add_slime_arguments):
    parser = argparse.ArgumentParser(
        prog=os.path.basename(sys.argv[0]) or "slime",
        usage="%(prog)s [options]",
        allow_abbrev=False,
        description="slime: RL post-training with Megatron + SGLang (slime, Megatron-LM and --sglang-* options).",
    )
    add_megatron_arguments(parser)
    add_slime_arguments(parser)
    return parser


def _parse_with_megatron(add_slime_arguments, argv):
    """Megatron-LM on PYTHONPATH: its parser with slime's flags as extra args (slime's own layering)."""
    from megatron.training.arguments import parse_args as megatron_parse_args  # optional: Megatron-LM

    captured = {}

    def provider(parser):
        captured["parser"] = parser
        return add_slime_arguments(parser)

    saved = sys.argv
    if argv is not None:
        sys.argv = [saved[0] if saved else "slime", *argv]
    try:
        args = megatron_parse_args(extra_args_provider=provider)
    finally:
        sys.argv = saved
    if not args.bf16:
        args.bf16 = None  # Megatron's --bf16 cannot say "off"; None lets slime pick it from the machine
    return args, captured["parser"]


def parse_args(add_custom_arguments=None, argv=None, *, check_paths=True, asynchronous=False):
    """Parse and validate the job's arguments. `argv` defaults to sys.argv[1:]. `asynchronous=True`: for
    train_async.py, whose overlap of generation and training rules out --colocate / --offload.

    `check_paths=False` validates a launch script meant for another machine: no checkpoint / HF paths are read,
    and with `--inference-server auto` the CPU-server compatibility check is skipped."""
    add_slime_arguments = get_slime_extra_args_provider(add_custom_arguments)
    with_megatron = _megatron_training_available()
    if with_megatron:
        args, parser = _parse_with_megatron(add_slime_arguments, argv)
    else:
        parser = _build_parser(add_slime_arguments)
        args = parser.parse_args(argv)
    error = _one_line_error(parser)
    overridden = _apply_megatron_config(args, error, check_paths)
    user_load = args.load  # validation replaces a --load without a checkpoint by --ref-load

    if args.hf_checkpoint:
        given = _given_flags(argv) | {"--" + key.replace("_", "-") for key in overridden}
        _apply_hf_config(args, error, check_paths, given)
    for dest in _HF_DROPOUT_KEYS:  # no HF config to read: Megatron's default
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
    args.world_size = args.actor_num_nodes * args.actor_num_gpus_per_node  # debug-rollout-only may resize the actors
    if with_megatron:
        if not args.debug_rollout_only:
            from megatron.training.arguments import validate_args as megatron_validate  # optional: Megatron-LM

            megatron_validate(args)
    else:
        _megatron_defaults(args)
        if not args.debug_rollout_only:
            megatron_validate_args(args, error)
    args.variable_seq_lengths = True
    if args.moe_token_dispatcher_type == "allgather":
        args.moe_token_dispatcher_type = "alltoall"
    # A dry run with --inference-server auto validates for the target machine, whose server we cannot know.
    check_cpu_server = check_paths or args.inference_server == "cpu"
    _resolve_inference_server(args, error)
    sglang_validate_args(args, parser, check_cpu_server=check_cpu_server)
    if args.sglang_served_model_name is None:
        # This run's identity: every engine must echo it in /get_server_info before it gets traffic or weights, so a
        # server of another run that happens to answer on an engine's port is never used (see SGLangEngine.init).
        args.sglang_served_model_name = f"slime-run-{secrets.token_hex(8)}"
    if check_paths:
        check_inputs(args, error, user_load)
    return args


def _one_line_error(parser):
    """argparse's exit (status 2, `prog: error: ...` on stderr) without the usage line: validation errors are about
    values, not syntax, so the one line that names the culprit is all the user needs."""

    def error(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    return error


if __name__ == "__main__":
    parse_args(argv=sys.argv[1:], check_paths=False)
    print("ok")
