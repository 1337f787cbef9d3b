"""Megatron-LM's flag names and defaults, for when only the megatron-core wheel is installed (megatron.training is
not importable); `slime.config.parse_args` adds them to slime's command line."""

import argparse
import os
import re


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


def add_hybrid_model_arguments(parser):
    """Megatron flags of the Qwen3-Next / Qwen3.5 layers (gated attention, gated shared expert)."""
    g = parser.add_argument_group("megatron: gated attention and shared-expert gate")
    g.add_argument(
        "--attention-output-gate",
        action="store_true",
        default=False,
        help="Attention output multiplied by sigmoid(gate), the gate projected with q (Qwen3-Next, Qwen3.5).",
    )
    g.add_argument(
        "--use-gated-attention", action="store_true", default=False, help="Same as --attention-output-gate."
    )
    g.add_argument(
        "--moe-shared-expert-gate",
        action="store_true",
        default=False,
        help="Shared-expert output multiplied by sigmoid(x . w) (Qwen3-Next, Qwen3.5 MoE).",
    )


def add_megatron_arguments(parser):
    """Megatron-LM flag names, meanings and defaults (a default of None below is resolved later where Megatron's
    default depends on the machine or on the HF config: see `megatron_defaults`)."""
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
        "--mrope-section",
        type=int,
        nargs="+",
        default=None,
        help="Multimodal RoPE (--position-embedding-type mrope): rotary frequency pairs per (temporal, height, width) "
        "position; taken from a vision-language --hf-checkpoint's rope_parameters.mrope_section.",
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
        "--mtp-num-layers",
        type=int,
        default=None,
        help="Build the first N multi-token-prediction layers (MiMo, DeepSeek-V3, GLM-4.5; Qwen3-Next, Qwen3.5: 1).",
    )
    g.add_argument("--mtp-loss-scaling-factor", type=float, default=0.1, help="Weight of the MTP loss.")
    add_hybrid_model_arguments(parser)

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
    g.add_argument(
        "--distributed-timeout-minutes",
        type=int,
        default=10,
        help="Timeout of the trainers' process group: its rendezvous and every collective.",
    )
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
    g.add_argument(
        "--fp8-format",
        dest="fp8",  # Megatron-LM's dest
        choices=["e4m3", "hybrid"],
        default=None,
        help="FP8 training: Transformer Engine's FP8 GEMMs (GPU with Transformer Engine only; refused elsewhere).",
    )
    g.add_argument(
        "--fp8-recipe",
        choices=["tensorwise", "delayed", "mxfp8", "blockwise", "custom"],
        default="delayed",
        help="Scaling recipe of --fp8-format (Transformer Engine's; blockwise needs Hopper or newer).",
    )

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
    g.add_argument(
        "--enable-experimental",
        action="store_true",
        default=False,
        help="megatron-core's experimental features (its set_experimental_flag; in this megatron-core: the fused "
        "MoE permute of --moe-permute-fusion, GPU only).",
    )
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=int, default=None)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    # profiling (Megatron-LM's flags; what slime does with them: slime/observability/profile_utils.py)
    g.add_argument("--use-pytorch-profiler", action="store_true", default=False)
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--record-memory-history", action="store_true", default=False)
    g.add_argument("--memory-snapshot-path", type=str, default="snapshot.pickle")
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
    g.add_argument(
        "--save-interval",
        type=int,
        default=None,
        help="A checkpoint after every N-th rollout, at each epoch's end and after the last rollout.",
    )
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
    g.add_argument(
        "--async-save",
        action="store_true",
        default=False,
        help="Write each checkpoint from a process forked off every trainer while training goes on; the tracker names "
        "it once written (docs/usage.md#checkpoints-megatron).",
    )
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
