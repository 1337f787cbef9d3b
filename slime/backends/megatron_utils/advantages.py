"""Advantage estimators over a rank's rollout data: `compute_advantages_and_returns` (GRPO / GSPO / CISPO, PPO's
GAE, REINFORCE++ (baseline), RLOO or a custom estimator, the KL penalty, on-policy distillation's reverse-KL term and
`--normalize-advantages`), and the batch-key check the losses share.
"""

import torch
from megatron.core import parallel_state as mpu

from slime.utils.ppo_utils import (
    compute_approx_kl,
    distributed_masked_whiten,
    get_advantages_and_returns_batch,
    get_grpo_returns,
    get_ppo_token_rewards,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    get_rloo_returns,
)
from slime.utils.user_errors import user_function

ROLLOUT_LOGPROBS_NEEDED = "--use-rollout-logprobs needs (the rollout must return log-probs)"


def require_key(batch, key, why):
    """`batch[key]`, or a ValueError naming the missing key and `why` it is needed."""
    if batch.get(key) is None:
        raise ValueError(f"the training batch has no {key!r}, which {why}")
    return batch[key]


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
        log_probs = require_key(rollout_data, "rollout_log_probs", ROLLOUT_LOGPROBS_NEEDED)
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
        values = require_key(rollout_data, "values", "PPO's GAE needs (the critic's values of this rollout)")
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
