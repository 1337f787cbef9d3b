"""Checks of the user's inputs that run once, at start-up, before Ray or any actor starts.

`check_inputs(args, error)` runs at the end of `parse_args` (unless `check_paths=False`, the dry run of a launch
script meant for another machine): every `--*-path` extension point, the prompt files, the checkpoint directories
and the prompt + response budget against the model's context. `check_value_ranges` runs on every parse.
`check_cluster(args)` runs right after the driver connects to Ray, before any actor or placement group exists.

Every failure is one line naming the flag, file, row or function at fault; `error` exits with status 2 (argparse).
A full list of the checks is in docs/debugging.md.
"""

import ast
import dataclasses
import inspect
import os
import tempfile

from slime.utils.checkpoint_tracker import TRACKER, checkpoint_dir, read_tracker
from slime.utils.data import Dataset
from slime.utils.misc import load_function
from slime.utils.processing_utils import multimodal_dataset_kwargs
from slime.utils.quantization_checks import check_quantized_checkpoint
from slime.utils.user_errors import StartupError, one_line

DEFAULT_ROLLOUT_FUNCTION = "slime.rollout.sglang_rollout.generate_rollout"


# ---------------------------------------------------------------------------------------------------------------
# Extension points: one row per `--*-path` flag, with the call slime makes
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExtensionPoint:
    """`call` is the parameter list slime passes, in Python syntax: names before `*` (without defaults) are passed
    positionally, names with a default or after `*` by keyword. `asynchronous`: True when slime awaits the result
    (must be `async def`), None when either works."""

    flag: str
    call: str
    asynchronous: bool | None = None
    alternatives: tuple = ()  # other calls slime makes when the function declares that form (older slime)

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def arguments(self, call=None):
        """(positional names, keyword names) of slime's call."""
        fn = ast.parse(f"def f({call or self.call}): pass").body[0].args
        n_kw = len(fn.defaults)
        positional = [a.arg for a in fn.args[: len(fn.args) - n_kw]]
        keywords = [a.arg for a in fn.args[len(fn.args) - n_kw :]] + [a.arg for a in fn.kwonlyargs]
        return positional, keywords


EXTENSION_POINTS = (
    ExtensionPoint("--rollout-function-path", "args, rollout_id, data_source, evaluation=False"),
    ExtensionPoint("--eval-function-path", "args, rollout_id, data_source, evaluation=True"),
    ExtensionPoint(
        "--custom-generate-function-path",
        "args, sample, sampling_params",
        asynchronous=True,
        alternatives=("args, sample, sampling_params, *, evaluation",),
    ),
    ExtensionPoint("--custom-rm-path", "args, sample_or_samples"),
    ExtensionPoint("--eval-custom-rm-path", "args, sample_or_samples"),
    ExtensionPoint("--custom-reward-post-process-path", "args, samples"),
    ExtensionPoint("--dynamic-sampling-filter-path", "args, samples"),
    ExtensionPoint("--over-sampling-filter-path", "args, samples"),
    ExtensionPoint("--buffer-filter-path", "args, rollout_id, buffer, num_samples"),
    ExtensionPoint("--rollout-data-postprocess-path", "args, rollout_id, rollout_data", alternatives=("args",)),
    ExtensionPoint("--custom-loss-function-path", "*, args, batch, logits, sum_of_sample_mean"),
    ExtensionPoint("--custom-megatron-init-path", "args"),
    ExtensionPoint("--custom-megatron-before-log-prob-hook-path", "args, model, store_prefix"),
    ExtensionPoint(
        "--custom-megatron-before-train-step-hook-path",
        "args, rollout_id, step_id, model, optimizer, opt_param_scheduler",
    ),
    # current slime's extension points
    ExtensionPoint("--data-source-path", "args"),
    # keywords are passed only when the function declares them
    ExtensionPoint(
        "--rollout-sample-hook-path",
        "args, sample",
        alternatives=(
            "args, sample, *, rollout_id",
            "args, sample, *, evaluation",
            "args, sample, *, rollout_id, evaluation",
        ),
    ),
    ExtensionPoint("--rollout-sample-filter-path", "args, groups"),
    ExtensionPoint("--rollout-all-samples-process-path", "args, all_groups, data_source"),
    ExtensionPoint("--custom-convert-samples-to-train-data-path", "args, samples"),
    ExtensionPoint(
        "--custom-rollout-log-function-path", "rollout_id, args, samples, rollout_extra_metrics, rollout_time"
    ),
    ExtensionPoint("--custom-eval-rollout-log-function-path", "rollout_id, args, data, extra_metrics"),
    ExtensionPoint("--custom-advantage-function-path", "args, rollout_data"),
    ExtensionPoint(
        "--custom-tis-function-path",
        "*, args, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths",
    ),
    ExtensionPoint(
        "--custom-pg-loss-reducer-function-path",
        "total_lengths, response_lengths, loss_masks, calculate_per_token_loss",
    ),
    ExtensionPoint(
        "--custom-model-provider-path",
        "*, pre_process, post_process",
        alternatives=("*, pre_process, post_process, vp_stage",),
    ),
)


def _is_async(fn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        type(fn).__call__
    )  # an async callable object


def check_extension_point(point: ExtensionPoint, path: str) -> str | None:
    """None when `path` loads a callable slime can call as `point.call`, else the one-line reason."""
    try:
        fn = load_function(path)
    except Exception as e:  # noqa: BLE001  (the user's module may fail to import in any way: report it)
        return f"{point.flag} {path}: cannot import it ({type(e).__name__}: {one_line(e)})"
    if not callable(fn):
        return f"{point.flag} {path} is a {type(fn).__name__}, not a function"
    if point.asynchronous and not _is_async(fn):
        return f"{point.flag} {path} must be an `async def` function: slime awaits fn({point.call})"
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some C callables have no signature to check
        return None
    first_error = None
    for call in (point.call, *point.alternatives):
        positional, keywords = point.arguments(call)
        try:
            signature.bind(*positional, **{k: k for k in keywords})
            return None
        except TypeError as e:
            first_error = first_error or e
    forms = " or ".join(f"fn({c})" for c in (point.call, *point.alternatives))
    return f"{point.flag} {path}{signature} cannot be called as slime calls it, {forms}: {one_line(first_error)}"


def check_extension_points(args, error):
    by_flag = {point.flag: point for point in EXTENSION_POINTS}
    for point in EXTENSION_POINTS:
        value = getattr(args, point.dest, None)  # a row may name a flag that a custom parser does not define
        for path in value if isinstance(value, list) else [value]:  # repeatable flags hold a list
            reason = check_extension_point(point, path) if path else None
            if reason:
                error(reason)
    if args.eval_config:  # an eval dataset's own reward and generate functions
        for d in args.eval_datasets or []:
            for key, flag in (
                ("custom_rm_path", "--custom-rm-path"),
                ("custom_generate_function_path", "--custom-generate-function-path"),
            ):
                path = getattr(d, key)
                reason = check_extension_point(by_flag[flag], path) if path else None
                if reason:
                    error(f"--eval-config {args.eval_config}: dataset {d.name}: {key} as {reason}")


# ---------------------------------------------------------------------------------------------------------------
# Value ranges (on every parse: they need no files)
# ---------------------------------------------------------------------------------------------------------------


def _at_least(n):
    return (lambda v: v >= n), f">= {n}"


def _above(n):
    return (lambda v: v > n), f"> {n}"


def _between(lo, hi):
    return (lambda v: lo <= v <= hi), f"in [{lo}, {hi}]"


def _top_k():
    return (lambda v: v == -1 or v >= 1), "-1 (off) or >= 1"


def _top_p():
    return (lambda v: 0 < v <= 1), "in (0, 1]"


# (dest, bound, why); None values are skipped (an unset optional flag).
VALUE_RANGES = (
    ("rollout_batch_size", _at_least(1), "prompts per rollout"),
    ("n_samples_per_prompt", _at_least(1), "responses generated per prompt"),
    ("n_samples_per_eval_prompt", _at_least(1), "responses generated per eval prompt"),
    ("rollout_max_response_len", _at_least(1), "the token budget of a response"),
    ("eval_max_response_len", _at_least(1), "the token budget of an eval response"),
    ("rollout_max_prompt_len", _at_least(1), "prompts longer than this are dropped"),
    ("rollout_max_context_len", _at_least(2), "a prompt token and a response token"),
    ("eval_max_context_len", _at_least(2), "a prompt token and a response token"),
    ("eval_max_prompt_len", _at_least(1), "eval prompts longer than this are dropped"),
    ("load_debug_rollout_data_subsample", ((lambda v: 0 < v <= 1), "in (0, 1]"), "the fraction of a dump replayed"),
    ("global_batch_size", _at_least(1), "samples per optimizer step"),
    ("micro_batch_size", _at_least(1), "samples per forward pass"),
    ("num_steps_per_rollout", _at_least(1), "optimizer steps per rollout"),
    ("num_rollout", _at_least(0), "rollouts to train; 0 with --eval-interval evaluates only"),
    ("num_epoch", _at_least(1), "epochs over --prompt-data"),
    ("over_sampling_batch_size", _at_least(1), "prompts submitted per round"),
    ("actor_num_nodes", _at_least(1), "nodes of training actors"),
    ("actor_num_gpus_per_node", _at_least(1), "GPUs per training node"),
    ("rollout_num_gpus", _at_least(1), "GPUs of the inference engines"),
    ("rollout_num_gpus_per_engine", _at_least(1), "GPUs per inference engine"),
    ("rollout_num_gpus_per_node", _at_least(1), "GPUs per inference node"),
    ("update_weights_interval", _at_least(1), "rollouts between weight updates"),
    ("max_staleness", _at_least(0), "weight versions a trained sample may lag, 0 = on-policy"),
    ("update_weight_buffer_size", _at_least(1), "bytes per weight-update bucket"),
    ("update_weight_timeout", _above(0), "seconds a weight update may take"),
    ("save_interval", _at_least(1), "rollouts between checkpoints"),
    ("eval_interval", _at_least(1), "rollouts between evaluations"),
    ("start_rollout_id", _at_least(0), "the first rollout id"),
    ("max_tokens_per_gpu", _at_least(1), "tokens per micro-batch with --use-dynamic-batch-size"),
    ("log_probs_max_tokens_per_gpu", _at_least(1), "tokens per log-prob micro-batch"),
    ("sglang_server_concurrency", _at_least(1), "requests in flight per engine"),
    ("rollout_temperature", _at_least(0), "the sampling temperature (0 = greedy, with --debug-rollout-only)"),
    ("eval_temperature", _at_least(0), "the eval sampling temperature (0 = greedy)"),
    ("rollout_top_p", _top_p(), "nucleus sampling mass"),
    ("eval_top_p", _top_p(), "eval nucleus sampling mass"),
    ("rollout_top_k", _top_k(), "top-k sampling"),
    ("eval_top_k", _top_k(), "eval top-k sampling"),
    ("eps_clip", _at_least(0), "the PPO clip range"),
    ("eps_clip_high", _at_least(0), "the upper PPO clip range"),
    ("gamma", _between(0, 1), "the discount factor"),
    ("tis_clip", _above(0), "the truncated importance-sampling cap"),
    ("rollout_health_check_interval", _above(0), "seconds between engine health checks"),
    ("rollout_health_check_timeout", _above(0), "seconds an engine's /health_generate may take"),
    ("rollout_health_check_first_wait", _at_least(0), "seconds before the first health check of a rollout"),
    ("rollout_request_timeout", _above(0), "seconds one /generate request may take"),
    ("rollout_group_timeout", _above(0), "seconds one prompt group may take"),
)


def check_value_ranges(args, error):
    for dest, (ok, bound), why in VALUE_RANGES:
        value = getattr(args, dest, None)  # a custom parser may pre-empt a flag with another meaning
        if dest == "rollout_num_gpus" and value == 0 and args.rollout_external_engine_addrs:
            continue  # external engines: slime places none of its own
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not ok(value):
            error(f"--{dest.replace('_', '-')} {value}: must be {bound} ({why}).")


# ---------------------------------------------------------------------------------------------------------------
# Files: checkpoints, output directories, prompt data
# ---------------------------------------------------------------------------------------------------------------


def _check_writable_dir(flag, path, error):
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".slime-write-check-"):
            pass
    except OSError as e:
        error(f"{flag} {path} is not a writable directory ({e.strerror or one_line(e)}).")


def check_output_dirs(args, error):
    if args.save:
        _check_writable_dir("--save", args.save, error)
    if args.dump_details:
        _check_writable_dir("--dump-details", args.dump_details, error)
    if args.metrics_path:
        _check_writable_dir("--metrics-path", os.path.dirname(os.path.abspath(args.metrics_path)), error)


def _check_checkpoint(flag, root, step, error):
    """A checkpoint directory with a tracker must name an iteration whose directory exists."""
    if not os.path.isdir(root):
        return
    try:
        iteration = step if step is not None else read_tracker(root)
    except (OSError, ValueError) as e:
        error(f"{flag} {root}: unreadable {TRACKER} ({one_line(e)}).")
    if iteration is None:
        return
    ckpt = checkpoint_dir(root, iteration)
    if not os.path.isdir(ckpt):
        source = f"--ckpt-step {step}" if step is not None else f"{TRACKER} says {iteration}"
        error(f"{flag} {root}: checkpoint directory {os.path.basename(ckpt)} does not exist ({source}).")
    if not os.access(ckpt, os.R_OK | os.X_OK):
        error(f"{flag} {root}: checkpoint directory {ckpt} is not readable.")


def check_checkpoints(args, error, user_load):
    """`user_load` is --load as given (validation may replace it with --ref-load when it holds no checkpoint)."""
    if args.ref_load is not None:
        if not os.path.isdir(args.ref_load):
            error(f"--ref-load {args.ref_load} is not a directory (the reference / initial Megatron checkpoint).")
        _check_checkpoint("--ref-load", args.ref_load, args.ref_ckpt_step, error)
    if user_load is not None and args.load == user_load:
        _check_checkpoint("--load", user_load, args.ckpt_step, error)


@dataclasses.dataclass
class _PromptFile:
    flag: str  # how the user named it
    path: str
    input_key: str
    label_key: str | None
    tool_key: str | None
    metadata_key: str
    apply_chat_template: bool
    max_response_len: int
    budget: str  # the flag or key of max_response_len
    multimodal_keys: dict | str | None = None  # None: --multimodal-keys
    apply_chat_template_kwargs: dict | None = None  # None: --apply-chat-template-kwargs


def _prompt_files(args):
    """Every prompt file the run reads, with the keys it is read with."""
    files = []
    if args.rollout_global_dataset and args.prompt_data and not args.debug_train_only:
        files.append(
            _PromptFile(
                "--prompt-data",
                args.prompt_data,
                args.input_key,
                args.label_key,
                args.tool_key,
                args.metadata_key,
                args.apply_chat_template,
                args.rollout_max_response_len,
                "--rollout-max-response-len",
            )
        )
    source = f"--eval-config {args.eval_config}: dataset" if args.eval_config else "--eval-prompt-data"
    for d in args.eval_datasets or []:
        files.append(
            _PromptFile(
                f"{source} {d.name}",
                d.path,
                d.input_key,
                d.label_key,
                d.tool_key,
                d.metadata_key,
                d.apply_chat_template,
                d.max_response_len,
                "its max_response_len"
                if args.eval_config
                else ("--eval-max-response-len" if args.eval_max_response_len else "--rollout-max-response-len"),
                d.multimodal_keys,
                d.apply_chat_template_kwargs,
            )
        )
    return files


def _model_context(args):
    """(context length, where it comes from) of the inference engines, or (None, None) when unknown."""
    if args.sglang_context_length:
        return args.sglang_context_length, "--sglang-context-length"
    if not args.hf_checkpoint or not os.path.isdir(args.hf_checkpoint):
        return None, None
    from transformers import AutoConfig  # lazy: only with an HF checkpoint to read

    cfg = AutoConfig.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    length = getattr(cfg, "max_position_embeddings", None)
    return length, f"max_position_embeddings of --hf-checkpoint {args.hf_checkpoint}"


def check_prompt_data(args, error):
    """Each prompt file loads as the rollout will load it (keys, rows, chat template), and its longest prompt plus
    the response budget fits the model's context (SGLang refuses such requests mid-run)."""
    files = _prompt_files(args)
    if not files:
        return
    tokenizer = None
    if args.hf_checkpoint and os.path.isdir(args.hf_checkpoint):
        from transformers import AutoTokenizer  # heavy: only with an HF checkpoint

        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    context, context_source = _model_context(args)
    # the default rollout tokenizes text prompts itself; a custom generate / rollout may take anything
    default_generate = (
        args.custom_generate_function_path is None and args.rollout_function_path == DEFAULT_ROLLOUT_FUNCTION
    )
    for file in files:
        flag, path, max_response_len, budget = file.flag, file.path, file.max_response_len, file.budget
        if not os.path.isfile(path):
            error(f"{flag} {path}: no such file.")
        if not os.access(path, os.R_OK):
            error(f"{flag} {path}: not readable.")
        try:
            dataset = Dataset(
                path,
                tokenizer=tokenizer,
                max_length=args.rollout_max_prompt_len,
                prompt_key=file.input_key,
                label_key=file.label_key,
                tool_key=file.tool_key,
                metadata_key=file.metadata_key,
                apply_chat_template=file.apply_chat_template and tokenizer is not None,
                apply_chat_template_kwargs=(
                    args.apply_chat_template_kwargs
                    if file.apply_chat_template_kwargs is None
                    else file.apply_chat_template_kwargs
                ),
                **multimodal_dataset_kwargs(args, file.multimodal_keys),
            )
        except Exception as e:  # noqa: BLE001  (datasets / tokenizers raise many types; each names the file or row)
            error(f"{flag} {one_line(e)}")
        if (
            file.metadata_key != "metadata" and file.metadata_key not in dataset.column_names
        ):  # the default is optional
            error(
                f"{flag} {path}: no column {file.metadata_key!r} (--metadata-key); its columns are "
                f"{dataset.column_names}."
            )
        if len(dataset) == 0:
            error(
                f"{flag} {path}: no usable prompts (empty, or every prompt is longer than --rollout-max-prompt-len "
                f"{args.rollout_max_prompt_len})."
            )
        if not default_generate:
            continue
        not_text = next((i for i, s in enumerate(dataset.origin_samples) if not isinstance(s.prompt, str)), None)
        if not_text is not None:
            kind = type(dataset.origin_samples[not_text].prompt).__name__
            error(
                f"{flag} {path}: row {dataset.origin_rows[not_text] + 1} has a {kind} prompt, but the default "
                "rollout sends text: pass --apply-chat-template for chat messages, or convert the column to text."
            )
        if context is None or tokenizer is None:
            continue
        if max_response_len >= context:
            error(
                f"{flag} {path}: {budget} {max_response_len} alone reaches the model's context of {context} tokens "
                f"({context_source})."
            )
        texts = [(i, s.prompt) for i, s in enumerate(dataset.origin_samples) if isinstance(s.prompt, str)]
        if not texts:
            continue
        lengths = tokenizer([t for _, t in texts], add_special_tokens=False)["input_ids"]
        longest, index = max((len(ids), i) for (i, _), ids in zip(texts, lengths))
        row = dataset.origin_rows[index]
        if longest + max_response_len >= context:
            error(
                f"{flag} {path}: row {row + 1} has a prompt of {longest} tokens; with {budget} {max_response_len} it "
                f"reaches the model's context of {context} tokens ({context_source}). Lower {budget} or set "
                "--rollout-max-prompt-len."
            )


def check_inputs(args, error, user_load=None):
    """Everything that reads files or imports the user's code; runs at the end of `parse_args`."""
    check_extension_points(args, error)
    check_quantized_checkpoint(args, error)
    check_checkpoints(args, error, user_load)
    check_output_dirs(args, error)
    check_prompt_data(args, error)


# ---------------------------------------------------------------------------------------------------------------
# The cluster (right after connecting to Ray, before any actor starts)
# ---------------------------------------------------------------------------------------------------------------


def check_cluster(args, num_gpus):
    """The run's placement group (`num_gpus` bundles of one GPU and one CPU) fits the cluster Ray connected to."""
    import ray  # lazy: argument parsing must not import Ray

    total = ray.cluster_resources()
    short = [
        f"{k} {n} needed, the cluster has {total.get(k, 0):g}"
        for k, n in (("GPU", num_gpus), ("CPU", num_gpus))
        if n > total.get(k, 0)
    ]
    if short:
        raise StartupError(
            f"the run needs {num_gpus} GPU bundles (--actor-num-nodes x --actor-num-gpus-per-node + --rollout-num-gpus, "
            f"or their maximum with --colocate) but {'; '.join(short)}. Lower them, or start Ray with more GPUs "
            "(ray start --head --num-gpus N)."
        )
    largest = max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")), default=0)
    for flag, per_node in (
        ("--actor-num-gpus-per-node", args.actor_num_gpus_per_node if not args.debug_rollout_only else 0),
        (
            "--rollout-num-gpus-per-engine",
            0
            if args.debug_train_only or args.rollout_external
            else min(args.rollout_num_gpus_per_engine, args.rollout_num_gpus_per_node),
        ),
    ):
        if per_node > largest:
            raise StartupError(
                f"{flag} {per_node}: no node of the cluster has that many GPUs (the largest has {largest:g})."
            )
