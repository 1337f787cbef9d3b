"""Model, optimizer and LR schedule setup, and the three loops the actor runs: `forward_only` (log-probs),
`train_one_step` and `train` (one rollout's optimizer steps).

The PyPI megatron-core wheel has no `megatron.training`, so `get_model` / optimizer wiring that Megatron-LM's
training loop would do lives here, on megatron.core APIs only.
"""

import contextlib
import logging
import math
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from slime.observability import wandb_utils
from slime.utils.console import metrics_line
from slime.utils.device import current_device
from slime.utils.sampling_record import TEMPERATURES_KEY
from slime.utils.top_p_replay import TOP_P_KEYS
from slime.utils.user_errors import user_function

from . import routing_replay
from .checkpoint import load_checkpoint, resync_optimizer_main_params
from .data import get_batch, unpack_tree_output
from .initialize import is_megatron_main_rank
from .int4_qat import apply_int4_qat
from .log_probs import get_log_probs_and_entropy, get_rollout_temperature_kwargs, get_rollout_top_p_logprob_kwargs
from .lora import apply_lora, check_wrapped, log_lora_summary
from .loss import loss_function
from .megatron_to_hf import hf_to_megatron
from .model_provider import freeze_model_params, get_model_provider_func
from .mtp import freeze_mtp_params, last_mtp_losses, mtp_loss_mask

logger = logging.getLogger(__name__)

TRAIN_KEYS = [
    "tokens",
    "total_lengths",
    "response_lengths",
    "loss_masks",
    "log_probs",
    "ref_log_probs",
    "advantages",
    "returns",
    "rollout_log_probs",
    *TOP_P_KEYS,
    TEMPERATURES_KEY,
    "values",
    "opd_reverse_kl",
    routing_replay.KEY,
    "rollout_mask_sums",
    "rollout_weights",
    "multimodal_train_inputs",
]


def get_model(args, wrap_with_ddp=True, role="actor"):
    """Model chunks for this rank (one per virtual pipeline stage), DDP-wrapped for training; `role="critic"` ends in
    a one-output value head."""
    provider = get_model_provider_func(args, role)
    vpp = args.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = provider(
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage,
        )
        chunks.append(chunk)
    freeze_model_params(chunks, args)
    freeze_mtp_params(chunks, args)
    for chunk in chunks:  # OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1: routed experts compute on the engine's INT4 grid
        apply_int4_qat(chunk)
    if args.enable_lora:
        wrapped = [n for vp_stage, c in enumerate(chunks) for n in apply_lora(args, c, vp_stage if vpp else None)]
        check_wrapped(args, chunks, wrapped)
        log_lora_summary(args, chunks, wrapped)
    for chunk in chunks:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    for chunk in chunks:
        chunk.to(current_device())
    config = get_model_config(chunks[0])
    if config.bf16 or config.fp16:
        chunks = [Float16Module(config, c) for c in chunks]
    if not wrap_with_ddp:
        return chunks
    dp_cp = mpu.get_data_parallel_world_size(with_context_parallel=True)
    overlap = bool(args.overlap_grad_reduce)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=bool(args.accumulate_allreduce_grads_in_fp32),
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=max(40_000_000, 1_000_000 * dp_cp) if overlap else None,
    )
    return [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=i > 0)
        for i, c in enumerate(chunks)
    ]


def get_optimizer_param_scheduler(args, optimizer):
    """LR/WD schedule counted in samples, as slime: one step = `--global-batch-size` samples."""
    gbs = args.global_batch_size
    train_iters = args.num_rollout * args.rollout_batch_size * args.n_samples_per_prompt // gbs
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    warmup_iters = args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        warmup_steps = args.lr_warmup_fraction * decay_iters * gbs
    else:
        warmup_steps = warmup_iters * gbs
    decay_steps = max(decay_iters * gbs, 1)
    style = args.lr_decay_style
    if warmup_steps >= decay_steps:
        if style != "constant":  # a constant LR never decays, so only a decaying schedule needs warmup < decay
            raise ValueError(
                f"--lr-warmup-iters ({warmup_steps // gbs}) must be smaller than the decay length ({decay_iters} "
                f"optimizer steps: --lr-decay-iters, or --num-rollout x --rollout-batch-size x --n-samples-per-prompt "
                f"/ --global-batch-size) with --lr-decay-style {style}"
            )
        decay_steps = warmup_steps + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps,
        lr_decay_steps=decay_steps,
        lr_decay_style=style,
        start_wd=args.weight_decay if args.start_weight_decay is None else args.start_weight_decay,
        end_wd=args.weight_decay if args.end_weight_decay is None else args.end_weight_decay,
        wd_incr_steps=max(train_iters * gbs, 1),
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=bool(args.use_checkpoint_opt_param_scheduler),
        override_opt_param_scheduler=bool(args.override_opt_param_scheduler),
    )


def get_optimizer(args, model):
    config = get_model_config(model[0])
    opt_config = OptimizerConfig(
        optimizer=args.optimizer,
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum,
        clip_grad=args.clip_grad,
        bf16=config.bf16,
        fp16=config.fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=bool(args.use_distributed_optimizer),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,  # fp16's dynamic loss scaler, as Megatron-LM
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
    )
    return get_megatron_optimizer(opt_config, model)


def initialize_model_and_optimizer(args, role="actor"):
    """`(model, optimizer, opt_param_scheduler, iteration)`; weights from `--load`, else from `--hf-checkpoint`.

    `iteration` is the last completed rollout id (-1 when starting fresh), so training starts at `iteration + 1`.
    The critic's value head is loaded where the checkpoint has one of its shape and newly initialised otherwise
    (an HF checkpoint or the actor's Megatron checkpoint has a vocabulary-sized output layer instead).
    """
    critic = role == "critic"
    model = get_model(args, role=role)
    optimizer = get_optimizer(args, model)
    opt_param_scheduler = get_optimizer_param_scheduler(args, optimizer)
    config = get_model_config(model[0])
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    iteration = load_checkpoint(args, model, optimizer, opt_param_scheduler, keep_unfit_output_layer=critic)
    if iteration is None:  # nothing to load: initialise from the HF checkpoint (beyond slime v0.1.0)
        if args.hf_checkpoint:
            hf_to_megatron(args, model, skip_output_layer=critic)
            resync_optimizer_main_params(optimizer)
        iteration = -1
    return model, optimizer, opt_param_scheduler, iteration


@contextlib.contextmanager
def rope_by_position(model, position_ids):
    """While active, every RoPE module of `model` returns its frequencies gathered by `position_ids` ([b, s]) as
    `[s, b, 1, d]` (the shape the mRoPE path feeds the same attention code) instead of those of positions 0..s-1:
    megatron-core's `GPTModel` hands `position_ids` to the embedding only and asks RoPE for a length. Needed by
    `--tree-training`, whose positions continue from the parent node rather than from the previous token.
    YaRN's module (multi-latent attention's) returns its attention scale beside the table: passed on unchanged."""
    patched = [m for m in model.modules() if type(m) in (RotaryEmbedding, YarnRotaryEmbedding)]
    table_len = int(position_ids.max()) + 1
    index = position_ids.t()

    def by_position(original):
        def forward(max_seq_len, offset=0, packed_seq=False, cp_group=None):
            out = original(table_len, offset, packed_seq, cp_group)  # [table_len, 1, 1, d] (, mscale)
            table = out[0] if isinstance(out, tuple) else out
            table = table[:, 0, 0][index.to(table.device)].unsqueeze(2)
            return (table, *out[1:]) if isinstance(out, tuple) else table

        return forward

    for m in patched:
        m.forward = by_position(m.forward)
    try:
        yield
    finally:
        for m in patched:
            del m.forward  # back to the class's method


def _forward(model, batch):
    mtp = {"loss_mask": batch["mtp_loss_mask"]} if "mtp_loss_mask" in batch else {}  # the MTP block runs on it
    tree_index = batch.get("tree_index")
    if tree_index is not None:  # the fused causal softmax kernel would ignore the tree mask
        assert not get_model_config(model).masked_softmax_fusion, "--tree-training needs the unfused masked softmax"
    with rope_by_position(model, batch["position_ids"]) if tree_index is not None else contextlib.nullcontext():
        output = model(
            input_ids=batch["tokens"],
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
            labels=None,
            packed_seq_params=batch["packed_seq_params"],
            **mtp,
            **batch.get("multimodal_train_inputs", {}),  # a vision-language model's pixel_values, image_grid_thw
        )
    # --tree-training: each sample's rows back in the flat padded layout, so the loss code is unchanged; earlier
    # pipeline stages hand the tree row's hidden states on as they are (every stage builds the same layout)
    if tree_index is None or not get_attr_wrapped_model(model, "post_process"):
        return output
    return unpack_tree_output(output, tree_index)


def _iterator_arg(data_iterator):
    return data_iterator if len(data_iterator) > 1 else data_iterator[0]


@torch.no_grad()
def forward_only(args, model, data_iterator, num_microbatches, store_prefix="", post_fn=get_log_probs_and_entropy):
    """`{store_prefix + "log_probs": [...], (+ "entropy")}` per local sample, in the rollout data's order
    (`post_fn=log_probs.get_values`: the critic's `{"values": [...]}`).

    Only the last pipeline stage has logits, so only its ranks get the values; other stages get `{}` (R2's recorded
    routing, `rollout_routed_experts`, excepted: every stage gets it). Nothing there needs them: advantages, rollout
    metrics and the loss are all computed on the last stage only."""
    for m in model:
        m.eval()
    if args.custom_megatron_before_log_prob_hook_path:
        hook = user_function(
            "--custom-megatron-before-log-prob-hook-path", args.custom_megatron_before_log_prob_hook_path
        )
        hook(args, model, store_prefix)
    for it in data_iterator:
        it.reset()
    recorded = []  # R2: each sample's routing in this forward (replayed in training), kept on every stage

    def forward_step(iterator, chunk):
        batch = get_batch(
            iterator,
            [
                "tokens",
                "total_lengths",
                "response_lengths",
                *TOP_P_KEYS,
                TEMPERATURES_KEY,
                routing_replay.KEY,
                "multimodal_train_inputs",
            ],
            pad_multiplier=args.data_pad_size_multiplier,
        )
        routing_replay.before_forward(args, chunk, batch)
        output = _forward(chunk, batch)
        if routing_replay.recording():
            recorded.extend(routing_replay.recorded(args, chunk, batch))

        def post(logits, non_loss_data=True):  # the schedule calls this with non_loss_data=True
            return post_fn(
                logits,
                args=args,
                unconcat_tokens=batch["unconcat_tokens"],
                total_lengths=batch["total_lengths"],
                response_lengths=batch["response_lengths"],
                with_entropy=bool(args.use_rollout_entropy),
                **get_rollout_top_p_logprob_kwargs(args, batch),
                **get_rollout_temperature_kwargs(batch),
            )

        return output, post

    store = []
    for n in num_microbatches:
        store += get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=_iterator_arg(data_iterator),
            model=model,
            num_microbatches=n,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=True,
            collect_non_loss_data=True,
        )
    for it in data_iterator:
        it.reset()
    for m in model:
        m.train()

    def rollout_order(values):
        order = data_iterator[0].micro_batch_indices
        if order is None:
            return values
        # dynamic batching shuffles samples across micro-batches: restore rollout order
        flat = [i for mb in order for i in mb]
        restored = [None] * len(values)
        for pos, idx in enumerate(flat):
            restored[idx] = values[pos]
        return restored

    # R2's routing goes to every stage (each replays its own layers in training)
    out = {routing_replay.KEY: rollout_order(routing_replay.across_stages(recorded))} if recorded else {}
    if not mpu.is_pipeline_last_stage():
        return out
    for key in store[0] if store else ["log_probs"]:
        out[store_prefix + key] = rollout_order([v for d in store for v in d[key]])
    return out


def train_one_step(args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler, num_microbatches):
    """One optimizer step over `num_microbatches` micro-batches. Returns `({metric: mean}, grad_norm)`."""
    for m in model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    if args.custom_megatron_before_train_step_hook_path:
        hook = user_function(
            "--custom-megatron-before-train-step-hook-path",
            args.custom_megatron_before_train_step_hook_path,
            f" at rollout {rollout_id}, step {step_id}",
        )
        hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)

    def forward_step(iterator, chunk):
        batch = get_batch(iterator, TRAIN_KEYS, pad_multiplier=args.data_pad_size_multiplier)
        train_mtp = args.enable_mtp_training and args.loss_type != "value_loss"  # the critic has no LM head
        if train_mtp:
            batch["mtp_loss_mask"] = mtp_loss_mask(batch)
        routing_replay.before_forward(args, chunk, batch)

        def loss_func(logits):
            loss, num_tokens, report = loss_function(args, batch, num_microbatches, logits)
            if train_mtp:  # each depth's and their sum (current slime's keys), means over samples like the loss terms
                depths = last_mtp_losses(chunk).to(report["values"].device)
                report["keys"] += [f"mtp_{i + 1}_loss" for i in range(len(depths))] + ["mtp_loss"]
                mtp = torch.cat([depths, depths.sum().reshape(1)])
                report["values"] = torch.cat([report["values"], report["values"][0] * mtp])
            # the schedule clamps/sums num_tokens as a tensor
            return loss, torch.as_tensor(num_tokens, device=loss.device).reshape(()).int(), report

        return _forward(chunk, batch), loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=_iterator_arg(data_iterator),
        model=model,
        num_microbatches=num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )
    if not args.check_for_nan_in_loss_and_grad and not _grads_are_finite(model):
        # --no-check-for-nan-in-loss-and-grad: nothing raised on the inf/NaN, so skip the step rather than apply it
        logger.warning(f"rollout {rollout_id} step {step_id}: inf/NaN gradients, optimizer step skipped")
        update_successful, grad_norm = False, float("nan")
    else:
        update_successful, grad_norm, _ = optimizer.step()
    if args.use_stateless_adam:
        # Adam keeps no moments: the next step starts from zero moments and step 0, i.e. g / (|g| + eps)
        clear_optimizer_states(optimizer)
    if update_successful:
        opt_param_scheduler.step(increment=args.global_batch_size)
    elif args.check_for_nan_in_loss_and_grad and not get_model_config(model[0]).fp16:  # fp16: the scaler skips
        raise RuntimeError(f"rollout {rollout_id} step {step_id}: optimizer step failed (inf/NaN gradients)")

    metrics = {}
    if mpu.is_pipeline_last_stage(ignore_virtual=True) and losses:
        keys = losses[0]["keys"]
        values = torch.stack([d["values"] for d in losses]).sum(dim=0)
        # CP ranks of one DP rank compute the same loss and metrics (log-probs are gathered over CP): reduce over DP
        dist.all_reduce(values, group=mpu.get_data_parallel_group(with_context_parallel=False))
        count = values[0].clamp_min(1)
        metrics = {k: (v / count).item() for k, v in zip(keys, values[1:])}
    return metrics, grad_norm


def _inner_optimizers(optimizer):
    """The torch optimizers under Megatron's wrappers (a ChainedOptimizer holds one per parameter group kind)."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def reset_optimizer_states(optimizer):
    """--reset-optimizer-states: Adam's moments and step counters back to zero (kept allocated)."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = 0
        for state in inner.state.values():
            for key in ("step", "exp_avg", "exp_avg_sq"):
                if key not in state:
                    continue
                if isinstance(state[key], torch.Tensor):
                    state[key].zero_()
                else:
                    state[key] = 0


def clear_optimizer_states(optimizer):
    """--use-stateless-adam: drop the moments (torch's Adam re-creates zero ones, at step 0, on its next step)."""
    for inner in _inner_optimizers(optimizer):
        inner.state.clear()
        for group in inner.param_groups:
            if "step" in group:
                group["step"] = 0


def _grads_are_finite(model):
    """True when no trainer rank has an inf/NaN in its gradient buffers."""
    grads = [p.main_grad for chunk in model for p in chunk.parameters() if getattr(p, "main_grad", None) is not None]
    bad = any(not torch.isfinite(g).all() for g in grads)
    flag = torch.tensor([float(bad)], device=grads[0].device if grads else current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def train(args, rollout_id, model, optimizer, opt_param_scheduler, data_iterator, num_microbatches, role="actor"):
    """Run this rollout's `len(num_microbatches)` optimizer steps; returns the per-step metric dicts (main rank).
    The critic's metrics are named `train/critic-*` (current slime's names), beside the actor's `train/*`."""
    prefix = "train/" if role == "actor" else f"train/{role}-"
    for m in model:
        m.train()
    for it in data_iterator:
        it.reset()
    steps = len(num_microbatches)
    history = []
    if args.reset_optimizer_states:  # each rollout's optimizer steps start from fresh Adam moments
        reset_optimizer_states(optimizer)
    for step_id, n in enumerate(num_microbatches):
        loss_dict, grad_norm = train_one_step(
            args, rollout_id, step_id, data_iterator, model, optimizer, opt_param_scheduler, n
        )
        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            continue
        if step_id > 0 and data_iterator[0].rollout_data.get("log_probs") is None:
            # no old-log-prob forward (--use-rollout-logprobs): this step scores with weights the earlier steps moved,
            # so its gap to the engine's log-probs is the update's drift, not a train/inference mismatch
            loss_dict.pop("train_rollout_logprob_abs_diff", None)
        if args.ci_test and rollout_id == 0 and step_id == 0 and not args.ci_disable_kl_checker:
            _ci_first_step_checks(loss_dict)
        metrics = {f"{prefix}{k}": v for k, v in loss_dict.items()}
        metrics[f"{prefix}grad_norm"] = float(grad_norm) if grad_norm is not None else 0.0
        if is_megatron_main_rank() and role == "actor":
            ci_step_checks(args, rollout_id, step_id, metrics)
        for i, group in enumerate(optimizer.param_groups):
            metrics[f"{prefix}lr-pg_{i}"] = group["lr"]
        metrics[f"{prefix}lr"] = optimizer.param_groups[0]["lr"]
        metrics[f"{prefix}global_batch_size"] = args.global_batch_size  # the samples of each step
        metrics["train/step"] = rollout_id * steps + step_id
        history.append(metrics)
        if is_megatron_main_rank():
            log(args, metrics, "train/step")
    return history


def ci_step_checks(args, rollout_id, step_id, metrics, role="actor"):
    """Current slime's CI gates of one optimizer step: the train/rollout log-prob gap under
    --ci-train-rollout-logprob-abs-diff-threshold (with --ci-test), and the grad norm saved to --ci-save-grad-norm or
    reproduced from --ci-load-grad-norm (path templates with {role}, {rollout_id}, {step_id})."""
    diff = metrics.get("train/train_rollout_logprob_abs_diff")
    if args.ci_test and diff is not None:
        threshold = args.ci_train_rollout_logprob_abs_diff_threshold
        assert diff <= threshold, (
            f"--ci-test: rollout {rollout_id} step {step_id} train_rollout_logprob_abs_diff {diff} > "
            f"--ci-train-rollout-logprob-abs-diff-threshold {threshold}"
        )
    grad_norm = metrics["train/grad_norm"]
    if args.ci_save_grad_norm is not None:
        path = args.ci_save_grad_norm.format(role=role, rollout_id=rollout_id, step_id=step_id)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        torch.save(grad_norm, path)
    elif args.ci_load_grad_norm is not None:
        path = args.ci_load_grad_norm.format(role=role, rollout_id=rollout_id, step_id=step_id)
        expected = torch.load(path)
        assert math.isclose(grad_norm, expected, rel_tol=0.01, abs_tol=0.01), (
            f"--ci-load-grad-norm {path}: rollout {rollout_id} step {step_id} grad norm {grad_norm} != saved {expected}"
        )


def _ci_first_step_checks(loss_dict):
    # At the first step the policy is exactly the rollout policy: no ratio, no clipping, and ref == actor.
    for key in ("ppo_kl", "pg_clipfrac", "kl_loss"):
        if key in loss_dict:
            assert abs(loss_dict[key]) < 1e-8, f"--ci-test: first-step {key} = {loss_dict[key]} (expected 0)"


def log(args, metrics, step_key):
    """Main-rank metrics sink: one compact line, plus wandb when --use-wandb."""
    shown = {k: v for k, v in metrics.items() if k != step_key}
    print(metrics_line(f"{step_key} {metrics.get(step_key)}", shown), flush=True)
    wandb_utils.log(args, metrics, step_key)
