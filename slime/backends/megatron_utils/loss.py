"""Losses of the Megatron trainer: PPO/GSPO/CISPO policy loss (dual clip, TIS / IcePop, OPSM, KL loss, entropy
bonus, mismatch metrics), the critic's value loss, SFT loss, custom losses by path, and `loss_function` with slime's
gradient scaling for Megatron's schedule. The log-probs they score live in `log_probs`, the advantages they read are
computed in `advantages`.
"""

import functools

import torch
import torch.utils.checkpoint
from megatron.core import parallel_state as mpu

# get_responses, compute_advantages_and_returns and apply_opd_kl_to_advantages are re-exported: they were defined
# here (as in upstream slime's loss.py), and user code and plugins import them from this path
from slime.backends.megatron_utils.advantages import (
    ROLLOUT_LOGPROBS_NEEDED,
    apply_opd_kl_to_advantages,  # noqa: F401  (re-exported)
    compute_advantages_and_returns,  # noqa: F401  (re-exported)
    require_key,
)
from slime.backends.megatron_utils.cp_utils import cp_size_and_rank
from slime.backends.megatron_utils.log_probs import (
    get_log_probs_and_entropy,
    get_responses,  # noqa: F401  (re-exported)
    get_rollout_temperature_kwargs,
    get_rollout_top_p_logprob_kwargs,
    get_values,
)
from slime.utils.ppo_utils import (
    compute_approx_kl,
    compute_cispo_loss,
    compute_opsm_mask,
    compute_policy_loss,
    compute_value_loss,
    get_sum_of_sample_mean,
)
from slime.utils.user_errors import call_user_function, user_function


def vanilla_tis_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """Default `--custom-tis-function-path`: weight = exp(old - rollout) clamped to [--tis-clip-low, --tis-clip]."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = torch.clamp(ratio, min=args.tis_clip_low, max=args.tis_clip)
    metrics = {
        "tis": ratio.detach(),
        "tis_clipfrac": (weights != ratio).float(),
        "tis_abs": (ratio - 1).abs().detach(),
    }
    return pg_loss * weights, loss_masks, metrics


def icepop_function(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs):
    """IcePop: weight = exp(old - rollout) inside [--tis-clip-low, --tis-clip], and 0 (token masked out) outside."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = torch.where((ratio >= args.tis_clip_low) & (ratio <= args.tis_clip), ratio, torch.zeros_like(ratio))
    metrics = {
        "tis": ratio.detach(),
        "tis_clipfrac": (weights != ratio).float(),
        "tis_abs": (ratio - 1).abs().detach(),
    }
    return pg_loss * weights, loss_masks, metrics


def mismatch_metrics(train_log_probs, rollout_log_probs, loss_masks):
    """Per-token values (each reduced by the caller's sum-of-sample-mean) comparing the trainer's log-probs with the
    engine's on the same sampled tokens; r = train - rollout log-prob, rho = exp(r):
    `mismatch_kl` E[-r] (KL(rollout || train)), `mismatch_k3_kl` E[rho - 1 - r] (its non-negative estimator),
    `mismatch_is_weight` E[rho], `mismatch_chi2_token` E[rho^2] - 1 per sample, `mismatch_log_ppl_abs_diff`
    |mean rollout log-prob - mean train log-prob| per sample (shared by the sample's tokens)."""
    out = {k: [] for k in ("kl", "k3_kl", "is_weight", "chi2_token", "log_ppl_abs_diff")}
    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        r = (train - rollout).float()
        rho = torch.exp(r.clamp(-20.0, 20.0))  # exp overflow guard
        m = mask.to(r.dtype)
        n = torch.clamp_min(m.sum(), 1)
        out["kl"].append(-r)
        out["k3_kl"].append(rho - 1 - r)
        out["is_weight"].append(rho)
        out["chi2_token"].append(((rho.square() * m).sum() / n - 1).expand_as(r))
        out["log_ppl_abs_diff"].append(((r * m).sum() / n).abs().expand_as(r))
    return {f"mismatch_{k}": torch.cat(v).detach() if v else torch.zeros(0) for k, v in out.items()}


def _mismatch_metrics(args, batch, train_log_probs, pg_loss, sum_of_sample_mean, response_lengths):
    """--get-mismatch-metrics: the built-in `mismatch_*` values and, with --custom-tis-function-path, that function's
    metrics; its weights and masks are dropped, so the loss is unchanged."""
    rollout_lp = require_key(
        batch, "rollout_log_probs", "--get-mismatch-metrics needs (the rollout must return log-probs)"
    )
    values = mismatch_metrics(train_log_probs, rollout_lp, batch["loss_masks"])
    if args.custom_tis_function_path and not args.use_tis:
        _, _, user_metrics = user_function("--custom-tis-function-path", args.custom_tis_function_path)(
            args=args,
            pg_loss=pg_loss.detach(),
            train_log_probs=train_log_probs,
            rollout_log_probs=rollout_lp,
            loss_masks=batch["loss_masks"],
            total_lengths=batch["total_lengths"],
            response_lengths=response_lengths,
        )
        values.update(user_metrics)
    return {k: sum_of_sample_mean(v.to(pg_loss.device)) for k, v in values.items()}


def policy_loss_function(args, batch, logits, sum_of_sample_mean):
    """PPO clipped loss (GSPO sequence-level ratio with `--advantage-estimator gspo`), optional dual clip
    (`--eps-clip-c`), TIS (`--use-tis`), entropy bonus and KL loss. Returns `(loss, metrics)`."""
    advantages = torch.cat(require_key(batch, "advantages", "the policy loss needs (compute_advantages_and_returns)"))
    if args.use_rollout_logprobs:
        old_log_probs = require_key(batch, "rollout_log_probs", ROLLOUT_LOGPROBS_NEEDED)
    else:  # None: the trainer skipped its old-log-prob forward (actor.reuses_training_log_probs), see below
        old_log_probs = batch.get("log_probs")
    response_lengths = batch["response_lengths"]
    out = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=response_lengths,
        with_entropy=True,
        **get_rollout_top_p_logprob_kwargs(args, batch),
        **get_rollout_temperature_kwargs(batch),
    )
    log_probs_list = out["log_probs"]
    log_probs = torch.cat(log_probs_list) if log_probs_list else logits.new_zeros(0)
    # the trainer's log-probs of the rollout's weights: the old-log-prob forward's, else this forward's (the same
    # weights on a rollout's first optimizer step)
    train_log_probs = batch.get("log_probs") or [lp.detach() for lp in log_probs_list]
    if old_log_probs is None:
        old_log_probs = train_log_probs

    if args.advantage_estimator == "gspo":
        # sequence-level ratio: masked mean of the token log-ratio, shared by every token of the sample
        seq_kl = [
            ((old - new) * m).sum() / torch.clamp_min(m.sum(), 1)
            for new, old, m in zip(log_probs_list, old_log_probs, batch["loss_masks"])
        ]
        ppo_kl = torch.cat([k.expand_as(new) for k, new in zip(seq_kl, log_probs_list)]) if seq_kl else log_probs
    else:
        ppo_kl = (torch.cat(old_log_probs) if old_log_probs else log_probs.detach()) - log_probs

    if args.advantage_estimator == "cispo":
        pg_loss, pg_clipfrac = compute_cispo_loss(ppo_kl, log_probs, advantages, args.eps_clip, args.eps_clip_high)
    else:
        pg_loss, pg_clipfrac = compute_policy_loss(
            ppo_kl, advantages, args.eps_clip, args.eps_clip_high, args.eps_clip_c
        )
    pg_loss_before_tis = pg_loss

    metrics = {}
    if args.use_opsm:
        old = old_log_probs or [lp.detach() for lp in log_probs_list]
        advantages_list = torch.split(advantages, [lp.numel() for lp in log_probs_list])
        opsm_mask = compute_opsm_mask(log_probs_list, old, advantages_list, batch["loss_masks"], args.opsm_delta)
        pg_loss = pg_loss * opsm_mask.to(pg_loss.device)
        metrics["opsm_clipfrac"] = sum_of_sample_mean(1 - opsm_mask.to(pg_loss.device))
    rollout_log_probs = batch.get("rollout_log_probs")
    pg_loss_masks = batch["loss_masks"]
    reduce = sum_of_sample_mean  # the loss terms' reducer: without the tokens a TIS function rejects, if any
    if args.use_tis:
        rollout_lp = require_key(batch, "rollout_log_probs", "--use-tis needs (the rollout must return log-probs)")
        if args.custom_tis_function_path:
            tis_fn = user_function("--custom-tis-function-path", args.custom_tis_function_path)
        else:  # --tis-mode mask: tokens sampled too far from the trainer's policy get no gradient (IcePop)
            tis_fn = icepop_function if args.tis_mode == "mask" else vanilla_tis_function
        pg_loss, pg_loss_masks, tis_metrics = tis_fn(
            args=args,
            pg_loss=pg_loss,
            train_log_probs=train_log_probs,
            rollout_log_probs=rollout_lp,
            loss_masks=[m.clone() for m in batch["loss_masks"]],  # a function may reject tokens in place
            total_lengths=batch["total_lengths"],
            response_lengths=response_lengths,
        )
        if any(not torch.equal(a, b) for a, b in zip(pg_loss_masks, batch["loss_masks"])):
            # rejected tokens leave every loss term's numerator (policy, entropy, KL, as current slime does); each
            # sample's denominator stays its original mask sum
            kept = torch.cat(pg_loss_masks).to(pg_loss.device, pg_loss.dtype)
            pg_loss = pg_loss * kept

            def reduce(x):
                return sum_of_sample_mean(x * kept)

        metrics.update({k: sum_of_sample_mean(v) for k, v in tis_metrics.items()})
        metrics["ois"] = sum_of_sample_mean(torch.exp(-ppo_kl.detach()))

    pg_loss_reducer = sum_of_sample_mean
    if args.custom_pg_loss_reducer_function_path:
        flag, path = "--custom-pg-loss-reducer-function-path", args.custom_pg_loss_reducer_function_path
        reducer = user_function(flag, path)(
            batch["total_lengths"], response_lengths, pg_loss_masks, args.calculate_per_token_loss
        )
        pg_loss_reducer = functools.partial(
            call_user_function, f"raised by the reducer {flag} {path} returned", reducer
        )
    pg_loss = pg_loss_reducer(pg_loss)
    entropy_loss = reduce(torch.cat(out["entropy"]) if out["entropy"] else log_probs)
    loss = pg_loss - args.entropy_coef * entropy_loss

    if args.use_kl_loss:
        ref_log_probs = torch.cat(require_key(batch, "ref_log_probs", "--use-kl-loss needs (load a reference model)"))
        importance_ratio = None
        if args.use_unbiased_kl:
            old = torch.cat(old_log_probs) if old_log_probs else log_probs.detach()
            importance_ratio = torch.exp(log_probs - old)
        kl_loss = reduce(
            compute_approx_kl(log_probs, ref_log_probs, args.kl_loss_type, importance_ratio=importance_ratio)
        )
        loss = loss + args.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss

    if log_probs.numel() == 0:
        loss = loss + 0 * logits.sum()  # keep the graph connected so backward still runs

    if rollout_log_probs is not None and train_log_probs:
        # trainer vs inference engine on the same weights (precision / kernel mismatch): the pre-update log-probs,
        # so later optimizer steps of this rollout do not count as mismatch (without them model.train drops it)
        metrics["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(
            (torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).abs()
        )
    if batch.get("opd_reverse_kl"):  # OPD: the student's reverse KL to the teacher, per step as current slime logs it
        metrics["opd_reverse_kl"] = sum_of_sample_mean(torch.cat(batch["opd_reverse_kl"]).to(pg_loss.device))
    if args.get_mismatch_metrics:
        metrics.update(
            _mismatch_metrics(args, batch, train_log_probs, pg_loss_before_tis, sum_of_sample_mean, response_lengths)
        )

    reported = {
        "loss": loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": reduce(pg_clipfrac),
        "ppo_kl": reduce(ppo_kl),
        **metrics,
    }
    return loss, {k: v.detach().clone() for k, v in reported.items()}


def value_loss_function(args, batch, logits, sum_of_sample_mean):
    """The critic's clipped value loss (`--value-clip`) against the GAE returns. Returns `(loss, metrics)`."""
    old_values = torch.cat(require_key(batch, "values", "are the critic's old values of the clipped value loss"))
    returns = torch.cat(require_key(batch, "returns", "the value loss needs (compute_advantages_and_returns)"))
    out = get_values(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
    )
    values = torch.cat(out["values"]) if out["values"] else logits.new_zeros(0)
    losses, clipfrac = compute_value_loss(values, old_values, returns, args.value_clip)
    loss = sum_of_sample_mean(losses)
    if values.numel() == 0:
        loss = loss + 0 * logits.sum()
    reported = {"value_loss": loss, "value_clipfrac": sum_of_sample_mean(clipfrac)}
    return loss, {k: v.detach().clone() for k, v in reported.items()}


def sft_loss_function(args, batch, logits, sum_of_sample_mean):
    """Negative log-likelihood of the loss-masked response tokens, averaged per sample."""
    out = get_log_probs_and_entropy(
        logits,
        args=args,
        unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"],
        with_entropy=False,
    )
    log_probs = torch.cat(out["log_probs"]) if out["log_probs"] else logits.new_zeros(0)
    loss = -sum_of_sample_mean(log_probs)
    if log_probs.numel() == 0:
        loss = loss + 0 * logits.sum()
    return loss, {"loss": loss.detach().clone()}


def loss_function(args, batch, num_microbatches, logits):
    """Megatron loss hook: `(scaled_loss, num_tokens or 1, {"keys": [...], "values": tensor([count, *metrics])})`.

    Per-sample loss: scaling by `num_microbatches / global_batch_size * dp_size` undoes Megatron's division by the
    number of micro-batches and DP gradient averaging, so a step's gradient is the sum of per-sample means over the
    global batch divided by `--global-batch-size`, however the samples are split into micro-batches. With fan-out
    a rollout's samples are averaged together (over all their loss-masked tokens), so the sum runs over rollouts.
    Per-token loss (`--calculate-per-token-loss`): the loss stays a plain token sum; Megatron sums it over
    micro-batches and DP ranks and divides the gradients by the global token count.
    Context parallelism: each CP rank computes the whole loss from the gathered log-probs and backpropagates it into
    its own sequence chunks only, so the gradients summed over the CP group are exactly the CP=1 gradients.
    """
    loss_masks = batch["loss_masks"]
    num_tokens = sum(torch.clamp_min(m.sum(), 1) for m in loss_masks)
    # fan-out: a rollout's samples share one denominator and together count as one sample in the logged means
    weights = batch.get("rollout_weights")
    num_samples = sum(weights) if weights is not None else len(batch["response_lengths"])
    sum_of_sample_mean = get_sum_of_sample_mean(
        batch["total_lengths"],
        batch["response_lengths"],
        loss_masks,
        batch.get("rollout_mask_sums"),
        calculate_per_token_loss=args.calculate_per_token_loss,
    )
    kwargs = {"args": args, "batch": batch, "logits": logits, "sum_of_sample_mean": sum_of_sample_mean}
    if args.loss_type == "policy_loss":
        func = policy_loss_function
    elif args.loss_type == "sft_loss":
        func = sft_loss_function
    elif args.loss_type == "value_loss":  # the critic's (set on its copy of the arguments, slime.ray.critic)
        func = value_loss_function
    else:  # custom_loss: its path was checked (imports, signature) at start-up
        func = user_function("--custom-loss-function-path", args.custom_loss_function_path)
    if args.recompute_loss_function:
        # keep only the logits: the vocabulary-sized intermediates are recomputed in the backward pass
        loss, log = torch.utils.checkpoint.checkpoint(func, use_reentrant=False, **kwargs)
    else:
        loss, log = func(**kwargs)

    if not args.calculate_per_token_loss:
        loss = (
            loss
            * num_microbatches
            / args.global_batch_size
            * mpu.get_data_parallel_world_size(with_context_parallel=True)
        )
    else:
        # Every CP rank reports the whole micro-batch's token count, which Megatron sums over DP x CP; the gradient,
        # summed over CP ranks, counts it once (see cp_utils), so undo the over-count here.
        loss = loss * cp_size_and_rank()[0]
    count = num_tokens if args.calculate_per_token_loss else num_samples
    values = torch.stack(
        [
            torch.as_tensor(v, dtype=torch.float32, device=logits.device).detach().reshape(())
            for v in [count, *log.values()]
        ]
    )
    return loss, num_tokens if args.calculate_per_token_loss else 1, {"keys": list(log.keys()), "values": values}
