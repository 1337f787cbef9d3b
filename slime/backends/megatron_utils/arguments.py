"""Megatron-LM's side of slime's command line: its flag names and defaults (for when only the megatron-core wheel is
installed), the HF config.json -> Megatron architecture mapping, and the Megatron defaults and checks applied after
parsing. `slime.config.parse_args` assembles the whole command line from this and slime's own groups."""

import argparse
import importlib.util
import logging
import os
import re
import sys

import torch

from slime.utils.device import (
    bf16_by_default,
    default_transformer_impl,
    dist_backend,
    gradient_accumulation_fusion_by_default,
    note_cpu_fallbacks,
    sequence_parallel_possible,
    transformer_engine_usable,
)
from slime.utils.lora_utils import resolve_target_modules

logger = logging.getLogger(__name__)

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
        "position; taken from a Qwen2.5-VL --hf-checkpoint's rope_parameters.mrope_section.",
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


# HF model_type -> the layer spec (module, function) that builds it: transformers modules in Megatron layers.
HYBRID_SPECS = {
    "qwen3_next": ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"),
    "qwen3_5_text": ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"),
    "qwen3_5_moe_text": ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"),
}
# HF text model_type of a vision-language checkpoint -> the model provider (current slime's `--spec` protocol) that
# builds its language model and vision tower.
VLM_SPECS = {"qwen2_5_vl_text": ("slime_plugins.models.qwen2_5_vl", "get_qwen2_5_vl_model_provider")}


def hf_architecture(cfg) -> dict:
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
        "add_qkv_bias": model_type in ("qwen2", "qwen2_moe", "mimo", "qwen2_5_vl_text")
        or bool(getattr(cfg, "attention_bias", False)),
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
    if model_type in VLM_SPECS:  # 3-D (temporal, height, width) positions, Qwen2-VL's contiguous frequency sections
        arch.update(position_embedding_type="mrope", mrope_section=list(rope["mrope_section"]))
        arch["spec"] = list(VLM_SPECS[model_type])
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
    if model_type in HYBRID_SPECS:  # Gated DeltaNet layers between gated full-attention layers
        from slime_plugins.models.qwen3_next import hybrid_layer_types  # heavy (transformers modeling)

        for i, kind in enumerate(hybrid_layer_types(cfg)):
            if kind not in ("linear_attention", "full_attention"):
                raise ValueError(f"layer_types[{i}]={kind!r} is not a layer type slime can build for {model_type!r}")
        arch.update(spec=list(HYBRID_SPECS[model_type]), apply_layernorm_1p=True, attention_output_gate=True)
        if arch.get("num_experts"):
            # Qwen3.5-MoE: every layer routed (no mlp_only_layers / decoder_sparse_step), no dense MLP size
            step = getattr(cfg, "decoder_sparse_step", None) or 1
            sparse = [
                0 if i in (getattr(cfg, "mlp_only_layers", None) or []) or (i + 1) % step else 1
                for i in range(cfg.num_hidden_layers)
            ]
            arch.update(
                ffn_hidden_size=arch["ffn_hidden_size"] or arch["moe_ffn_hidden_size"],
                moe_layer_freq=sparse,
                moe_shared_expert_gate=True,
                moe_router_pre_softmax=not getattr(cfg, "norm_topk_prob", True),
            )
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
    ("model_type", "--attention-output-gate", "attention_output_gate"),
    ("model_type", "--apply-layernorm-1p", "apply_layernorm_1p"),
    ("shared_expert_gate", "--moe-shared-expert-gate", "moe_shared_expert_gate"),
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
    "attention_output_gate",
    "apply_layernorm_1p",
    "moe_shared_expert_gate",
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
        if dest == "attention_output_gate":
            mine = mine or args.use_gated_attention
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
HF_DROPOUT_KEYS = {
    "attention_dropout": ("attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"),
    "hidden_dropout": ("hidden_dropout", "hidden_dropout_prob", "resid_pdrop"),
}


def _dropout_from_hf(args, cfg, given):
    """Megatron's default dropout (0.1) is not what the HF model was trained with and perturbs RL's first-step
    invariants: flags the user did not give take the HF config's value."""
    for dest, keys in HF_DROPOUT_KEYS.items():
        flag = "--" + dest.replace("_", "-")
        if flag in given:
            continue
        value = next((float(getattr(cfg, k)) for k in keys if getattr(cfg, k, None) is not None), 0.0)
        setattr(args, dest, value)
        logger.info(
            "%s %s taken from --hf-checkpoint %s/config.json (flag not given)", flag, value, args.hf_checkpoint
        )


def apply_hf_config(args, error, check_paths, given=frozenset()):
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
    cfg = getattr(cfg, "text_config", None) or cfg  # vision-language checkpoints: the decoder's config
    if not hasattr(cfg, "num_hidden_layers") or not hasattr(cfg, "num_attention_heads"):
        return  # not a decoder LLM config we know how to map; Megatron flags must be given
    try:
        arch = hf_architecture(cfg)
    except ValueError as e:
        error(f"--hf-checkpoint {path}/config.json: {e}.")
    infer_all = args.num_layers is None  # no MODEL_ARGS at all: the HF config is the whole description
    for dest, value in arch.items():
        if value is None or not hasattr(args, dest):
            continue
        if infer_all or getattr(args, dest) is None:
            setattr(args, dest, value)
    mismatches = _hf_mismatches(args, arch, cfg)
    hf_mtp = getattr(cfg, "num_nextn_predict_layers", 0) or 0
    key = "num_nextn_predict_layers"
    if not hf_mtp and getattr(cfg, "mtp_num_hidden_layers", 0):
        # Qwen3-Next / Qwen3.5: their checkpoints share one `mtp.fc` and its norms over every MTP layer, while
        # Megatron's MTP block keeps them per depth, so only one depth maps onto their names
        hf_mtp, key = cfg.mtp_num_hidden_layers, "mtp_num_hidden_layers"
        if args.mtp_num_layers and args.mtp_num_layers > 1:
            error(
                f"--mtp-num-layers {args.mtp_num_layers}: --hf-checkpoint {path}/config.json keeps its MTP layers "
                "as mtp_num_hidden_layers, which share one mtp.fc / pre_fc_norm_* / norm that Megatron's MTP block "
                "holds per depth; slime trains 1 of them: give --mtp-num-layers 1."
            )
    if args.mtp_num_layers and args.mtp_num_layers > hf_mtp:
        error(
            f"--mtp-num-layers {args.mtp_num_layers}: --hf-checkpoint {path}/config.json has {hf_mtp} "
            f"multi-token-prediction layer(s) ({key}); give at most that many, or drop the flag."
        )
    if hf_mtp and not args.mtp_num_layers:
        logger.info(
            "--hf-checkpoint %s has %d multi-token-prediction layer(s): without --mtp-num-layers the trainer builds "
            "no MTP block, so weight updates and exports leave them out (the engine keeps the checkpoint's).",
            path,
            hf_mtp,
        )
    if mismatches:
        error(
            f"Megatron model flags disagree with --hf-checkpoint {path}/config.json: {'; '.join(mismatches)}. "
            "Fix the MODEL_ARGS (or drop them to infer everything from the HF config)."
        )


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


def check_hybrid_model(args, error):
    """Start-up checks of the layer specs that wrap transformers modules (slime_plugins/models/qwen3_*.py)."""
    args.attention_output_gate = bool(args.attention_output_gate or args.use_gated_attention)
    if not args.spec or tuple(args.spec) not in HYBRID_SPECS.values():
        return
    from slime_plugins.models.qwen_gdn_backend import gdn_backend_problem

    # every parallel layout is supported (context parallelism: hf_attention's docstring); only the kernel can fail
    problem = gdn_backend_problem(args.qwen_gdn_backend)
    if problem:
        error(problem + ".")


def check_vlm_training(args, error):
    """`--multimodal-keys` in a training run: the trainer takes images for the vision-language models it builds
    (`VLM_SPECS`), in the layouts tested so far; anything else is one line naming what is missing."""
    if not args.spec or tuple(args.spec) not in VLM_SPECS.values():
        error(
            f"--multimodal-keys: the trainer takes images for Qwen2.5-VL only, but --hf-checkpoint {args.hf_checkpoint} "
            "is not a Qwen2.5-VL checkpoint (other vision-language families are not built yet); rollouts with "
            "images run with --debug-rollout-only."
        )
    layout = [
        (args.pipeline_model_parallel_size, "--pipeline-model-parallel-size"),
        (args.context_parallel_size, "--context-parallel-size"),
    ]
    for size, flag in layout:
        if size > 1:
            error(f"{flag} {size}: training Qwen2.5-VL on images is tested at PP=1, CP=1 only so far.")
    if getattr(args, "tree_training", False):
        error("--tree-training with --multimodal-keys: the prefix-tree layout has no 3-D (MRoPE) positions.")


def check_param_patterns_match(args, error):
    """A --freeze-params-name-list / --only-train-params-name-list pattern that matches no parameter is refused at
    start-up, not once Ray and the trainers are up. The names come from the model flags and --hf-checkpoint's
    tensors (a superset of the model's: `model_provider.freeze_model_params` has the last word)."""
    only, freeze = args.only_train_params_name_list, args.freeze_params_name_list
    patterns = only or freeze
    if not patterns or not args.hf_checkpoint or args.custom_model_provider_path or not args.num_layers:
        return
    try:
        from .megatron_to_hf.names import possible_param_names

        names = possible_param_names(args)
    except (ImportError, OSError, ValueError):  # no Megatron here, or an unreadable checkpoint (refused elsewhere)
        return
    flag = "--only-train-params-name-list" if only else "--freeze-params-name-list"
    for pattern in patterns:
        if not any(re.search(pattern, n) for n in names):
            error(
                f"{flag}: {pattern!r} matches no parameter of the model of --hf-checkpoint {args.hf_checkpoint} "
                "(Megatron names, re.search: e.g. embedding.word_embeddings.weight, "
                f"decoder.layers.0.self_attention.linear_qkv.weight, decoder.layers.{args.num_layers - 1}.mlp."
                "linear_fc2.weight, output_layer.weight)."
            )


def check_tree_training(args, error):
    """`--tree-training` (local layer spec; DP, TP, PP, EP, dynamic batching, critic, routing replay): refuse, one line
    naming the flag, what it does not do. Exactness rests on the local spec's `DotProductAttention` honouring the
    dense ancestor mask and on `model.rope_by_position` finding megatron-core's `RotaryEmbedding`: a model built
    any other way is refused."""
    if not args.tree_training:
        return
    refusals = [
        (args.context_parallel_size > 1, "context parallelism (--context-parallel-size > 1)"),
        # untested: CPU has no sequence-parallel norms, and at TP 1 the flag is dropped anyway
        (
            args.sequence_parallel and args.tensor_model_parallel_size > 1,
            "sequence parallelism (--sequence-parallel)",
        ),
        (bool(args.spec), "a custom or hybrid layer spec (--spec, e.g. Qwen3-Next/Qwen3.5 linear attention)"),
        (bool(args.custom_model_provider_path), "a custom model provider (--custom-model-provider-path)"),
        (bool(args.mtp_num_layers), "MTP (--mtp-num-layers)"),
        (bool(args.multi_latent_attention), "multi-latent attention (--multi-latent-attention)"),
        (
            args.position_embedding_type not in ("rope", "none", "learned_absolute"),
            f"--position-embedding-type {args.position_embedding_type}",
        ),
        (args.rope_type == "yarn", "YaRN RoPE (--rope-type yarn)"),
    ]
    for refused, what in refusals:
        if refused:
            error(f"--tree-training does not support {what} yet.")
    from slime.backends.megatron_utils.model_provider import use_transformer_engine  # heavy (megatron)

    if use_transformer_engine(args):
        error(
            "--tree-training needs the local layer spec (--transformer-impl local): the Transformer-Engine path "
            "(THD packing) has no tree-mask kernel yet."
        )


def check_mtp(args, error):
    if args.mtp_num_layers is not None and args.mtp_num_layers < 1:
        error(f"--mtp-num-layers {args.mtp_num_layers}: give a positive number of MTP layers, or drop the flag.")
    if args.mtp_loss_scaling_factor < 0:
        error(f"--mtp-loss-scaling-factor {args.mtp_loss_scaling_factor} must be >= 0.")
    if args.enable_mtp_training and not args.mtp_num_layers:
        error("--enable-mtp-training needs --mtp-num-layers (the number of MTP layers to train).")
    if args.mtp_num_layers and args.custom_model_provider_path:
        error(
            f"--mtp-num-layers with --custom-model-provider-path {args.custom_model_provider_path}: slime builds "
            "the MTP block in its own model provider; drop one of them."
        )


def megatron_defaults(args):
    """Megatron defaults that depend on the machine or on other flags (what Megatron's validate_args derives)."""
    if args.norm_epsilon is None:
        args.norm_epsilon = 1e-5
    if args.rotary_base is None:
        args.rotary_base = 10000
    if args.transformer_impl is None:
        args.transformer_impl = default_transformer_impl()
    if args.gradient_accumulation_fusion is None:
        # Megatron's default (on), where the fused weight-gradient accumulation exists: Transformer Engine's layers
        args.gradient_accumulation_fusion = (
            gradient_accumulation_fusion_by_default() and args.transformer_impl == "transformer_engine"
        )
    if args.distributed_backend is None:
        args.distributed_backend = dist_backend()
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        args.position_embedding_type = "none"  # --no-position-embedding: no learned absolute positions
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
    if args.distributed_backend == "nccl" and dist_backend() == "gloo":
        error("--distributed-backend nccl needs GPUs; this machine trains on CPU: use gloo, or drop the flag.")
    if args.distributed_timeout_minutes <= 0:
        error(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be > 0.")
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
    if args.fp8 and not (args.transformer_impl == "transformer_engine" and transformer_engine_usable()):
        error(
            f"--fp8-format {args.fp8}: FP8 training runs Transformer Engine's FP8 GEMMs, which this machine's "
            "layers (local: no Transformer Engine, or a CPU) do not have: run on a GPU with Transformer Engine, "
            "or drop --fp8-format/--fp8-recipe (training in bf16)."
        )
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
    note_cpu_fallbacks(logger)


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


def megatron_training_available():
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        return False


def parse_with_megatron(add_slime_arguments, argv):
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


def lora_validate_args(args, error):
    """--enable-lora's rules, once the model flags are final: known target modules, 0 < rank <= each layer's
    smaller side, dense decoder layers without Transformer Engine's fused layers."""
    if not args.enable_lora:
        if args.lora_sync != "merged":
            error(f"--lora-sync {args.lora_sync} needs --enable-lora")
        return
    if args.lora_sync == "adapter" and args.update_weight_transport == "disk":
        error(
            "--lora-sync adapter sends the adapters inside the update request: drop --update-weight-transport disk, "
            "or use --lora-sync merged"
        )
    if args.lora_sync == "adapter" and args.check_weight_update_equal:
        error(
            "--check-weight-update-equal checks full weight pushes; with --lora-sync adapter the engines keep their "
            "base and verify every adapter tensor by sha256: drop one of the two"
        )
    from slime.backends.megatron_utils.lora import layer_dims  # lazy: megatron-core

    try:
        targets = resolve_target_modules(args.lora_target_modules)
    except ValueError as e:
        error(f"--lora-target-modules: {e}")
    if args.lora_rank <= 0:
        error(f"--lora-rank {args.lora_rank} must be positive")
    dims = layer_dims(args)
    for t in targets:
        smallest = min(dims[t])
        if args.lora_rank > smallest:
            error(f"--lora-rank {args.lora_rank} must be in 1..{smallest} for {t} (in, out = {dims[t]})")
    if not 0 <= args.lora_dropout < 1:
        error(f"--lora-dropout {args.lora_dropout} must be in [0, 1)")
    if args.multi_latent_attention:
        error(
            "--enable-lora: multi-latent attention (DeepSeek-V3 family) is not supported; LoRA covers dense GPT layers"
        )
    if args.num_experts and any(t.startswith("mlp.") for t in targets):
        error(
            "--enable-lora with --num-experts: adapters on MoE experts are not supported; use "
            "--lora-target-modules linear_qkv linear_proj (attention only)"
        )
    if args.transformer_impl != "local" and transformer_engine_usable():
        error(
            "--enable-lora needs megatron-core's local layers (Transformer Engine fuses the norm into linear_qkv / "
            "linear_fc1): add --transformer-impl local"
        )
