"""The RL algorithm: advantage estimators and losses, KL and the reference model, routing replay, on-policy
distillation, LoRA, MTP training and the linear-attention kernels."""

import logging
import os

from slime.backends.sglang_utils.external import check_opd_teacher, tokenizer_vocab
from slime.backends.sglang_utils.sglang_config import (
    OPD_TEACHER,
    frozen_models,
)
from slime.config.base import Group, reset_arg
from slime.config.checkpoint import checkpoint_exists
from slime.utils.device import default_gdn_backend

logger = logging.getLogger(__name__)


def add_algo_arguments(parser):
    g = Group(parser, "algorithm")
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
    g = Group(parser, "loss variants")
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
    g = Group(parser, "reference model updates")
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


def add_routing_replay_arguments(parser):
    """MoE routing replay (docs/consistency.md): the trainer routes every token to fixed experts."""
    g = Group(parser, "MoE routing replay")
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


def add_mtp_training_arguments(parser):
    g = Group(parser, "multi-token prediction")
    reset_arg(parser, "--mtp-num-layers", type=int, default=None)
    reset_arg(parser, "--mtp-loss-scaling-factor", type=float, default=0.2)  # current slime's default
    g.add_argument(
        "--enable-mtp-training",
        action="store_true",
        default=False,
        help="Train the MTP layers with the RL loss (needs --mtp-num-layers); without it they stay frozen.",
    )
    return parser


def add_linear_attention_arguments(parser):
    g = Group(parser, "linear attention")
    g.add_argument(
        "--qwen-gdn-backend",
        choices=["fla", "torch"],
        default=None,
        help="Gated DeltaNet kernels of Qwen3-Next / Qwen3.5: fla (flash-linear-attention, GPU) or torch (plain "
        "torch, any device). Default: fla on GPU, torch on CPU.",
    )
    return parser


def add_opd_arguments(parser):
    g = Group(parser, "on-policy distillation (docs/opd.md)")
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
        if check_paths and not checkpoint_exists(args.opd_teacher_load):
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
    g = Group(parser, "lora")
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


def check_algorithm(args, error):
    """One KL at a time, whitened REINFORCE++, the clip defaults and the dual-clip bound, TIS hooks."""
    if args.deterministic_mode:  # a run repeats only if its rollouts do: batch-invariant inference comes with it
        args.sglang_enable_deterministic_inference = True
    if args.kl_coef != 0 and args.kl_loss_coef != 0:
        error("--kl-coef (KL in the reward) and --kl-loss-coef (KL loss) cannot both be non-zero; pick one.")
    if (
        args.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
        and not args.normalize_advantages
    ):
        error(f"--advantage-estimator {args.advantage_estimator} requires --normalize-advantages.")
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.eps_clip_c is not None and args.eps_clip_c <= 1.0:
        error(f"--eps-clip-c {args.eps_clip_c}: the dual-clip lower bound must be > 1.")
    if args.custom_tis_function_path and not (args.use_tis or args.get_mismatch_metrics):
        error(
            f"--custom-tis-function-path {args.custom_tis_function_path} is called only with --use-tis or "
            "--get-mismatch-metrics; add one."
        )


def resolve_gdn_backend(args, error):
    if args.qwen_gdn_backend is None:
        args.qwen_gdn_backend = default_gdn_backend()
