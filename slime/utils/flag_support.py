"""Current upstream slime's flags here: each is honoured with upstream's meaning, or refused at start-up in one line.

`upstream_flags.json` (written by `tools/record_upstream_flags.py`) lists every flag upstream slime declares. A flag
this slime has no code for is still parsed, with upstream's type and default, so a current launch script never
dies on "unrecognized arguments"; `refuse_unsupported` then stops the job (exit 2) on the first refused flag whose
value differs from upstream's default, naming it, why, and what to do instead. `REFUSED` is the only place a
flag is refused; `docs/flags.md` is generated from it (`tools/gen_flags_doc.py`).
"""

import argparse
import json
import os

UPSTREAM_FLAGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_flags.json")


# flag -> why it is refused here, and what to do instead (one line each).
REFUSED = {
    # cannot exist on this stack
    "--prefill-num-servers": "prefill/decode disaggregation needs SGLang's KV transfer between GPU engines, which "
    "this slime does not drive: drop it (every engine serves both phases)",
    "--rollout-data-transport": "NIXL transport of rollout data needs Ray's NIXL (RDMA): drop it (rollout data goes "
    "through Ray's object store)",
    "--megatron-deepgemm-forward-layers": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this slime: "
    "drop it",
    "--megatron-deepgemm-forward-modules": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this "
    "slime: drop it",
    "--megatron-deepgemm-moe-forward-layers": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this "
    "slime: drop it",
    "--megatron-deepgemm-moe-forward-modules": "DeepGEMM forward kernels are GLM-5-only FP8 GPU kernels not in this "
    "slime: drop it",
    "--allgather-cp": "all-gather context parallelism is only for DSA sparse-attention models (DeepSeek-V3.2, "
    "GLM-5.1; upstream refuses it for every other model), which this slime does not build: drop it (context "
    "parallelism splits sequences in zigzag order)",
    "--freeze-indexer": "the DSA indexer belongs to GLM-5's sparse attention, which this slime does not build: drop it",
    "--train-backend": "Megatron is the only training backend (as in current slime, which removed FSDP): drop it",
    "--load-forge-rollout-data": "forge replay keeps engines and weight sync live while replaying dumps, for GPU "
    "memory tests: use --load-debug-rollout-data",
    # not implemented here yet
    "--min-batch-collection-ratio": "collecting part of a batch from the rollout buffer is not built (current slime "
    "declares this flag and reads it nowhere either): drop it (every batch is collected whole)",
    # sglang-router flags that slime sets itself when it starts the router (as current slime does), so a value given
    # here would be overwritten (slime/backends/sglang_utils/router.py: router_args_of)
    "--worker-urls": "slime starts the router with no workers and each engine registers itself once it is up: drop "
    "it (--rollout-external-engine-addrs for engines slime does not start)",
    "--router-prometheus-host": "slime binds the router's Prometheus exporter on the router's own host: drop it",
    "--router-prometheus-port": "slime gives the router's Prometheus exporter a free port (sglang-router's 29000 is "
    "shared by every run on the host): drop it",
    "--router-request-timeout-secs": "slime sets the router's per-request timeout from "
    "--sglang-router-request-timeout-secs: use that",
}

# Megatron-LM flags that this slime's trainer does not implement and that would change the model, the schedule or
# the run (found by tests/test_flags_read.py: nothing read them). Refused when set, like the table above.
_NOT_BUILT = "not built by this slime's trainer: drop it"
_PRETRAINING = "Megatron-LM's pretraining data and loop, which slime replaces with rollouts (--prompt-data, --num-rollout): drop it"
REFUSED.update(
    {
        "--apply-residual-connection-post-layernorm": "post-layernorm residual connections are " + _NOT_BUILT,
        "--openai-gelu": "the OpenAI GeLU approximation is " + _NOT_BUILT + " (--swiglu or the default GeLU)",
        "--squared-relu": "the squared-ReLU activation is " + _NOT_BUILT + " (--swiglu or the default GeLU)",
        "--rotary-seq-len-interpolation-factor": "RoPE sequence-length interpolation is "
        + _NOT_BUILT
        + " (--use-rope-scaling / --rope-type yarn are)",
        "--encoder-num-layers": "encoder-decoder models are " + _NOT_BUILT + " (use --num-layers)",
        "--decoder-num-layers": "encoder-decoder models are " + _NOT_BUILT + " (use --num-layers)",
        "--moe-expert-capacity-factor": "MoE token dropping (expert capacity) is " + _NOT_BUILT,
        "--moe-pad-expert-input-to-capacity": "MoE token dropping (expert capacity) is " + _NOT_BUILT,
        "--moe-token-drop-policy": "MoE token dropping (expert capacity) is " + _NOT_BUILT,
        "--moe-input-jitter-eps": "MoE router input jitter is " + _NOT_BUILT,
        "--moe-z-loss-coeff": "the MoE router z-loss is " + _NOT_BUILT,
        "--use-checkpoint-args": "the architecture comes from the flags or --hf-checkpoint's config.json, never "
        "from a checkpoint: drop it",
        "--ckpt-format": "checkpoints are torch_dist (megatron-core dist_checkpointing) only: drop it",
        "--auto-detect-ckpt-format": "checkpoints are torch_dist (megatron-core dist_checkpointing) only: drop it",
        "--dist-ckpt-strictness": "loading checks every key of the checkpoint (slime's own loader): drop it",
        "--non-persistent-save-interval": "non-persistent checkpoints are " + _NOT_BUILT + " (--save-interval)",
        "--pretrained-checkpoint": "use --load (Megatron checkpoint) or --hf-checkpoint",
        "--exit-interval": "a run ends after --num-rollout rollouts (current slime ignores Megatron-LM's exit "
        "flags too): drop it",
        "--exit-duration-in-mins": "a run ends after --num-rollout rollouts (current slime ignores Megatron-LM's "
        "exit flags too): drop it",
        "--exit-on-missing-checkpoint": "a --load without a checkpoint starts from --ref-load / --hf-checkpoint: "
        "drop it",
        "--train-samples": _PRETRAINING,
        "--lr-decay-samples": "learning-rate schedules count optimizer steps here: use --lr-decay-iters",
        "--lr-warmup-samples": "learning-rate schedules count optimizer steps here: use --lr-warmup-iters",
        "--data-path": _PRETRAINING,
        "--split": _PRETRAINING,
        "--vocab-file": "the tokenizer is --hf-checkpoint's: drop it",
        "--merge-file": "the tokenizer is --hf-checkpoint's: drop it",
        "--tokenizer-type": "the tokenizer is --hf-checkpoint's (Hugging Face): drop it",
        "--tokenizer-model": "the tokenizer is --hf-checkpoint's: drop it",
        "--num-workers": _PRETRAINING,
        "--eval-iters": "evaluation runs --eval-prompt-data / --eval-config every --eval-interval rollouts: drop it",
        "--log-interval": "slime logs every rollout and every optimizer step: drop it",
        "--log-num-zeros-in-grad": "Megatron-LM's training-loop logging is " + _NOT_BUILT,
        "--log-params-norm": "Megatron-LM's training-loop logging is " + _NOT_BUILT,
        "--log-throughput": "Megatron-LM's training-loop logging is " + _NOT_BUILT + " (perf/* metrics are logged)",
        "--log-timers-to-tensorboard": "Megatron-LM's training-loop logging is "
        + _NOT_BUILT
        + " (perf/* timings go to --use-tensorboard)",
        "--timing-log-level": "Megatron-LM's training-loop logging is " + _NOT_BUILT,
        "--moe-per-layer-logging": "Megatron-LM's training-loop logging is " + _NOT_BUILT,
        "--use-legacy-models": "only megatron-core models are built: drop it",
        "--over-sampling-filter-input-size": "slime v0.1.0's over-sampling filter input size is gone (current slime "
        "dropped it too): use --over-sampling-batch-size",
    }
)

# Megatron-LM flags that cannot change what is trained (performance and memory knobs of kernels or optimizers this
# slime does not build): accepted so that current slime's model scripts run unchanged, and named in a warning at
# start-up when set, so nobody believes they took effect. flag -> why it has no effect here.
_KERNEL = "a GPU kernel choice, which cannot change what is trained"
NO_EFFECT = {
    "--attention-backend": _KERNEL + ": Transformer Engine picks its attention kernel on GPU, and slime's local "
    "attention runs on CPU",
    "--attention-softmax-in-fp32": "the attention softmax already runs in fp32 (megatron-core's default, kept here)",
    "--no-masked-softmax-fusion": _KERNEL,
    "--no-bias-gelu-fusion": _KERNEL,
    "--no-bias-swiglu-fusion": _KERNEL,
    "--no-bias-dropout-fusion": _KERNEL,
    "--no-persist-layer-norm": _KERNEL,
    "--cross-entropy-loss-fusion": "slime computes its own loss (log-probs over the vocabulary), never Megatron's "
    "fused cross entropy",
    "--use-flash-attn": _KERNEL + " (Transformer Engine's flash attention is used where it applies)",
    "--use-mcore-models": "megatron-core models are the only ones built (a deprecated no-op in Megatron-LM too)",
    "--moe-permute-fusion": _KERNEL + " (token permutation for the experts)",
    "--moe-enable-deepep": "DeepEP is an all-to-all kernel: tokens reach the same experts through megatron-core's "
    "alltoall dispatcher here",
    "--moe-use-legacy-grouped-gemm": _KERNEL,
    "--moe-shared-expert-overlap": "an overlap of communication with compute, which cannot change what is trained",
    "--tp-comm-overlap": "an overlap of communication with compute, which cannot change what is trained",
    "--overlap-param-gather": "an overlap of communication with compute, which cannot change what is trained",
    "--no-ckpt-fully-parallel-save": "how the checkpoint's shards are spread over ranks, not what is saved",
    "--ckpt-fully-parallel-load": "how the checkpoint's shards are spread over ranks, not what is loaded",
    "--ckpt-assume-constant-structure": "a save-time cache of the checkpoint's structure, not what is saved",
    "--optimizer-cpu-offload": "where the optimizer's state lives (GPU memory; --offload-train moves it to the CPU "
    "between steps), not what it computes",
    "--optimizer-offload-fraction": "where the optimizer's state lives, not what it computes",
    "--overlap-cpu-optimizer-d2h-h2d": "where the optimizer's state lives, not what it computes",
    "--use-precision-aware-optimizer": "the optimizer keeps fp32 main weights and state, which the precision-aware "
    "optimizer's defaults also keep",
    "--recompute-modules": "activation recomputation trades memory for time, never values (--recompute-granularity "
    "/ --recompute-method are read)",
    "--moe-layer-recompute": "activation recomputation trades memory for time, never values",
    "--empty-unused-memory-level": "when the CUDA caching allocator is emptied, which cannot change what is trained",
    "--manual-gc": "when Python's garbage collector runs, which cannot change what is trained",
    "--manual-gc-interval": "when Python's garbage collector runs, which cannot change what is trained",
    "--http-proxy": "current slime declares it and reads it nowhere (requests to the engines and the router go to "
    "their addresses directly)",
    "--use-http2": "current slime declares it and reads it nowhere (the client speaks HTTP/1.1, which every server "
    "here answers)",
    "--log-probs-max-tokens-per-gpu": "the log-prob pass reuses the training micro-batches (--max-tokens-per-gpu), "
    "which cannot change the log-probs (current slime declares it and reads it nowhere either)",
}


# Honoured flags whose default here is not upstream's (tests/test_flag_support.py compares every honoured flag's
# default with upstream_flags.json; docs/flags.md shows the default here and this reason). flag -> why (one line).
DEFAULT_DIFFERS = {
    "--distributed-backend": "chosen at start-up by the device (upstream's nccl wherever GPUs can run it)",
    "--qwen-gdn-backend": "chosen at start-up by the device (upstream's fla wherever GPUs can run it)",
    "--update-weight-transport": "auto: shared memory where engines share the trainer's host, else broadcast "
    "(upstream's nccl)",
    "--rollout-max-response-len": "1024 tokens: a bounded response unless set (upstream: unset, SGLang's "
    "max_new_tokens None)",
    "--lr": "required: a learning rate is never assumed (upstream: 1e-6)",
    "--no-save-optim": "Megatron-LM's null, made false at start-up: the same as upstream's false",
    "--sglang-router-request-timeout-secs": "an hour (upstream: 4 hours): a hung request fails sooner",
}


def warn_no_effect(args, parser, log):
    """One line per NO_EFFECT flag set away from its default, through `log` (a logger's warning)."""
    for flag, reason in NO_EFFECT.items():
        action = parser._option_string_actions.get(flag)
        if action is not None and getattr(args, action.dest) != action.default:
            log("%s: accepted, but has no effect in this slime: %s", flag, reason)


# Refused flags that upstream's own argument files do not declare (Megatron-LM flags its model scripts pass):
# parsed as Megatron-LM declares them.
EXTRA_DEFINITIONS = {
    "--use-gated-attention": {"action": "store_true", "default": False},
    "--attention-output-gate": {"action": "store_true", "default": False},
    "--moe-shared-expert-gate": {"action": "store_true", "default": False},
}

# Megatron-LM flags that current slime's launch scripts pass beyond what its argument files declare, and that the
# Megatron-compatible group (slime/backends/megatron_utils/megatron_flags.py) honours; listed in docs/flags.md with
# their help there. (scripts/run-glm5*-744B-A40B.sh: --enable-experimental; low_precision/run-qwen3-30b-a3b-fp8.sh: FP8.)
MEGATRON_SCRIPT_FLAGS = ("--enable-experimental", "--fp8-format", "--fp8-recipe")

# the recorder's marker of a keyword computed in upstream's source (its source text), e.g. 512 * 1024**2
COMPUTED = "__source__"


def is_computed(value):
    return isinstance(value, dict) and set(value) == {COMPUTED}


_TYPES = {"int": int, "float": float, "str": str, "json.loads": json.loads}


def upstream_flags():
    """The recorded table: [{flags, dest?, type?, action?, default?, ...origin}]."""
    with open(UPSTREAM_FLAGS) as f:
        return json.load(f)["flags"]


def _definition(entry):
    """add_argument keywords rebuilding an upstream flag as upstream declares it."""
    kwargs = {}
    action = entry.get("action")
    if isinstance(action, dict):  # computed: argparse.BooleanOptionalAction
        if action[COMPUTED] != "argparse.BooleanOptionalAction":
            raise ValueError(f"{entry['flags'][0]}: unknown action {action[COMPUTED]}")
        kwargs["action"] = argparse.BooleanOptionalAction
    elif action not in (None, "store"):
        kwargs["action"] = action
    if "type" in entry:
        kwargs["type"] = _TYPES[entry["type"]]
    for key in ("dest", "nargs", "choices", "const"):
        if key in entry:
            kwargs[key] = entry[key]
    default = entry.get("default")
    kwargs["default"] = None if is_computed(default) else default
    return kwargs


def add_refused_arguments(parser):
    """Parse every refused flag this parser does not know yet (as upstream declares it), so that a launch script
    using it reaches `refuse_unsupported` instead of dying on an unknown argument."""
    group = parser.add_argument_group("current slime's flags refused here (see docs/flags.md)")
    known = parser._option_string_actions
    by_flag = {f: e for e in upstream_flags() for f in e["flags"]}
    for flag in REFUSED:
        if flag in known:
            continue
        entry = by_flag.get(flag)
        if entry is not None:
            group.add_argument(*entry["flags"], **_definition(entry), help=argparse.SUPPRESS)
        elif flag in EXTRA_DEFINITIONS:
            group.add_argument(flag, **EXTRA_DEFINITIONS[flag], help=argparse.SUPPRESS)
        # else: a Megatron-LM flag this Megatron-LM no longer declares: nothing to parse, nothing to refuse
    return parser


def refuse_unsupported(args, parser, error):
    """Exit (status 2) naming the first refused flag set away from its default."""
    for flag, reason in REFUSED.items():
        action = parser._option_string_actions.get(flag)
        if action is None:  # e.g. a custom-arguments provider removed it: nothing to refuse
            continue
        default = action.default
        if isinstance(default, str) and action.type is not None:  # argparse converts a string default with `type`
            default = action.type(default)
        if getattr(args, action.dest) != default:
            error(f"{flag}: not supported by this slime: {reason}.")
