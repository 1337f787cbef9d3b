"""slime's command line: slime's own flags, Megatron-LM's flags, and SGLang's as `--sglang-*`.

`parse_args(add_custom_arguments=None, argv=None)` returns one `argparse.Namespace` for the whole job. With
Megatron-LM on PYTHONPATH, Megatron's own parser provides its flags (full pass-through, as slime). Otherwise (the
megatron-core PyPI wheel) slime provides a Megatron-compatible group with Megatron-LM's flag names, meanings and
defaults, so `scripts/models/*.sh` arrays work unchanged. User mistakes exit with status 2 and one message naming
the flag(s) at fault.

    python -m slime.utils.arguments ARGS...   # parse + validate only, prints "ok" (launch scripts' dry run)
"""

import argparse
import datetime
import importlib.util
import json
import logging
import os
import re
import secrets
import sys

import yaml

from slime.backends.megatron_utils.arguments import (
    HF_DROPOUT_KEYS,
    add_megatron_arguments,
    apply_hf_config,
    check_hybrid_model,
    check_mtp,
    check_tree_training,
    lora_validate_args,
    megatron_defaults,
    megatron_training_available,
    megatron_validate_args,
    moe_freq_type,  # noqa: F401  (public path)
    parse_with_megatron,
    set_default_megatron_args,
)
from slime.backends.sglang_utils.arguments import add_sglang_arguments, sglang_available
from slime.backends.sglang_utils.arguments import validate_args as sglang_validate_args
from slime.backends.sglang_utils.external import check_opd_teacher, discover_external_engines, tokenizer_vocab
from slime.backends.sglang_utils.sglang_config import (
    OPD_TEACHER,
    add_sglang_config_arguments,
    check_sglang_config,
    frozen_models,
)
from slime.observability.profile_utils import TARGETS as PROFILE_TARGETS
from slime.utils.checkpoint_tracker import checkpoint_dir, read_tracker
from slime.utils.device import auto_inference_server, default_gdn_backend, memory_history_module
from slime.utils.disk_delta import CHECKSUMS as DELTA_CHECKSUMS
from slime.utils.disk_delta import ENCODINGS as DELTA_ENCODINGS
from slime.utils.eval_config import from_prompt_data, load_eval_config
from slime.utils.flag_support import add_refused_arguments, refuse_unsupported, warn_no_effect
from slime.utils.mask_utils import LOSS_MASK_TYPES
from slime.utils.startup_checks import DEFAULT_ROLLOUT_FUNCTION, check_inputs, check_value_ranges
from slime.utils.top_p_replay import sampling_is_truncated

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
    g.add_argument(
        "--num-gpus-per-node",
        "--rollout-num-gpus-per-node",
        dest="rollout_num_gpus_per_node",
        type=int,
        default=8,
        help="GPUs per node for inference engines (current slime's name; --rollout-num-gpus-per-node is the older "
        "one). Also read as args.num_gpus_per_node.",
    )
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
        help="--offload-train plus --offload-rollout.",
    )
    g.add_argument(
        "--offload-train",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Offload the trainers' weights and optimizer while the engines generate (on with --colocate unless "
        "--no-offload-train).",
    )
    g.add_argument(
        "--offload-rollout",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Release the engines' weights and KV cache while the trainers train (on with --colocate unless "
        "--no-offload-rollout).",
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
        "--no-check-sampling-params",
        action="store_true",
        default=False,
        help="Train samples whose recorded sampling parameters the trainer cannot score exactly (a temperature other "
        "than a greedy --rollout-temperature's, top-p/top-k/min-p without kept sets, penalties, logit_bias, grammars; under "
        "--lora-sync adapter, not recorded as sampled with the policy's adapter); by default such a sample is "
        "refused in one line (warned once when set).",
    )
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
        "--mask-offpolicy-in-partial-rollout",
        action="store_true",
        default=False,
        help="With --partial-rollout: loss-mask the response tokens a resumed sample brought from an earlier rollout "
        "(generated by older weights), so only the tokens generated in this rollout train.",
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
        "--no-check-weight-versions",
        dest="check_weight_versions",
        action="store_false",
        help="Train a rollout without checking that every trainable token's weight version is one the trainer "
        "pushed and the mode allows (sync: the current one; one-step off-policy: current or previous; fully async: "
        "within --max-staleness). Logs a warning once.",
    )
    g.add_argument(
        "--no-check-weight-fingerprints",
        dest="check_weight_fingerprints",
        action="store_false",
        help="After every weight push, do not compare each CPU-server engine's weight fingerprint (tiles32 per "
        "HF tensor, combined) with the trainer's. Logs a warning once.",
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
    g.add_argument(
        "--multimodal-keys",
        type=str,
        default=None,
        help='JSON mapping of media type to dataset column, e.g. \'{"image": "images"}\': each <image> in a '
        "message-list prompt is filled from that column (docs/vlm.md). Rollouts only for now.",
    )
    g.add_argument(
        "--apply-chat-template-kwargs",
        type=json.loads,
        default="{}",
        help="JSON of extra keyword arguments of the chat template (rollout and eval prompts), e.g. "
        "'{\"enable_thinking\": false}'.",
    )
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
    g.add_argument(
        "--balance-by-flops",
        action="store_true",
        default=False,
        help="Balance estimated forward FLOPs (linear in a sample's length plus its quadratic attention) instead of "
        "tokens: between the micro-batches of --use-dynamic-batch-size (still within --max-tokens-per-gpu) and, "
        "with --balance-data, between DP ranks.",
    )
    g.add_argument("--use-dynamic-batch-size", action="store_true", default=False)
    g.add_argument(
        "--tree-training",
        action="store_true",
        default=False,
        help="Pack each micro-batch as a prefix tree: samples sharing a prefix (a GRPO group's prompt, any common "
        "prefix) forward it once, every token attending to its ancestors only with positions continuing from its "
        "parent, so log-probs, losses and gradients equal flat packing's. This slice: tested on one rank, local layer "
        "spec (--transformer-impl local); CP/TP/PP > 1 and --use-dynamic-batch-size are refused; see docs/usage.md.",
    )
    g.add_argument("--max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None)
    return parser


def add_batch_memory_arguments(parser):
    g = _Group(parser, "batch memory")
    g.add_argument(
        "--log-probs-chunk-size",
        type=int,
        default=-1,
        help="Compute log-probs (and entropy) over the vocabulary this many tokens at a time, to bound the memory "
        "of the softmax; <= 0: all of a sample's response tokens at once.",
    )
    g.add_argument(
        "--data-pad-size-multiplier",
        type=int,
        default=128,
        help="A packed micro-batch (THD, Transformer Engine) is padded to a multiple of TP size x this many tokens.",
    )
    g.add_argument(
        "--recompute-loss-function",
        action="store_true",
        default=False,
        help="Activation-checkpoint the loss: the loss function's intermediates (log-softmax over the vocabulary, "
        "entropy, ratios) are freed after the forward pass and recomputed in the backward pass; same values and "
        "gradients, less memory.",
    )
    return parser


def check_batch_memory_flags(args, error):
    if args.data_pad_size_multiplier < 1:
        error(f"--data-pad-size-multiplier {args.data_pad_size_multiplier}: must be >= 1.")


def add_eval_arguments(parser):
    g = _Group(parser, "eval")
    g.add_argument(
        "--skip-eval-before-train",
        action="store_true",
        default=False,
        help="With --eval-interval: no eval at rollout 0, before any training.",
    )
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
    # k1 is current slime's name (and default); kl, slime v0.1.0's name for it, is still accepted
    g.add_argument("--kl-loss-type", choices=["k1", "kl", "k2", "k3", "low_var_kl"], default="k1")
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
        choices=["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "ppo"],
        help="cispo: GRPO's advantages with the CISPO loss -sg(clip(ratio, 1-eps_clip, 1+eps_clip_high))*A*logp "
        "(the gradient flows through logp only; canonical CISPO sets --eps-clip >= 1 to drop the lower bound). "
        "ppo trains a value model (the critic) beside the policy and uses GAE over its values "
        "(--gamma, --lambd, --value-clip, --num-critic-only-steps).",
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


def add_loss_variant_arguments(parser):
    """Current slime's loss variants on top of the PPO-family loss."""
    g = _Group(parser, "loss variants")
    g.add_argument(
        "--use-unbiased-kl",
        action="store_true",
        default=False,
        help="Weight the KL-loss term of each token by exp(logp - old_logp) (DeepSeek-V3.2's unbiased KL).",
    )
    g.add_argument(
        "--use-opsm",
        action="store_true",
        default=False,
        help="Off-Policy Sequence Masking: a sample with a negative advantage whose masked mean of "
        "(old - new) log-prob exceeds --opsm-delta leaves the policy loss (reported as opsm_clipfrac).",
    )
    g.add_argument("--opsm-delta", type=float, default=1e-4, help="The threshold of --use-opsm.")
    return parser


def add_ref_update_arguments(parser):
    g = _Group(parser, "reference model updates")
    g.add_argument(
        "--ref-update-interval",
        type=int,
        default=None,
        help="Every N rollouts (after training rollout N-1, 2N-1, ...) the reference model's weights become the "
        "actor's current weights. Default: the reference model stays fixed.",
    )
    return parser


def check_ref_update_interval(args, error):
    n = args.ref_update_interval
    if n is None:
        return
    if n < 1:
        error(f"--ref-update-interval {n}: must be a number of rollouts >= 1.")
    if args.kl_coef == 0 and not args.use_kl_loss:
        error(
            "--ref-update-interval updates the reference model, but this job has none (it needs --use-kl-loss or "
            "--kl-coef != 0): drop it."
        )


def add_context_length_arguments(parser):
    """Current slime's context budgets (prompt + response tokens)."""
    g = _Group(parser, "context length")
    g.add_argument(
        "--rollout-max-context-len",
        type=int,
        default=None,
        help="Max prompt + response tokens of a rollout sample (at most the model's max_position_embeddings); "
        "--rollout-max-prompt-len defaults to it - 1, so every sample can generate a token. Read by multi-turn "
        "generate functions as the budget of a whole trajectory.",
    )
    g.add_argument(
        "--eval-max-context-len", type=int, default=None, help="--rollout-max-context-len of eval; default: it."
    )
    g.add_argument(
        "--eval-max-prompt-len",
        type=int,
        default=None,
        help="Drop eval prompts longer than this (tokens); default: --rollout-max-prompt-len.",
    )
    return parser


def add_critic_arguments(parser):
    """PPO with a critic (--advantage-estimator ppo): GAE and the value loss."""
    g = _Group(parser, "critic")
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


def add_consistency_arguments(parser):
    """Train/inference consistency: which policy PPO's old log-probs come from, and what is reported about the gap
    between the trainer's and the engine's log-probs (docs/consistency.md)."""
    g = _Group(parser, "train/inference consistency")
    g.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        default=False,
        help="PPO's old log-probs (and the KL base) are the engine's rollout log-probs; the trainer's old-log-prob "
        "forward is skipped.",
    )
    g.add_argument(
        "--get-mismatch-metrics",
        action="store_true",
        default=False,
        help="Report train/rollout KL and importance-weight statistics (train/mismatch_*) without changing the "
        "loss; with --custom-tis-function-path that function's metrics are reported and its weights ignored.",
    )
    return parser


def add_routing_replay_arguments(parser):
    """MoE routing replay (docs/consistency.md): the trainer routes every token to fixed experts."""
    g = _Group(parser, "MoE routing replay")
    g.add_argument(
        "--use-routing-replay",
        action="store_true",
        default=False,
        help="R2: the experts each token is routed to in the first training-side forward of a rollout (the "
        "old-log-prob forward) are replayed in its later forwards (training, recompute).",
    )
    g.add_argument(
        "--use-rollout-routing-replay",
        action="store_true",
        default=False,
        help="R3: the engines return each token's experts per MoE layer (SGLang's --enable-return-routed-experts, set "
        "for slime's engines) and every trainer forward of the sample (reference, old log-probs, training) routes to "
        "exactly those; router weights are recomputed from the trainer's logits for them. Implies --use-routing-replay.",
    )
    return parser


def check_routing_replay(args, error):
    """R3 implies R2 (as in current slime); both need MoE layers, and one model chunk per pipeline rank (R2's
    record is kept per stage, not per virtual stage)."""
    if args.use_rollout_routing_replay:
        args.use_routing_replay = True
    if not args.use_routing_replay:
        return
    flag = "--use-rollout-routing-replay" if args.use_rollout_routing_replay else "--use-routing-replay"
    if not args.num_experts:
        error(f"{flag}: the model has no MoE layers (--num-experts is not set); drop the flag.")
    if not args.use_rollout_routing_replay and args.use_rollout_logprobs and not args.get_mismatch_metrics:
        error(
            "--use-routing-replay records the routing in the old-log-prob forward, which --use-rollout-logprobs "
            "skips: add --get-mismatch-metrics (which runs it) or use --use-rollout-routing-replay."
        )
    if args.num_layers_per_virtual_pipeline_stage is not None or (args.num_virtual_stages_per_pipeline_rank or 1) > 1:
        error(
            f"{flag} is not supported with the interleaved pipeline schedule (--num-layers-per-virtual-pipeline-stage "
            "/ --num-virtual-stages-per-pipeline-rank): use plain --pipeline-model-parallel-size."
        )


def resolve_context_lengths(args, error):
    """Current slime's defaults between the context budgets, and its bound: a prompt leaves room for one token."""
    if args.eval_max_context_len is None:
        args.eval_max_context_len = args.rollout_max_context_len
    if args.rollout_max_context_len is not None:
        if args.rollout_max_prompt_len is None:
            args.rollout_max_prompt_len = args.rollout_max_context_len - 1
        elif args.rollout_max_prompt_len > args.rollout_max_context_len - 1:
            error(
                f"--rollout-max-prompt-len {args.rollout_max_prompt_len} must be below --rollout-max-context-len "
                f"{args.rollout_max_context_len}, so that every sample generates at least one token to train on."
            )
    if args.eval_max_prompt_len is None:
        args.eval_max_prompt_len = args.rollout_max_prompt_len


def add_train_env_arguments(parser):
    g = _Group(parser, "train environment")
    g.add_argument(
        "--train-env-vars",
        type=json.loads,
        default="{}",
        help="JSON object of extra environment variables of the training processes, e.g. "
        '\'{"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}\' (they win over slime\'s own).',
    )
    return parser


def check_train_env_vars(args, error):
    env = args.train_env_vars
    if not isinstance(env, dict):
        error(f"--train-env-vars {json.dumps(env)}: expected a JSON object of NAME: value.")
    for name, value in env.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            error(f"--train-env-vars: {name}={json.dumps(value)}: a value must be a string or a number.")
    args.train_env_vars = {name: str(value) for name, value in env.items()}  # Ray's runtime env takes strings


def add_optimizer_state_arguments(parser):
    g = _Group(parser, "optimizer state")
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
    g = _Group(parser, "frozen parameters")
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


def add_metric_arguments(parser):
    g = _Group(parser, "metrics")
    g.add_argument(
        "--log-reward-category",
        type=str,
        default=None,
        help="Key of a dict reward naming each sample's category (e.g. its failure kind): the fraction of each "
        "category is logged per rollout as error_cat/<category>.",
    )
    return parser


def add_correct_samples_arguments(parser):
    g = _Group(parser, "correct-sample metrics")
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


def add_save_hf_arguments(parser):
    g = _Group(parser, "HF checkpoint copies")
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


def add_tensorboard_arguments(parser):
    g = _Group(parser, "tensorboard")
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
    g = _Group(parser, "profiling (with Megatron-LM's --use-pytorch-profiler / --record-memory-history)")
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
    g = _Group(parser, "debug")
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


def add_network_arguments(parser):
    g = _Group(parser, "network")
    g.add_argument("--http-proxy", type=str, default=None)
    g.add_argument("--use-http2", action="store_true", default=False)
    g.add_argument(
        "--use-distributed-post",
        action="store_true",
        default=False,
        help="Send the rollout's HTTP requests from Ray actors on every node (--num-gpus-per-node per node) instead "
        "of the rollout process alone.",
    )
    return parser


def add_reward_model_arguments(parser):
    g = _Group(parser, "reward model")
    g.add_argument(
        "--rm-type",
        type=str,
        default=None,
        help="deepscaler | dapo | math | f1 | gpqa | random | answer_match | remote_rm | boxed_<type>.",
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
    g.add_argument(
        "--loss-mask-type",
        choices=LOSS_MASK_TYPES,
        default="qwen",
        help="How SFT chats become token ids + loss masks (slime.utils.mask_utils).",
    )
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
        help="YAML `megatron: [{name, role: actor, overrides: {lr: 1e-6, ...}}]` over the command line; a "
        "`role: critic` entry (--advantage-estimator ppo) sets the critic's own, e.g. its num_steps_per_rollout.",
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
        help="Train the MTP layers with the RL loss (needs --mtp-num-layers); without it they stay frozen.",
    )
    return parser


def add_weight_sync_arguments(parser):
    g = _Group(parser, "weight sync")
    g.add_argument(
        "--update-weight-transport",
        choices=["auto", "broadcast", "nccl", "shm", "disk"],
        default="auto",
        help="Disaggregated weight sync: 'broadcast' (current slime: 'nccl') over the weight-update process group "
        "(NCCL/gloo); 'shm' hands flattened buckets to the engines as shared-memory handles (CPU, engines on the "
        "trainer's host); 'auto' = shm where it applies, else broadcast; 'disk' writes each version under "
        "--update-weight-disk-dir and the engines load it with update_weights_from_disk.",
    )
    g.add_argument(
        "--update-weight-mode",
        choices=["full", "delta"],
        default="full",
        help="'delta' (disk only): after a trainer's first version (full), each version holds compressed differences "
        "against the previous one, applied by each engine host into --update-weight-local-checkpoint-dir and "
        "verified per tensor.",
    )
    g.add_argument(
        "--update-weight-disk-dir",
        type=str,
        default=None,
        help="Directory shared by trainers and engines where disk weight versions are published.",
    )
    g.add_argument(
        "--update-weight-disk-keep-files",
        action="store_true",
        default=False,
        help="Keep every published version (default: older versions are deleted once the engines hold a newer one).",
    )
    g.add_argument("--update-weight-delta-encoding", choices=list(DELTA_ENCODINGS), default="xor")
    g.add_argument("--update-weight-delta-checksum", choices=list(DELTA_CHECKSUMS), default="xxh3-128")
    g.add_argument(
        "--update-weight-local-checkpoint-dir",
        type=str,
        default=None,
        help="Engine-host-local full checkpoint kept at the current version by /pull_weights (required by delta).",
    )
    g.add_argument(
        "--release-train",
        action="store_true",
        default=False,
        help="Shut the trainers down after each weight push (disk transport) and recreate them from --save before "
        "the next training step: nothing of the trainers (optimizer state, CPU backups, process memory) is held "
        "while the engines generate. Saves after every rollout. See docs/weight_sync.md.",
    )
    return parser


def add_external_engine_arguments(parser):
    g = _Group(parser, "external rollout engines")
    g.add_argument(
        "--rollout-external-engine-addrs",
        type=str,
        nargs="+",
        default=None,
        help="host:port of inference engines started outside this job (with --rollout-num-gpus 0): slime reads "
        "their shape from /server_info, checks they serve --hf-checkpoint, routes to them and pushes weights "
        "(broadcast or disk), but never starts, stops or restarts them. See docs/weight_sync.md.",
    )
    return parser


def check_external_engines(args, error, check_paths):
    """--rollout-external-engine-addrs: the flags it excludes, then (reading the engines, unless `check_paths` is
    False or no engine is used) each engine's shape and model. Sets args.rollout_external,
    args.rollout_external_engine_infos and the per-engine GPU count."""
    args.rollout_external = args.rollout_external_engine_addrs is not None
    args.rollout_external_engine_infos = None
    if not args.rollout_external:
        return
    flag = "--rollout-external-engine-addrs"
    if args.rollout_num_gpus not in (None, 0):
        error(f"{flag}: slime starts no engine of its own; set --rollout-num-gpus 0 (got {args.rollout_num_gpus}).")
    args.rollout_num_gpus = 0
    for given, what in (
        (args.colocate, "--colocate (external engines have GPUs of their own)"),
        (args.offload or args.offload_rollout, "--offload/--offload-rollout (slime does not manage the memory of "
         "engines it does not own; use --offload-train)"),
        (args.debug_rollout_only, "--debug-rollout-only"),
    ):  # fmt: skip
        if given:
            error(f"{flag} cannot be combined with {what}.")
    if args.debug_train_only or not check_paths:
        return
    try:
        infos = discover_external_engines(args.rollout_external_engine_addrs, args.hf_checkpoint, args.sglang_api_key)
    except ValueError as e:
        error(f"{flag} {e}.")
    sizes = {i["num_gpus"] for i in infos}
    if len(sizes) > 1:
        error(
            f"{flag}: the engines differ in GPU count ("
            + ", ".join(f"{i['url']}: {i['num_gpus']}" for i in infos)
            + "); one weight-update group needs engines of one shape."
        )
    if args.enable_lora and args.lora_sync == "adapter":
        for i in infos:
            if not i["lora"]["enable_lora"] or (i["lora"]["max_lora_rank"] or 0) < args.lora_rank:
                error(
                    f"{flag} {i['url']}: --lora-sync adapter needs engines started with --enable-lora and "
                    f"--max-lora-rank >= {args.lora_rank} (it reports enable_lora={i['lora']['enable_lora']}, "
                    f"max_lora_rank={i['lora']['max_lora_rank']}); restart it so, or use --lora-sync merged."
                )
    args.rollout_external_engine_infos = infos
    args.rollout_num_gpus_per_engine = sizes.pop()


def add_linear_attention_arguments(parser):
    g = _Group(parser, "linear attention")
    g.add_argument(
        "--qwen-gdn-backend",
        choices=["fla", "torch"],
        default=None,
        help="Gated DeltaNet kernels of Qwen3-Next / Qwen3.5: fla (flash-linear-attention, GPU) or torch (plain "
        "torch, any device). Default: fla on GPU, torch on CPU.",
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


def add_custom_megatron_plugins_arguments(parser):
    g = _Group(parser, "megatron plugins")
    g.add_argument("--post-self-attn-layernorm", action="store_true", default=False, help="GLM4 extra norm.")
    g.add_argument("--post-mlp-layernorm", action="store_true", default=False, help="GLM4 extra norm.")
    return parser


def add_opd_arguments(parser):
    g = _Group(parser, "on-policy distillation (docs/opd.md)")
    g.add_argument(
        "--use-opd",
        action="store_true",
        default=False,
        help="On-policy distillation: each response token's advantage A becomes A - --opd-kl-coef * (student "
        "log-prob - teacher log-prob), whatever the advantage estimator. Needs --opd-type.",
    )
    g.add_argument(
        "--opd-type",
        type=str,
        choices=["sglang", "megatron"],
        default=None,
        help="sglang: an inference server at --rm-url scores each sample during the rollout "
        "(slime.rollout.on_policy_distillation); megatron: the trainer loads the teacher checkpoint "
        "--opd-teacher-load beside the actor and forwards it before training.",
    )
    g.add_argument("--opd-kl-coef", type=float, default=1.0, help="Weight of the OPD reverse-KL term.")
    g.add_argument(
        "--opd-teacher-load",
        type=str,
        default=None,
        help="Megatron checkpoint of the teacher (--opd-type megatron only); same architecture as the actor.",
    )
    g.add_argument("--opd-teacher-ckpt-step", type=int, default=None, help="Iteration of --opd-teacher-load to load.")
    return parser


def check_opd_flags(args, error, check_paths):
    """--use-opd's flags; in sglang mode (with `check_paths`) the teacher server must answer and share the
    student's tokenizer."""
    if not args.use_opd:
        if args.opd_teacher_load is not None:
            error("--opd-teacher-load is set but --use-opd is not: add --use-opd --opd-type megatron, or drop it.")
        return
    if args.opd_type is None:
        error("--use-opd needs --opd-type sglang (teacher server at --rm-url) or megatron (--opd-teacher-load).")
    if args.opd_type == "megatron":
        if args.opd_teacher_load is None:
            error("--opd-type megatron needs --opd-teacher-load (the teacher's Megatron checkpoint).")
        if args.enable_lora:  # a LoRA trainer loads adapter checkpoints over the --hf-checkpoint base
            error(
                "--opd-type megatron cannot load a full teacher checkpoint with --enable-lora: use --opd-type sglang."
            )
        if check_paths and not _checkpoint_exists(args.opd_teacher_load):
            error(
                f"--opd-teacher-load {args.opd_teacher_load}: no Megatron checkpoint there (missing "
                "latest_checkpointed_iteration.txt)."
            )
        return
    if args.opd_teacher_load is not None or args.opd_teacher_ckpt_step is not None:
        error("--opd-teacher-load / --opd-teacher-ckpt-step are for --opd-type megatron: drop them with sglang.")
    if args.debug_train_only:  # no rollout runs: the teacher log-probs come with the loaded rollout data
        return
    teacher = next((m for m in frozen_models(args) if m.name == OPD_TEACHER), None)
    if not args.rm_url and teacher is None:
        error(
            "--opd-type sglang needs --rm-url, the teacher server's /generate (e.g. http://host:port/generate), or "
            f"a frozen model named {OPD_TEACHER!r} in --sglang-config."
        )
    if not args.rm_url:  # slime starts the teacher: its model directory is here to compare tokenizers
        if check_paths and os.path.realpath(teacher.model_path) != os.path.realpath(args.hf_checkpoint):
            if tokenizer_vocab(teacher.model_path) != tokenizer_vocab(args.hf_checkpoint):
                error(
                    f"--sglang-config {args.sglang_config}: model {OPD_TEACHER!r}: its tokenizer "
                    f"({teacher.model_path}) differs from the student's (--hf-checkpoint {args.hf_checkpoint}); "
                    "OPD needs one tokenizer for both."
                )
        return
    if check_paths:
        try:
            warning = check_opd_teacher(args.rm_url, args.hf_checkpoint)
        except ValueError as e:
            error(f"{e}.")
        if warning:
            logger.warning(warning)


def add_lora_arguments(parser):
    g = _Group(parser, "lora")
    g.add_argument(
        "--enable-lora",
        action="store_true",
        default=False,
        help="Train low-rank adapters on a frozen base model (docs/lora.md).",
    )
    g.add_argument("--lora-rank", type=int, default=16, help="Rank r of each adapter.")
    g.add_argument("--lora-alpha", type=float, default=32, help="Adapters are scaled by alpha / rank.")
    g.add_argument("--lora-dropout", type=float, default=0.0, help="Dropout on the adapters' input.")
    g.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=["all-linear"],
        help="Layers that get adapters: all-linear, Megatron names (linear_qkv linear_proj linear_fc1 linear_fc2) "
        "or HF names (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj); spaces or commas.",
    )
    g.add_argument(
        "--lora-sync",
        choices=["merged", "adapter"],
        default="merged",
        help="What a weight update sends the engines: merged = base + adapters as full weights (any engine); "
        "adapter = only the adapters, served by the engines' LoRA support over the base they loaded.",
    )
    return parser


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


# ---------------------------------------------------------------------------------------------------------------
# Defaults and validation
# ---------------------------------------------------------------------------------------------------------------


def _checkpoint_exists(path):
    return path is not None and os.path.exists(os.path.join(path, "latest_checkpointed_iteration.txt"))


def slime_validate_args(args, error, check_paths=True, asynchronous=False):
    """slime's flag rules (its `slime_validate_args`, in its order) plus `--save-interval` needs `--save`, the
    cluster shape and the combinations the loss and the default rollout cannot run with. `asynchronous`: the job is
    train_async.py's (no colocation)."""
    check_value_ranges(args, error)  # first: the arithmetic below divides by these
    # A run repeats only if its rollouts do: the engines' deterministic (batch-invariant) inference comes with it.
    if args.deterministic_mode:
        args.sglang_enable_deterministic_inference = True
    # KL needs the reference checkpoint. Without --ref-load the initial weights (--hf-checkpoint) are the reference.
    if (args.kl_coef != 0 or args.use_kl_loss) and args.ref_load is not None and check_paths:
        if not os.path.exists(args.ref_load):
            error(f"--ref-load {args.ref_load} does not exist (needed by --use-kl-loss / --kl-coef).")
        if not _checkpoint_exists(args.ref_load):
            logger.warning("--ref-load %s has no latest_checkpointed_iteration.txt", args.ref_load)
    # The check compares the first push with the weights the engines loaded from --hf-checkpoint; a resumed run
    # pushes its checkpoint's (trained) weights, so the comparison would fail for no fault of the weight sync.
    if args.check_weight_update_equal and args.load is not None and (not check_paths or _checkpoint_exists(args.load)):
        error(
            f"--check-weight-update-equal compares the first weight push with --hf-checkpoint's weights, but "
            f"--load {args.load} resumes from a checkpoint whose weights differ: drop one of the two."
        )
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
    if args.balance_by_flops and not args.use_dynamic_batch_size:
        error("--balance-by-flops balances the micro-batches of --use-dynamic-batch-size: add it.")
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
    check_external_engines(args, error, check_paths)
    if getattr(args, "multimodal_keys", None) is not None:
        from slime.utils.processing_utils import parse_multimodal_keys

        try:
            parse_multimodal_keys(args.multimodal_keys)
        except ValueError as e:
            error(str(e))
        if not args.debug_rollout_only:  # docs/vlm.md: rollouts with images work, training on them does not yet
            error(
                "--multimodal-keys: the trainer does not yet take images (no vision tower in the Megatron model); "
                "rollouts with images run with --debug-rollout-only."
            )
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
        args.colocate = args.offload = args.offload_train = args.offload_rollout = False
    if asynchronous and args.release_train:
        error(
            "--release-train: train_async.py generates while the trainers work, so there is no time without "
            "trainers to release them in; use train.py."
        )
    if asynchronous and (args.colocate or args.offload or args.offload_train or args.offload_rollout):
        flag = "--colocate" if args.colocate else "--offload" if args.offload else "--offload-train/--offload-rollout"
        error(
            f"{flag}: train_async.py overlaps generation with training, so the trainers and the engines cannot share "
            "GPUs; drop it, or use train.py for a colocated run."
        )
    # --offload is both; colocated trainers and engines offload unless told not to (--no-offload-train/-rollout)
    for name in ("offload_train", "offload_rollout"):
        if args.offload:
            setattr(args, name, True)
        elif getattr(args, name) is None:
            setattr(args, name, args.colocate)
    args.offload = args.offload_train or args.offload_rollout  # user code of slime v0.1.0 reads args.offload
    args.num_gpus_per_node = args.rollout_num_gpus_per_node  # current slime's name of the field
    # colocated engines use exactly the actor GPUs
    if args.colocate:
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
    if args.num_rollout == 0:
        if args.eval_interval is None:
            error("--num-rollout 0 runs only the eval before training: set --eval-interval and the eval data.")
        if asynchronous:
            error("--num-rollout 0 (an eval-only run): use train.py; train_async.py always trains.")
    if args.save_interval is not None and args.save is None:
        error("--save-interval requires --save (the checkpoint directory).")
    check_save_hf(args, error)
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        error(
            "--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler contradict each other: "
            "recompute the LR schedule from this run's flags, or keep the checkpoint's, not both."
        )
    _validate_algorithm_and_rollout(args, error)
    resolve_tb_dir(args, error)
    check_train_env_vars(args, error)
    check_optimizer_state_flags(args, error)
    check_param_freeze_flags(args, error)
    check_ref_update_interval(args, error)
    check_sglang_config(args, error, check_paths)
    check_opd_flags(args, error, check_paths)
    check_batch_memory_flags(args, error)
    resolve_context_lengths(args, error)
    if args.qwen_gdn_backend is None:
        args.qwen_gdn_backend = default_gdn_backend()
    check_mtp(args, error)
    check_routing_replay(args, error)
    check_hybrid_model(args, error)
    check_tree_training(args, error)
    if args.custom_tis_function_path and not (args.use_tis or args.get_mismatch_metrics):
        error(
            f"--custom-tis-function-path {args.custom_tis_function_path} is called only with --use-tis or "
            "--get-mismatch-metrics; add one."
        )
    _apply_custom_config(args, error, check_paths)
    _validate_consistency(args, error)  # after --custom-config-path, which may set use_tis


def _validate_consistency(args, error):
    cap = args.sglang_sampling_mask_max_tokens
    replayed = sampling_is_truncated(args) and args.loss_type != "sft_loss"
    if replayed and args.rollout_top_k <= 0:
        # SGLang returns kept sets only for a finite top-k <= its mask cap: top-p alone samples from the nucleus
        # restricted to the cap's most probable tokens, which changes nothing while the nucleus is no larger
        args.rollout_top_k = cap
        logger.info(
            f"--rollout-top-p {args.rollout_top_p:g} without --rollout-top-k: rollouts sample with top-k {cap} "
            f"(--sglang-sampling-mask-max-tokens), so a step whose nucleus holds more than {cap} tokens samples from "
            f"its {cap} most probable ones; the trainer replays exactly that set (docs/consistency.md)"
        )
    if replayed and not 1 <= args.rollout_top_k <= cap:
        error(
            f"--rollout-top-k {args.rollout_top_k} must be in [1, {cap}]: the trainer replays each step's kept token "
            f"set, which the engine returns (SGLang's return_sampling_mask) only for a finite top-k up to "
            f"--sglang-sampling-mask-max-tokens {cap}."
        )
    if args.use_rollout_logprobs and args.use_tis:
        error(
            "--use-rollout-logprobs and --use-tis cannot be set at the same time (TIS reweights by exp(old - rollout))."
        )


def _read_yaml(flag, path, error):
    try:
        with open(path) as f:
            return yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        error(f"{flag} {path}: cannot read it as YAML ({type(e).__name__}: {e})")


def _apply_megatron_config(args, error, check_paths):
    """--megatron-config-path: YAML `megatron: [{name, role, overrides: {dest: value}}]`; the actor role's overrides
    replace the command-line values, the critic role's are kept in `args.critic_overrides` for the critic's copy of
    the arguments (`slime.ray.critic`). Returns the keys set on the actor."""
    path = args.megatron_config_path
    args.critic_overrides = {}
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
        if role not in ("actor", "critic"):
            error(f"--megatron-config-path {path}: role {role!r}: the roles are actor and critic")
        if role == "critic" and args.advantage_estimator != "ppo":
            error(
                f"--megatron-config-path {path}: a critic role needs --advantage-estimator ppo (the only estimator with a critic)"
            )
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
            if role == "critic":  # applied to the critic's copy of the arguments (slime.ray.critic)
                args.critic_overrides[key] = value
                continue
            setattr(args, key, value)
            overridden.append(key)
    return overridden


_CRITIC_PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")


def _validate_critic(args, error, user_load, check_paths):
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
    if check_paths and user_load and _checkpoint_exists(user_load) and not args.finetune:
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
    if args.advantage_estimator == "cispo" and args.eps_clip < 1:
        logger.warning(
            "--advantage-estimator cispo with --eps-clip %s < 1: the importance ratio is also clipped from below "
            "(canonical CISPO has no lower bound: set --eps-clip >= 1)",
            args.eps_clip,
        )
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


def _resolve_inference_server(args, error):
    if args.inference_server == "auto":
        args.inference_server = auto_inference_server(sglang_available())
    elif args.inference_server == "sglang" and not sglang_available():
        error(
            "--inference-server sglang: SGLang is not installed here (pip install 'slime[sglang]' on a GPU machine), "
            "or use --inference-server cpu."
        )


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
        parser = _build_parser(add_slime_arguments)
        args = parser.parse_args(argv)
    error = _one_line_error(parser)
    overridden = _apply_megatron_config(args, error, check_paths)
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
    _resolve_inference_server(args, error)
    check_weight_sync(args, error, check_paths)
    check_profiling(args, error)
    sglang_validate_args(args, parser, check_cpu_server=check_cpu_server)
    if args.sglang_served_model_name is None:
        # This run's identity: every engine must echo it in /get_server_info before it gets traffic or weights, so a
        # server of another run that happens to answer on an engine's port is never used (see SGLangEngine.init).
        args.sglang_served_model_name = f"slime-run-{secrets.token_hex(8)}"
    _validate_critic(args, error, user_load, check_paths)
    if check_paths:
        check_inputs(args, error, user_load)
    return args


def check_weight_sync(args, error, check_paths):
    """The disk transport's flags: a writable shared directory, delta's local checkpoint, and the engine endpoint
    (`/pull_weights`) stock SGLang lacks."""
    if args.update_weight_transport == "nccl":
        args.update_weight_transport = "broadcast"
    disk = args.update_weight_transport == "disk"
    if args.update_weight_mode == "delta" and not disk:
        error("--update-weight-mode delta needs --update-weight-transport disk (deltas are files).")
    if args.custom_update_weight_post_write_path and not disk:
        error(
            "--custom-update-weight-post-write-path runs after a disk weight version is written: add "
            "--update-weight-transport disk, or drop the flag."
        )
    check_release_train(args, error)
    if not disk:
        return
    if args.colocate and args.update_weight_mode == "delta":
        error(
            "--update-weight-mode delta with --colocate: colocated engines get their weights by tensor handles or "
            "full disk versions; deltas are for engines on other hosts."
        )
    if not args.update_weight_disk_dir:
        error(
            "--update-weight-transport disk needs --update-weight-disk-dir (a directory trainers and engines share)."
        )
    if args.update_weight_mode == "delta" and not args.update_weight_local_checkpoint_dir:
        error(
            "--update-weight-mode delta needs --update-weight-local-checkpoint-dir (the engine host's checkpoint the "
            "deltas are applied to)."
        )
    if args.update_weight_local_checkpoint_dir and args.inference_server == "sglang":
        error(
            f"--update-weight-{'mode delta' if args.update_weight_mode == 'delta' else 'local-checkpoint-dir'}: the "
            "engines must pull each version through /pull_weights, which SGLang 0.5.23 does not have (slime's CPU "
            "server does); use full disk sync without --update-weight-local-checkpoint-dir on SGLang."
        )
    if check_paths:
        probe = os.path.join(args.update_weight_disk_dir, f".slime-write-probe-{os.getpid()}")
        try:
            os.makedirs(args.update_weight_disk_dir, exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            error(f"--update-weight-disk-dir {args.update_weight_disk_dir}: not writable ({e.strerror or e}).")


def check_release_train(args, error):
    """--release-train: the recreated trainers load the last save, and the engines' weights come from disk, written
    by trainers that are gone once the engines load it."""
    if not args.release_train:
        return
    why = None
    if args.update_weight_transport != "disk" or args.update_weight_mode != "full":
        why = (
            "needs --update-weight-transport disk --update-weight-mode full (a delta's base lives in the trainers, "
            "which are recreated)"
        )
    elif args.enable_lora and args.lora_sync == "adapter":
        why = "with --lora-sync adapter: adapters travel by value, not through disk; use --lora-sync merged"
    elif not args.save:
        why = "needs --save: the trainers are recreated from the checkpoint saved after each rollout"
    elif args.save_interval not in (None, 1):
        why = f"saves after every rollout (the next trainers load it): drop --save-interval {args.save_interval}"
    elif args.debug_rollout_only:
        why = "with --debug-rollout-only: there are no trainers to release"
    elif args.advantage_estimator == "ppo":
        why = "with a critic (--advantage-estimator ppo) is not supported: the critic group is not recreated"
    elif args.keep_old_actor:
        why = "with --keep-old-actor: the old actor's weights live in the trainers only"
    elif args.ref_update_interval:
        why = "with --ref-update-interval: the updated reference lives in the trainers only"
    if why:
        error(f"--release-train {why}.")
    args.save_interval = 1


def _one_line_error(parser):
    """argparse's exit (status 2, `prog: error: ...` on stderr) without the usage line: validation errors are about
    values, not syntax, so the one line that names the culprit is all the user needs."""

    def error(message):
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    return error


if __name__ == "__main__":
    parse_args(argv=sys.argv[1:], check_paths=False)
    print("ok")
