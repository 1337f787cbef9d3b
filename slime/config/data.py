"""What the job reads and how it is batched: prompt data, eval data, batch sizes, dynamic batching and context lengths."""

import json
import logging
import os

from slime.config.base import Group, reset_arg
from slime.utils.data import DEFAULT_TOOL_KEY
from slime.utils.eval_config import from_prompt_data, load_eval_config

logger = logging.getLogger(__name__)


def add_data_arguments(parser):
    g = Group(parser, "data")
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
    g.add_argument(
        "--apply-chat-template",
        action="store_true",
        default=False,
        help="Render each prompt with the tokenizer's chat template (a text prompt as one user message).",
    )
    g.add_argument(
        "--multimodal-keys",
        type=str,
        default=None,
        help='JSON mapping of media type to dataset column, e.g. \'{"image": "images", "video": "videos"}\': each '
        "<image> / <video> in a message-list prompt is filled from that column (docs/vlm.md). Images and videos go to "
        "the engine and the trainer, for Qwen2.5-VL, Qwen3-VL and Qwen3.5.",
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
    g.add_argument(
        "--tool-key",
        type=str,
        default=DEFAULT_TOOL_KEY,
        help="Column with each row's tool list (or its JSON) for the chat template, also given to plugins (and the "
        "SFT loss mask) as metadata['tools']. The default column is used where the data has it; another must exist.",
    )
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
        "parent, so log-probs, losses and gradients equal flat packing's. Local layer spec (--transformer-impl "
        "local); DP, TP, PP, EP, dynamic batching, critic, OPD and routing replay; context and sequence parallelism "
        "are refused; see docs/usage.md.",
    )
    g.add_argument(
        "--tree-attention-backend",
        choices=["dense", "flex"],
        default=None,
        help="The tree row's attention with --tree-training: 'flex' (default on GPU) runs FlexAttention with the "
        "ancestor mask as a block mask, skipping the blocks no token sees; 'dense' (default on CPU, where "
        "FlexAttention has no backward) masks dense [L, L] scores in the local spec's attention. Same values.",
    )
    g.add_argument("--max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None)
    return parser


def add_batch_memory_arguments(parser):
    g = Group(parser, "batch memory")
    g.add_argument(
        "--log-probs-chunk-size",
        type=int,
        default=-1,
        help="Compute log-probs (and entropy) over the vocabulary this many tokens at a time, to bound the memory "
        "of the softmax (a micro-batch's short responses are scored together up to this many tokens); <= 0: whole "
        "responses, together up to 2^24 logits (64 MiB in fp32).",
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
    g = Group(parser, "eval")
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


def add_context_length_arguments(parser):
    """Current slime's context budgets (prompt + response tokens)."""
    g = Group(parser, "context length")
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


def resolve_eval_datasets(args, error, check_paths):
    """Eval data: an --eval-config file (it replaces --eval-prompt-data), or name/path pairs."""
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
    if args.eval_reward_key is None:
        args.eval_reward_key = args.reward_key


def check_dynamic_batch(args, error):
    """Dynamic batches are sized in tokens."""
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        error("--use-dynamic-batch-size requires --max-tokens-per-gpu.")
    if args.balance_by_flops and not args.use_dynamic_batch_size:
        error("--balance-by-flops balances the micro-batches of --use-dynamic-batch-size: add it.")
    if args.log_probs_max_tokens_per_gpu is None:
        args.log_probs_max_tokens_per_gpu = args.max_tokens_per_gpu


def resolve_batch_sizes(args, error):
    """A rollout splits into whole optimizer steps; over-sampling submits at least a batch."""
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
    if args.over_sampling_batch_size is None:
        args.over_sampling_batch_size = args.rollout_batch_size
    if args.over_sampling_batch_size < args.rollout_batch_size:
        error(
            f"--over-sampling-batch-size {args.over_sampling_batch_size} must be >= --rollout-batch-size "
            f"{args.rollout_batch_size}."
        )


def check_training_length(args, error, asynchronous):
    """How long to train: --num-rollout or --num-epoch; 0 rollouts is an eval-only run."""
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
