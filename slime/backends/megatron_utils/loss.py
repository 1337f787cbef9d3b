"""Losses of the Megatron trainer: per-sample log-probs/entropy from the model's logits, advantage
estimators over a rank's rollout data, PPO/GSPO policy loss (dual clip, TIS, KL loss, entropy bonus), SFT loss,
custom losses by path, and `loss_function` with slime's gradient scaling for Megatron's schedule.
"""

import functools

import torch
import torch.utils.checkpoint
from megatron.core import parallel_state as mpu

from slime.backends.megatron_utils.cp_utils import (
    cp_size_and_rank,
    gather_response_across_cp,
    response_pieces,
    zigzag_chunk_size,
)
from slime.utils.ppo_utils import (
    compute_approx_kl,
    compute_cispo_loss,
    compute_entropy_from_logits,
    compute_log_probs,
    compute_opsm_mask,
    compute_policy_loss,
    compute_value_loss,
    distributed_masked_whiten,
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_ppo_token_rewards,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    get_rloo_returns,
)
from slime.utils.top_p_replay import sampling_is_truncated
from slime.utils.user_errors import call_user_function, user_function


def get_responses(logits, *, unconcat_tokens, total_lengths, response_lengths):
    """Yield `(logits [n, V/tp], tokens [n], pieces)` per sample: this rank's logit positions that score the sample's
    response tokens, the tokens they score, and where they sit in the response (`cp_utils.response_pieces`:
    `[(local_start, response_start, n)]`; one piece covering the whole response when there is no CP).

    `logits` is `[1, T, V/tp]` (samples packed back to back) or `[b, s, V/tp]` (sample i right-padded in row i).
    A sample's response is the last R tokens of its unpadded sequence, predicted by the logits one position earlier.
    Under CP a rank holds each sample's zigzag pair of chunks (`cp_utils`), so it scores up to two pieces of it.
    """
    packed = logits.size(0) == 1
    assert packed or logits.size(0) == len(unconcat_tokens), (
        f"logits batch {logits.size(0)} matches neither a packed row nor {len(unconcat_tokens)} padded rows"
    )
    cp_size, cp_rank = cp_size_and_rank()
    start = 0  # the sample's first local position in the packed row
    for i, (tokens, total_len, resp_len) in enumerate(zip(unconcat_tokens, total_lengths, response_lengths)):
        if resp_len > 0 and resp_len >= total_len:
            raise ValueError(
                f"sample {i}: response length {resp_len} leaves no prompt token before the response "
                f"(total length {total_len}); every sample needs at least one prompt token"
            )
        row = logits[0] if packed else logits[i]
        if cp_size == 1:
            chunk, local_len = total_len, total_len
            pieces = [(total_len - resp_len - 1, 0, resp_len)]
        else:
            chunk = zigzag_chunk_size(total_len, cp_size) if packed else logits.size(1) // 2
            local_len = 2 * chunk
            pieces = response_pieces(total_len, resp_len, chunk, cp_size, cp_rank)
        first = total_len - resp_len  # the response's first token; logit p scores token p + 1
        logits_parts = [row[start + lo : start + lo + n] for lo, _, n in pieces] or [row[:0]]
        token_parts = [tokens[first + r0 : first + r0 + n] for _, r0, n in pieces] or [tokens[:0]]
        yield torch.cat(logits_parts), torch.cat(token_parts), pieces
        if packed:
            start += local_len


_MASKED_LOGIT = -1e30  # finite: p = 0 without the 0 * inf = nan of -inf in the entropy and its gradient


def _mask_padded_vocab(logits, vocab_size):
    """Hide the rows Megatron adds to make the vocab divisible by 128*TP: the inference engine's softmax runs over
    the real vocab only, so the trainer's must too (and the padded rows then get no gradient)."""
    part = logits.size(-1)
    start = mpu.get_tensor_model_parallel_rank() * part
    if not vocab_size or start + part <= vocab_size:
        return logits
    column = torch.arange(start, start + part, device=logits.device)
    return logits.masked_fill(column >= vocab_size, _MASKED_LOGIT)


def get_rollout_top_p_logprob_kwargs(args, batch):
    """`get_log_probs_and_entropy`'s top-p replay arguments for a micro-batch: `{}` unless training rollouts sample
    from a truncated distribution (`--rollout-top-p` < 1 or `--rollout-top-k` > 0), then the per-sample kept sets,
    which the batch must carry."""
    if not sampling_is_truncated(args):
        return {}
    ids, offsets = batch.get("rollout_top_p_token_ids"), batch.get("rollout_top_p_token_offsets")
    if ids is None or offsets is None:
        raise ValueError(
            f"--rollout-top-p {args.rollout_top_p} / --rollout-top-k {args.rollout_top_k}: the training batch has no "
            "rollout_top_p_token_ids / rollout_top_p_token_offsets to score the tokens over the sets the engine kept"
        )
    return {"top_p_token_ids": ids, "top_p_token_offsets": offsets}


def _restrict_to_kept_sets(logits, pieces, kept_ids, offsets):
    """`logits` [n, V/tp] of one sample's response rows with every token outside that step's kept set masked out,
    so the (vocab-parallel) softmax renormalises over exactly the engine's sampling support. `pieces` map the rows
    to response positions (`get_responses`); a step with an empty set keeps the whole vocabulary."""
    part = logits.size(-1)
    vocab_start = mpu.get_tensor_model_parallel_rank() * part
    device = logits.device
    positions = [torch.arange(r0, r0 + n, device=device) for _, r0, n in pieces]
    positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long, device=device)
    offsets = offsets.to(device=device, dtype=torch.long)
    kept_ids = kept_ids.to(device=device, dtype=torch.long)
    starts, lengths = offsets[positions], offsets[positions + 1] - offsets[positions]
    rows = torch.repeat_interleave(torch.arange(positions.numel(), device=device), lengths)
    within = torch.arange(rows.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    local = kept_ids[torch.repeat_interleave(starts, lengths) + within] - vocab_start
    here = (local >= 0) & (local < part)
    keep = torch.zeros(positions.numel(), part, dtype=torch.bool, device=device)
    keep[rows[here], local[here]] = True
    keep[lengths == 0] = True
    return logits.masked_fill(~keep, _MASKED_LOGIT)


def _log_probs_in_chunks(logits, tokens, tp_group, with_entropy, chunk_size):
    """`[log_probs (, entropy)]` of one sample's rows, `--log-probs-chunk-size` rows at a time when it is > 0, so
    that the forward's fp32 softmax temporaries are chunk x V/tp instead of rows x V/tp."""
    if chunk_size > 0 and logits.size(0) > chunk_size:
        parts = [
            _log_probs_in_chunks(lg, tk, tp_group, with_entropy, -1)
            for lg, tk in zip(logits.split(chunk_size), tokens.split(chunk_size))
        ]
        return [torch.cat(col) for col in zip(*parts)]
    values = [compute_log_probs(logits, tokens, tp_group)]
    if with_entropy:
        values.append(compute_entropy_from_logits(logits, tp_group))
    return values


def get_log_probs_and_entropy(
    logits,
    *,
    args,
    unconcat_tokens,
    total_lengths,
    response_lengths,
    with_entropy=False,
    top_p_token_ids=None,
    top_p_token_offsets=None,
):
    """`{"log_probs": [per-sample 1-D], "entropy": [...] (with_entropy)}` of the response tokens.

    Logits are divided by `--rollout-temperature` first so the trainer's log-probs match the rollout engine's
    temperature-scaled ones. With `top_p_token_ids` / `top_p_token_offsets` (per sample, see
    `get_rollout_top_p_logprob_kwargs`) each token is scored over the set the engine kept at its step (top-p replay).
    """
    logits = logits.float()
    if args.rollout_temperature != 1.0:
        logits = logits / args.rollout_temperature
    logits = _mask_padded_vocab(logits, args.vocab_size)
    tp_group = mpu.get_tensor_model_parallel_group()
    gather = mpu.get_context_parallel_world_size() > 1
    log_probs, entropy = [], []
    for i, ((logits_chunk, tokens_chunk, pieces), resp_len) in enumerate(
        zip(
            get_responses(
                logits, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths, response_lengths=response_lengths
            ),
            response_lengths,
        )
    ):
        if top_p_token_offsets is not None:
            logits_chunk = _restrict_to_kept_sets(logits_chunk, pieces, top_p_token_ids[i], top_p_token_offsets[i])
        values = _log_probs_in_chunks(logits_chunk, tokens_chunk, tp_group, with_entropy, args.log_probs_chunk_size)
        if gather:  # every CP rank gets the whole response, so the loss below is the same as without CP
            values = [gather_response_across_cp(pieces, v, resp_len) for v in values]
        log_probs.append(values[0])
        if with_entropy:
            entropy.append(values[1])
    out = {"log_probs": log_probs}
    if with_entropy:
        out["entropy"] = entropy
    return out


def get_values(logits, *, args, unconcat_tokens, total_lengths, response_lengths, **kwargs):
    """`{"values": [per-sample 1-D]}`: the critic's value head output (`[..., 1]`) at the positions that score each
    response token, i.e. the value of the state before the token (no temperature: these are not logits)."""
    gather = mpu.get_context_parallel_world_size() > 1
    values = []
    for (chunk, _, pieces), resp_len in zip(
        get_responses(
            logits, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths, response_lengths=response_lengths
        ),
        response_lengths,
    ):
        assert chunk.size(-1) == 1, f"the critic's output has {chunk.size(-1)} columns, expected 1 (the value head)"
        v = chunk.squeeze(-1).float()
        values.append(gather_response_across_cp(pieces, v, resp_len) if gather else v)
    return {"values": values}


def apply_opd_kl_to_advantages(args, rollout_data, advantages, student_log_probs):
    """On-policy distillation: each response token's advantage A becomes A - `--opd-kl-coef` * (student log-prob -
    teacher log-prob), the student's being the old log-probs the estimator uses (the trainer's, or the engine's
    with --use-rollout-logprobs). Keeps the per-token reverse KL in `rollout_data["opd_reverse_kl"]` (logged);
    returns the new advantages."""
    if student_log_probs is None:
        raise ValueError("--use-opd needs the student's old log-probs, but rollout data has no log_probs")
    teacher = rollout_data.get("teacher_log_probs")
    if teacher is None:
        where = (
            "the teacher forward of --opd-teacher-load"
            if args.opd_type == "megatron"
            else "--custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards"
        )
        raise ValueError(f"--use-opd --opd-type {args.opd_type}: rollout data has no teacher_log_probs (from {where})")
    reverse_kl, out = [], []
    for i, (adv, student, t) in enumerate(zip(advantages, student_log_probs, teacher)):
        if t.shape != student.shape:
            raise ValueError(
                f"--use-opd: sample {i} has {t.numel()} teacher log-probs for {student.numel()} response tokens"
            )
        kl = student - t.to(student.device)
        reverse_kl.append(kl)
        out.append(adv - args.opd_kl_coef * kl)
    rollout_data["opd_reverse_kl"] = reverse_kl
    return out


def compute_advantages_and_returns(args, rollout_data):
    """Fill `rollout_data["advantages"]` and `["returns"]` (per-sample token tensors) for `--advantage-estimator`.
    No-op on pipeline stages other than the last (only the last computes the loss). The old log-probs (the KL base
    of `--kl-coef`) are the trainer's `log_probs`, the engine's with --use-rollout-logprobs, and absent when the
    training forward's are reused (then `--kl-coef` is 0, see `actor.reuses_training_log_probs`). The critic has no
    log-probs (its `kl_coef` is 0): its GAE reads its own `values`."""
    if not mpu.is_pipeline_last_stage():
        return
    if args.use_rollout_logprobs:
        log_probs = _require(rollout_data, "rollout_log_probs", _ROLLOUT_LOGPROBS_NEEDED)
    else:
        log_probs = rollout_data.get("log_probs")
    ref_log_probs = rollout_data.get("ref_log_probs")
    rewards = rollout_data["rewards"]
    loss_masks = rollout_data["loss_masks"]
    device = loss_masks[0].device if loss_masks else torch.device("cpu")

    if args.kl_coef == 0 or not loss_masks:
        kl = [torch.zeros(m.shape, dtype=torch.float32, device=m.device) for m in loss_masks]
    else:
        if log_probs is None:
            raise ValueError("--kl-coef != 0 needs the old log-probs, but rollout data has no log_probs")
        if ref_log_probs is None:
            raise ValueError(
                "--kl-coef != 0 needs reference log-probs (--ref-load), but rollout data has no ref_log_probs"
            )
        kl = [compute_approx_kl(lp, ref, args.kl_loss_type) for lp, ref in zip(log_probs, ref_log_probs)]
    rewards = torch.tensor(rewards, dtype=torch.float32, device=device)
    rollout_data["kl"] = kl

    estimator = args.advantage_estimator
    if args.custom_advantage_function_path:
        # replaces only the estimator: --normalize-advantages still applies below
        user_function("--custom-advantage-function-path", args.custom_advantage_function_path)(args, rollout_data)
        advantages, returns = rollout_data["advantages"], rollout_data["returns"]
    elif estimator in ("grpo", "gspo", "cispo"):
        returns = get_grpo_returns(rewards, kl)
        advantages = list(returns)
    elif estimator == "ppo":
        values = _require(rollout_data, "values", "PPO's GAE needs (the critic's values of this rollout)")
        advantages, returns = get_advantages_and_returns_batch(
            rollout_data["total_lengths"],
            rollout_data["response_lengths"],
            values,
            get_ppo_token_rewards(rewards, kl, args.kl_coef),
            args.gamma,
            args.lambd,
        )
    elif estimator == "reinforce_plus_plus":
        returns = get_reinforce_plus_plus_returns(
            rewards=rewards,
            kl=kl,
            loss_masks=loss_masks,
            response_lengths=rollout_data["response_lengths"],
            total_lengths=rollout_data["total_lengths"],
            kl_coef=args.kl_coef,
            gamma=args.gamma,
        )
        advantages = list(returns)
    elif estimator == "reinforce_plus_plus_baseline":
        advantages = get_reinforce_plus_plus_baseline_advantages(rewards, kl, loss_masks, args.kl_coef)
        returns = advantages
    else:  # rloo (argparse's choices admit no other); its rewards arrive group-mean-centred (validated at start-up)
        returns = get_rloo_returns(rewards, kl, args.n_samples_per_prompt)
        advantages = list(returns)

    if args.use_opd:  # on top of any estimator, before whitening (as upstream)
        advantages = apply_opd_kl_to_advantages(args, rollout_data, advantages, log_probs)

    if args.normalize_advantages and advantages:
        all_advs = torch.cat(advantages)
        all_masks = torch.cat(loss_masks)
        assert all_advs.size() == all_masks.size(), f"advantages {all_advs.size()} vs loss masks {all_masks.size()}"
        whitened = distributed_masked_whiten(
            all_advs, all_masks, process_group=mpu.get_data_parallel_group(), shift_mean=True
        )
        advantages = list(torch.split(whitened, [a.size(0) for a in advantages]))

    rollout_data["advantages"] = advantages
    rollout_data["returns"] = returns


def get_sum_of_sample_mean(
    total_lengths, response_lengths, loss_masks, sample_denoms=None, calculate_per_token_loss=False
):
    """Reducer over a micro-batch's concatenated per-token values: sum over samples of the masked per-sample mean
    (`(x_i * m_i).sum() / max(d_i, 1)`, `d_i` = `m_i.sum()` or the given `sample_denoms`, e.g. a fan-out rollout's
    mask total shared by its samples, so the rollout contributes one token mean), or with `calculate_per_token_loss`
    the plain masked sum."""
    if sample_denoms is None:
        sample_denoms = [m.sum() for m in loss_masks]

    def reduce(x):
        chunks = x.split(response_lengths, dim=0)
        if calculate_per_token_loss:
            terms = [(x_i * m_i).sum() for x_i, m_i in zip(chunks, loss_masks)]
        else:
            terms = [
                (x_i * m_i).sum() / torch.clamp_min(torch.as_tensor(d_i), 1)
                for x_i, m_i, d_i in zip(chunks, loss_masks, sample_denoms)
            ]
        return torch.stack(terms).sum() if terms else x.sum() * 0

    return reduce


_ROLLOUT_LOGPROBS_NEEDED = "--use-rollout-logprobs needs (the rollout must return log-probs)"


def _require(batch, key, why):
    if batch.get(key) is None:
        raise ValueError(f"the training batch has no {key!r}, which {why}")
    return batch[key]


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
    rollout_lp = _require(
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
    advantages = torch.cat(_require(batch, "advantages", "the policy loss needs (compute_advantages_and_returns)"))
    if args.use_rollout_logprobs:
        old_log_probs = _require(batch, "rollout_log_probs", _ROLLOUT_LOGPROBS_NEEDED)
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
    if args.use_tis:
        rollout_lp = _require(batch, "rollout_log_probs", "--use-tis needs (the rollout must return log-probs)")
        if args.custom_tis_function_path:
            tis_fn = user_function("--custom-tis-function-path", args.custom_tis_function_path)
        else:  # --tis-mode mask: tokens sampled too far from the trainer's policy get no gradient (IcePop)
            tis_fn = icepop_function if args.tis_mode == "mask" else vanilla_tis_function
        pg_loss, pg_loss_masks, tis_metrics = tis_fn(
            args=args,
            pg_loss=pg_loss,
            train_log_probs=train_log_probs,
            rollout_log_probs=rollout_lp,
            loss_masks=batch["loss_masks"],
            total_lengths=batch["total_lengths"],
            response_lengths=response_lengths,
        )
        if pg_loss_masks is not batch["loss_masks"]:
            # rejected tokens leave the numerator; each sample's denominator stays its original mask sum
            pg_loss = pg_loss * torch.cat(pg_loss_masks).to(pg_loss.dtype)
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
    entropy_loss = sum_of_sample_mean(torch.cat(out["entropy"]) if out["entropy"] else log_probs)
    loss = pg_loss - args.entropy_coef * entropy_loss

    if args.use_kl_loss:
        ref_log_probs = torch.cat(_require(batch, "ref_log_probs", "--use-kl-loss needs (load a reference model)"))
        importance_ratio = None
        if args.use_unbiased_kl:
            old = torch.cat(old_log_probs) if old_log_probs else log_probs.detach()
            importance_ratio = torch.exp(log_probs - old)
        kl_loss = sum_of_sample_mean(
            compute_approx_kl(log_probs, ref_log_probs, args.kl_loss_type, importance_ratio=importance_ratio)
        )
        loss = loss + args.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss

    if log_probs.numel() == 0:
        loss = loss + 0 * logits.sum()  # keep the graph connected so backward still runs

    if rollout_log_probs is not None and train_log_probs:
        # trainer vs inference engine on the same weights (precision / kernel mismatch): the pre-update log-probs,
        # so later optimizer steps of this rollout do not count as mismatch
        metrics["train_rollout_logprob_abs_diff"] = sum_of_sample_mean(
            (torch.cat(train_log_probs) - torch.cat(rollout_log_probs)).abs()
        )
    if args.get_mismatch_metrics:
        metrics.update(
            _mismatch_metrics(args, batch, train_log_probs, pg_loss_before_tis, sum_of_sample_mean, response_lengths)
        )

    reported = {
        "loss": loss,
        "pg_loss": pg_loss,
        "entropy_loss": entropy_loss,
        "pg_clipfrac": sum_of_sample_mean(pg_clipfrac),
        "ppo_kl": sum_of_sample_mean(ppo_kl),
        **metrics,
    }
    return loss, {k: v.detach().clone() for k, v in reported.items()}


def value_loss_function(args, batch, logits, sum_of_sample_mean):
    """The critic's clipped value loss (`--value-clip`) against the GAE returns. Returns `(loss, metrics)`."""
    old_values = torch.cat(_require(batch, "values", "are the critic's old values of the clipped value loss"))
    returns = torch.cat(_require(batch, "returns", "the value loss needs (compute_advantages_and_returns)"))
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
