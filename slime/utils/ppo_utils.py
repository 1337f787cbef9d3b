"""PPO-family math: KL estimators, clipped policy loss, vocab-parallel log-probs and entropy, advantage estimators,
masked whitening, the losses' per-sample-mean reducer. Formulas follow slime; tensors are per-token 1-D unless stated
otherwise.

`process_group` for the vocab-parallel functions is the tensor-parallel group the vocab dimension is sharded over;
`None` means the logits hold the whole vocabulary.
"""

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

KL_LOSS_TYPES = ("kl", "k1", "k2", "k3", "low_var_kl")


def compute_approx_kl(log_probs, log_probs_base, kl_loss_type, importance_ratio=None):
    """Per-token estimate of KL(pi || pi_base) from sampled-token log-probs (Schulman's k1/k2/k3).
    `importance_ratio` (pi/pi_old per token, --use-unbiased-kl) weights each token's estimate before the clamp."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type in ("kl", "k1"):
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    else:
        kl = None
    if kl is not None:
        if importance_ratio is not None:
            kl = importance_ratio * kl
        # low_var_kl is k3 clamped so a single outlier token cannot blow up the loss
        return kl.clamp(min=-10, max=10) if kl_loss_type == "low_var_kl" else kl
    raise ValueError(
        f"unknown kl_loss_type {kl_loss_type!r} (--kl-loss-type); expected one of {', '.join(KL_LOSS_TYPES)}"
    )


def compute_cispo_loss(ppo_kl, log_probs, advantages, eps_clip, eps_clip_high):
    """CISPO (MiniMax-M1): `-sg(clip(ratio, 1 - eps_clip, 1 + eps_clip_high)) * A * logp` per token, so a clipped
    token still passes gradient (through logp). Returns `(pg_losses, clipfrac)`; `ppo_kl = old - new` log-probs."""
    ratio = (-ppo_kl).exp()
    clipped = ratio.clamp(1 - eps_clip, 1 + eps_clip_high)
    return -clipped.detach() * advantages * log_probs, (clipped != ratio).float()


def compute_opsm_mask(log_probs, old_log_probs, advantages, loss_masks, delta):
    """Off-Policy Sequence Masking (DeepSeek-V3.2), per sample: 0 for every token of a sample whose advantage is
    negative and whose masked mean of (old - new) log-prob exceeds `delta`, else 1. Lists of per-sample tensors in,
    one concatenated per-token mask out."""
    masks = []
    for new, old, adv, m in zip(log_probs, old_log_probs, advantages, loss_masks):
        seq_kl = ((old - new.detach()) * m).sum() / torch.clamp_min(m.sum(), 1)
        masks.append(1 - ((adv < 0) & (seq_kl > delta)).to(new.dtype))
    return torch.cat(masks) if masks else torch.zeros(0)


def compute_policy_loss(ppo_kl, advantages, eps_clip, eps_clip_high, eps_clip_c=None):
    """PPO clipped surrogate per token, optionally dual-clipped. Returns `(pg_losses, clipfrac)`.

    `ppo_kl = old_log_probs - log_probs`, so `ratio = exp(-ppo_kl)`. Dual clip (Ye et al. 2020) bounds the loss of
    negative-advantage tokens at `-eps_clip_c * A` when the ratio has grown very large (`eps_clip_c > 1`, checked
    with the arguments).
    """
    ratio = (-ppo_kl).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    if eps_clip_c is None:
        return clip_pg_losses1, clipfrac
    pg_losses3 = -eps_clip_c * advantages
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    return torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1), clipfrac


def _tp_rank_and_size(process_group):
    if process_group is None:
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _all_reduce(tensor, op, process_group):
    if process_group is not None and dist.get_world_size(process_group) > 1:
        dist.all_reduce(tensor, op=op, group=process_group)


class _VocabParallelLogProbs(torch.autograd.Function):
    """-cross_entropy over a vocab-sharded last dim, with an explicit TP group (megatron-core's math and backward)."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, process_group):
        # megatron's helpers subtract the max and exponentiate in place: the caller passes a private copy
        logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)
        _all_reduce(logits_max, dist.ReduceOp.MAX, process_group)
        rank, world_size = _tp_rank_and_size(process_group)
        part = logits.size(-1)
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
            VocabParallelCrossEntropy.calculate_predicted_logits(
                logits, target, logits_max, rank * part, (rank + 1) * part
            )
        )
        _all_reduce(predicted_logits, dist.ReduceOp.SUM, process_group)
        _all_reduce(sum_exp_logits, dist.ReduceOp.SUM, process_group)
        softmax, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
            exp_logits, predicted_logits, sum_exp_logits
        )
        ctx.save_for_backward(softmax, target_mask, masked_target_1d)
        return -loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d, arange_1d, softmax_update, grad_input = (
            VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax, target_mask)
        )
        grad_input = VocabParallelCrossEntropy.calculate_gradients(
            grad_2d, arange_1d, masked_target_1d, softmax_update, grad_input, -grad_output
        )
        return grad_input, None, None


def compute_log_probs(logits, tokens, process_group):
    """log p(tokens) from (vocab-sharded) logits `[..., V/tp]` and token ids `[...]`; differentiable."""
    return _VocabParallelLogProbs.apply(logits.to(torch.float32, copy=True), tokens, process_group)


class _VocabParallelEntropy(torch.autograd.Function):
    """Entropy of softmax(logits) over a vocab-sharded last dim: H = logsumexp(z) - sum(p * z)."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, process_group):
        logits = vocab_parallel_logits.float()
        logits_max = logits.max(dim=-1, keepdim=True).values
        _all_reduce(logits_max, dist.ReduceOp.MAX, process_group)
        softmax = (logits - logits_max).exp_()
        sum_exp = softmax.sum(dim=-1, keepdim=True)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, process_group)
        softmax.div_(sum_exp)
        sum_p_z = (softmax * logits).sum(dim=-1, keepdim=True)
        _all_reduce(sum_p_z, dist.ReduceOp.SUM, process_group)
        entropy = logits_max + sum_exp.log() - sum_p_z
        ctx.save_for_backward(logits, softmax, sum_p_z)
        return entropy.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_output):
        logits, softmax, sum_p_z = ctx.saved_tensors
        # dH/dz_j = -p_j * (z_j - sum_i p_i z_i); every shard has the full sum_p_z after the forward all-reduce
        grad = -softmax * (logits - sum_p_z) * grad_output.unsqueeze(-1)
        return grad, None


def compute_entropy_from_logits(logits, process_group):
    """Per-position entropy of softmax over (vocab-sharded) logits `[..., V/tp]`; differentiable."""
    return _VocabParallelEntropy.apply(logits, process_group)


def compute_value_loss(values, old_values, returns, value_clip):
    """PPO's clipped value loss per token: `max((V - R)^2, (V_clip - R)^2)` with `V_clip` = the old value plus the
    change clamped to `[-value_clip, value_clip]`. Returns `(losses, clipfrac)`, clipfrac 1 where the change
    exceeded the clip."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    losses = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    clipfrac = ((values - old_values).abs() > value_clip).float()
    return losses, clipfrac


def get_grpo_returns(rewards, kl):
    """GRPO/GSPO: every token's return is the (group-normalised upstream) sequence reward; KL is not subtracted."""
    return [torch.ones_like(kl[i]) * rewards[i] for i in range(len(rewards))]


def _pad_rows(rows, dtype=None):
    """Right-pad 1-D tensors into a `[B, max_len]` zero tensor (an empty batch gives `[0, 0]`)."""
    width = max((r.size(0) for r in rows), default=0)
    ref = rows[0] if rows else torch.zeros(0)
    out = ref.new_zeros(len(rows), width, dtype=dtype or ref.dtype)
    for i, r in enumerate(rows):
        out[i, : r.size(0)] = r
    return out


def chunked_discounted_returns(rewards, discount, chunk_size=128):
    """`G[:, t] = rewards[:, t] + discount * G[:, t + 1]` over a `[B, T]` batch (G = 0 past the end).

    Each chunk of `chunk_size` steps is one matrix product with a triangular matrix of non-negative powers of
    `discount` (never `discount**-t`, which overflows); only the carry between chunks is sequential, so the Python
    loop runs T / chunk_size times. Right-padding with zeros leaves each row's returns unchanged.

    Computed in float64 and returned in the input's dtype: in float32 the chunk products and the carried sums drift
    by ~1e-5 over 128k-token responses (current slime's test asks 1e-5 of the serial recursion there); in float64 the
    result is the float32 rounding of the exact returns.
    """
    assert rewards.ndim == 2, f"rewards must be [B, T], got {tuple(rewards.shape)}"
    B, T = rewards.shape
    if T == 0:
        return rewards.clone()
    if rewards.dtype != torch.float64:
        return chunked_discounted_returns(rewards.double(), discount, chunk_size).to(rewards.dtype)
    size = min(chunk_size, T)
    idx = torch.arange(size, device=rewards.device)
    expo = idx[None, :] - idx[:, None]  # column k minus row t: G_t takes r_k with discount**(k - t), k >= t
    powers = torch.pow(
        torch.tensor(discount, dtype=rewards.dtype, device=rewards.device), expo.clamp(min=0).to(rewards.dtype)
    ) * (expo >= 0)
    out = torch.empty_like(rewards)
    carry = rewards.new_zeros(B)
    for end in range(T, 0, -size):
        start = max(0, end - size)
        m = end - start
        block = rewards[:, start:end] @ powers[:m, :m].T
        # the carried-in G_end reaches step t with discount**(end - t)
        out[:, start:end] = block + carry[:, None] * (powers[:m, m - 1] * discount)
        carry = out[:, start]
    return out


def vanilla_gae(rewards, values, gamma, lambd):
    """Reference GAE over `[B, T]` token rewards and values, one step at a time (V = 0 past the end), accumulated
    in float64. Returns `(advantages, returns)` with `returns = advantages + values`, in the input's dtype."""
    dtype = rewards.dtype
    rewards, values = rewards.double(), values.double()
    B, T = rewards.shape
    last = rewards.new_zeros(B)
    advantages = torch.empty_like(rewards)
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lambd * last
        advantages[:, t] = last
    return advantages.to(dtype), (advantages + values).to(dtype)


def chunked_gae(rewards, values, gamma, lambd, chunk_size=128):
    """GAE over `[B, T]`: the TD errors `r_t + gamma V_{t+1} - V_t` discounted by `gamma * lambd`
    (`chunked_discounted_returns`), in float64. Returns `(advantages, returns)` in the input's dtype; matches
    `vanilla_gae`."""
    assert rewards.shape == values.shape, f"rewards {tuple(rewards.shape)} vs values {tuple(values.shape)}"
    dtype = rewards.dtype
    rewards, values = rewards.double(), values.double()
    next_values = torch.cat([values[:, 1:], values.new_zeros(values.size(0), 1)], dim=1)
    deltas = rewards + gamma * next_values - values
    advantages = chunked_discounted_returns(deltas, gamma * lambd, chunk_size)
    return advantages.to(dtype), (advantages + values).to(dtype)


@torch.no_grad()
def get_advantages_and_returns_batch(
    total_lengths, response_lengths, values_list, rewards_list, gamma, lambd, chunked=True
):
    """Batched GAE over per-sample response tensors (`values_list[i]`, `rewards_list[i]`: `[response_lengths[i]]`).
    The samples are right-padded into one batch; the value past a response's end is 0. Returns
    `(advantages_list, returns_list)` of the same shapes.

    Each rank holds whole responses (the trainer gathers values and log-probs across context-parallel ranks), so
    no CP slicing is needed here; `total_lengths` is kept for slime's signature.
    """
    if not values_list:
        return [], []
    values = _pad_rows([v.float() for v in values_list])
    rewards = _pad_rows([r.float() for r in rewards_list])
    gae = chunked_gae if chunked else vanilla_gae
    advantages, returns = gae(rewards, values, gamma, lambd)
    lengths = [v.size(0) for v in values_list]
    return [advantages[i, :n] for i, n in enumerate(lengths)], [returns[i, :n] for i, n in enumerate(lengths)]


def get_ppo_token_rewards(rewards, kl, kl_coef):
    """PPO's token rewards: the KL penalty `-kl_coef * kl` on every response token, and the scalar reward added on
    the last one."""
    token_rewards = []
    for reward, per_token_kl in zip(rewards, kl):
        r = -kl_coef * per_token_kl.float()
        if r.numel():
            r[-1] += reward
        token_rewards.append(r)
    return token_rewards


def get_reinforce_plus_plus_returns(rewards, kl, loss_masks, response_lengths, total_lengths, kl_coef, gamma):
    """REINFORCE++: token rewards `-kl_coef * kl` on the loss-masked-in tokens, the sequence reward added at the last
    loss-masked-in token, then discounted returns `G_t = r_t + gamma * G_{t+1}` over the response (batched)."""
    token_rewards = []
    for i in range(len(rewards)):
        mask = loss_masks[i]
        nonzero = mask.nonzero(as_tuple=True)[0]
        if nonzero.numel() == 0:
            raise ValueError(
                f"REINFORCE++ needs at least one loss-masked-in response token, but sample {i} of this batch "
                f"(response length {response_lengths[i]}, total length {total_lengths[i]}) has an all-zero loss mask"
            )
        # tokens outside the loss mask (tool output, observations) are not the policy's: no KL penalty on them
        r = -kl_coef * kl[i].float() * mask.float()
        r[nonzero[-1]] += rewards[i]
        token_rewards.append(r)
    if not token_rewards:
        return []
    returns = chunked_discounted_returns(_pad_rows(token_rewards), gamma)
    return [returns[i, : r.size(0)] for i, r in enumerate(token_rewards)]


def get_reinforce_plus_plus_baseline_advantages(rewards, kl, loss_masks, kl_coef):
    """REINFORCE++-baseline: group-mean-subtracted reward (upstream) minus the per-token KL penalty."""
    return [torch.ones_like(kl[i]) * rewards[i] - kl_coef * kl[i] for i in range(len(rewards))]


def get_rloo_returns(rewards, kl, n_samples_per_prompt):
    """RLOO: advantage = r_i - mean of the other n-1 rewards of the group (leave-one-out baseline).

    `rewards` arrive centred on their group mean (the rollout controller does that for rloo), and
    `r_i - mean_{j!=i} r_j = n/(n-1) * (r_i - mean_j r_j)`, so the per-sample reward only needs rescaling; this keeps
    the estimator correct when a group's samples land on different DP ranks.
    """
    n = n_samples_per_prompt
    if n < 2:
        raise ValueError(
            f"--advantage-estimator rloo needs --n-samples-per-prompt >= 2 (got {n}): the leave-one-out "
            "baseline averages the other samples of the same prompt"
        )
    scale = n / (n - 1)
    return [torch.ones_like(kl[i]) * (rewards[i] * scale) for i in range(len(rewards))]


def distributed_masked_whiten(values, mask, process_group=None, shift_mean=True, eps=1e-8):
    """Whiten `values` with mean/var over masked-in entries of every rank in `process_group` (default: the default
    group when torch.distributed is initialised, else this process only). Variance is Bessel-corrected."""
    v, m = values.float(), mask.float()
    stats = torch.stack([(v * m).sum(), (v.square() * m).sum(), m.sum()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats, group=process_group)
    total, total_sq, count = stats.tolist()
    if count == 0:
        raise ValueError("cannot whiten advantages (--normalize-advantages): no loss-masked-in token on any rank")
    mean = total / count
    var = total_sq / count - mean**2
    if count >= 2:
        var *= count / (count - 1)
    whitened = (values - mean) * torch.rsqrt(torch.tensor(var + eps, dtype=values.dtype, device=values.device))
    return whitened if shift_mean else whitened + mean


def get_sum_of_sample_mean(
    total_lengths, response_lengths, loss_masks, sample_denoms=None, calculate_per_token_loss=False
):
    """Reducer over a micro-batch's concatenated per-token values: sum over samples of the masked per-sample mean
    (`(x_i * m_i).sum() / max(d_i, 1)`, `d_i` = `m_i.sum()` or the given `sample_denoms`, e.g. a fan-out rollout's
    mask total shared by its samples, so the rollout contributes one token mean), or with `calculate_per_token_loss`
    the plain masked sum. Each token's weight (`m / max(d, 1)`) is computed once, so a reduction is one multiply and
    one sum over the micro-batch, not a few operations per sample."""
    if not loss_masks:
        return lambda x: x.sum() * 0
    mask = torch.cat(loss_masks)
    if calculate_per_token_loss:
        weights = mask
    else:
        lengths = torch.as_tensor(response_lengths, device=mask.device)
        if sample_denoms is None:
            owner = torch.repeat_interleave(
                torch.arange(len(loss_masks), device=mask.device), lengths, output_size=mask.numel()
            )
            denoms = torch.zeros(len(loss_masks), dtype=mask.dtype, device=mask.device).index_add_(0, owner, mask)
        else:
            denoms = torch.stack([torch.as_tensor(d, device=mask.device) for d in sample_denoms])
        # output_size: the length is known, so a GPU need not sync to learn it
        weights = mask / torch.repeat_interleave(denoms.clamp_min(1), lengths, output_size=mask.numel())

    def reduce(x):
        if x.shape[:1] != weights.shape:  # a mismatch would broadcast silently
            raise ValueError(f"sum_of_sample_mean: {tuple(x.shape)} values for {weights.numel()} response tokens")
        return (x * weights).sum()

    return reduce
