"""Megatron-LM's side of slime's command line after parsing: the Megatron defaults slime sets and the checks of
Megatron's flags against each other, the HF checkpoint and the machine. Its flag table is `megatron_flags.py`, the
HF config.json mapping `hf_config.py`; `slime.config.parse_args` assembles the whole command line."""

import importlib.util
import logging
import re
import sys

import torch

from slime.utils.device import (
    bf16_by_default,
    default_transformer_impl,
    default_tree_attention_backend,
    dist_backend,
    gradient_accumulation_fusion_by_default,
    note_cpu_fallbacks,
    sequence_parallel_possible,
    transformer_engine_usable,
)
from slime.utils.lora_utils import resolve_target_modules

from .hf_config import HYBRID_SPECS, HYBRID_VLM_SPECS, MINIMAX_M2_SPEC, VLM_SPECS

logger = logging.getLogger(__name__)


def use_transformer_engine(args) -> bool:
    """TE spec only on GPU with transformer_engine installed (and not forced off by --transformer-impl local)."""
    return args.transformer_impl != "local" and transformer_engine_usable()


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
    if not args.spec or tuple(args.spec) not in {*HYBRID_SPECS.values(), *HYBRID_VLM_SPECS.values()}:
        return
    from slime_plugins.models.qwen_gdn_backend import gdn_backend_problem

    # every parallel layout is supported (context parallelism: hf_attention's docstring); only the kernel can fail
    problem = gdn_backend_problem(args.qwen_gdn_backend)
    if problem:
        error(problem + ".")


def check_minimax_m2(args, error):
    """MiniMax-M2's key norm (slime_plugins/models/minimax_m2.py) gathers whole key heads over the TP group, which a
    TP size above the key/value heads would split (Megatron then copies heads across ranks)."""
    if not args.spec or tuple(args.spec) != MINIMAX_M2_SPEC:
        return
    kv_heads = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if kv_heads and args.tensor_model_parallel_size > kv_heads:
        error(
            f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: MiniMax-M2's full-width key norm needs "
            f"whole key/value heads on each TP rank, and the model has {kv_heads}; use at most {kv_heads}."
        )


def check_vlm_training(args, error):
    """`--multimodal-keys` in a training run: the trainer takes images for the vision-language models it builds
    (`VLM_SPECS`); anything else is one line naming what is missing."""
    if args.spec and tuple(args.spec) in HYBRID_SPECS.values():
        error(
            f"--multimodal-keys with --spec {' '.join(args.spec)}, the hybrid models' text-only decoder: drop the "
            "--spec pair (a model script's) and the vision-language model is built from --hf-checkpoint."
        )
    if not args.spec or tuple(args.spec) not in {*VLM_SPECS.values(), *HYBRID_VLM_SPECS.values()}:
        error(
            "--multimodal-keys: the trainer takes images for Qwen2.5-VL, Qwen3-VL (dense and MoE) and Qwen3.5 only, but "
            f"--hf-checkpoint {args.hf_checkpoint} is none of them (other vision-language families are not built "
            "yet); rollouts with images run with --debug-rollout-only."
        )


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
        if args.tree_attention_backend is not None:
            error("--tree-attention-backend has no effect without --tree-training.")
        return
    if args.tree_attention_backend is None:
        args.tree_attention_backend = default_tree_attention_backend()
    refusals = [
        (args.context_parallel_size > 1, "context parallelism (--context-parallel-size > 1)"),
        # untested: CPU has no sequence-parallel norms, and at TP 1 the flag is dropped anyway
        (
            args.sequence_parallel and args.tensor_model_parallel_size > 1,
            "sequence parallelism (--sequence-parallel)",
        ),
        (  # the vision-language providers (Qwen2.5-VL, Qwen3-VL) build the local spec's attention around a tower
            bool(args.spec) and tuple(args.spec) not in VLM_SPECS.values(),
            "a custom or hybrid layer spec (--spec, e.g. Qwen3-Next/Qwen3.5 linear attention)",
        ),
        (bool(args.custom_model_provider_path), "a custom model provider (--custom-model-provider-path)"),
        (bool(args.mtp_num_layers), "MTP (--mtp-num-layers)"),
        (  # a vision-language model computes its 3-D positions per sample of the tree itself
            args.position_embedding_type not in ("rope", "none", "learned_absolute")
            and not (args.position_embedding_type == "mrope" and getattr(args, "multimodal_keys", None)),
            f"--position-embedding-type {args.position_embedding_type}",
        ),
    ]
    for refused, what in refusals:
        if refused:
            error(f"--tree-training does not support {what} yet.")
    if args.tree_attention_backend == "flex" and args.attention_dropout > 0:
        error(
            f"--tree-attention-backend flex has no attention dropout, but --attention-dropout is "
            f"{args.attention_dropout}: set --attention-dropout 0.0 (as RL scripts do) or --tree-attention-backend dense."
        )
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
    for name in ("no_save_optim", "no_save_rng", "no_load_optim", "no_load_rng"):
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
