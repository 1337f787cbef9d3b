"""PPO math: KL estimators, clipped/dual-clipped policy loss, vocab-parallel log-probs and entropy
(incl. TP=2 gloo ranks), advantage estimators on hand-computed cases, distributed masked whitening."""

import math

import pytest
import torch

from slime.utils.ppo_utils import (
    compute_approx_kl,
    compute_entropy_from_logits,
    compute_log_probs,
    compute_policy_loss,
    distributed_masked_whiten,
    get_grpo_returns,
    get_reinforce_plus_plus_baseline_advantages,
    get_reinforce_plus_plus_returns,
    get_rloo_returns,
)
from tests._megatron_helpers import spawn


# ---------------------------------------------------------------- KL estimators
def test_kl_estimators_on_hand_values():
    lp = torch.tensor([0.5, -1.0, 0.0])
    base = torch.zeros(3)
    assert torch.allclose(compute_approx_kl(lp, base, "kl"), lp)
    assert torch.allclose(compute_approx_kl(lp, base, "k1"), lp)
    assert torch.allclose(compute_approx_kl(lp, base, "k2"), torch.tensor([0.125, 0.5, 0.0]))
    k3 = torch.tensor([math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1.0, 0.0])
    assert torch.allclose(compute_approx_kl(lp, base, "k3"), k3)
    assert torch.allclose(compute_approx_kl(lp, base, "low_var_kl"), k3)
    # low_var_kl clamps at 10; k3 does not (exp(20) - 21 ~ 4.85e8)
    far = torch.tensor([-20.0])
    assert compute_approx_kl(far, torch.zeros(1), "low_var_kl").item() == 10.0
    assert compute_approx_kl(far, torch.zeros(1), "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-5)


def test_kl_estimator_unknown_type_is_value_error():
    with pytest.raises(ValueError, match="kl_loss_type 'k9'"):
        compute_approx_kl(torch.zeros(2), torch.zeros(2), "k9")


# ---------------------------------------------------------------- policy loss
def _ppo_kl(ratios):
    return -torch.log(torch.tensor(ratios))  # ppo_kl = old - new, ratio = exp(-ppo_kl)


def test_policy_loss_worked_dual_clip_example():
    adv = torch.tensor([2.0, -2.0, 2.0])
    loss, clipfrac = compute_policy_loss(_ppo_kl([2.0, 2.0, 0.5]), adv, 0.2, 0.2, eps_clip_c=1.5)
    assert torch.allclose(loss, torch.tensor([-2.4, 3.0, -1.0]))
    assert clipfrac.tolist() == [1.0, 0.0, 0.0]
    # without the dual clip the negative-advantage token pays the full -ratio*A = 4
    loss, _ = compute_policy_loss(_ppo_kl([2.0, 2.0, 0.5]), adv, 0.2, 0.2)
    assert torch.allclose(loss, torch.tensor([-2.4, 4.0, -1.0]))


def test_policy_loss_asymmetric_clip():
    loss, _ = compute_policy_loss(_ppo_kl([2.0, 0.5]), torch.tensor([1.0, -1.0]), 0.2, 0.28)
    # ratio 2, A 1 -> clipped at 1.28; ratio 0.5, A -1 -> max(0.5, 0.8) = 0.8
    assert torch.allclose(loss, torch.tensor([-1.28, 0.8]))
    # --eps-clip-c <= 1 is refused with the arguments: tests/test_arguments.py::test_rule7_*


# ---------------------------------------------------------------- log-probs / entropy
def _reference(logits, tokens):
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, tokens[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def test_log_probs_and_entropy_match_log_softmax_with_grads():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 7, 64, generator=g) * 3).requires_grad_()
    tokens = torch.randint(0, 64, (3, 7), generator=g)
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    before = logits.detach().clone()
    lp = compute_log_probs(logits, tokens, None)
    ent = compute_entropy_from_logits(logits, None)
    assert torch.equal(logits.detach(), before), "compute_log_probs must not edit its input in place"
    ref_lp, ref_ent = _reference(logits, tokens)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)
    got = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), logits)[0]
    want = torch.autograd.grad((ref_lp * w1).sum() + (ref_ent * w2).sum(), logits)[0]
    assert torch.allclose(got, want, atol=1e-5)


def test_log_probs_of_bf16_logits_and_empty_input():
    logits = torch.randn(4, 32).bfloat16()
    tokens = torch.randint(0, 32, (4,))
    lp = compute_log_probs(logits, tokens, None)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, _reference(logits.float(), tokens)[0], atol=1e-5)
    assert compute_log_probs(torch.zeros(0, 32), torch.zeros(0, dtype=torch.long), None).shape == (0,)
    assert compute_entropy_from_logits(torch.zeros(0, 32), None).shape == (0,)


def _tp2_vocab_parallel(rank):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1)
    full = torch.randn(5, 6, 40, generator=g) * 2
    tokens = torch.randint(0, 40, (5, 6), generator=g)
    w1, w2 = torch.randn(5, 6, generator=g), torch.randn(5, 6, generator=g)
    group = dist.new_group([0, 1])
    shard = full[..., rank * 20 : (rank + 1) * 20].clone().requires_grad_()
    lp = compute_log_probs(shard, tokens, group)
    ent = compute_entropy_from_logits(shard, group)
    full = full.requires_grad_()
    ref_lp, ref_ent = _reference(full, tokens)
    assert torch.allclose(lp, ref_lp, atol=1e-5), (lp - ref_lp).abs().max()
    assert torch.allclose(ent, ref_ent, atol=1e-5), (ent - ref_ent).abs().max()
    got = torch.autograd.grad((lp * w1).sum() + (ent * w2).sum(), shard)[0]
    want = torch.autograd.grad((ref_lp * w1).sum() + (ref_ent * w2).sum(), full)[0][..., rank * 20 : (rank + 1) * 20]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


# ---------------------------------------------------------------- advantage estimators
def test_grpo_returns_broadcast_reward():
    kl = [torch.zeros(3), torch.zeros(2)]
    out = get_grpo_returns(torch.tensor([0.5, -1.0]), kl)
    assert [o.tolist() for o in out] == [[0.5] * 3, [-1.0] * 2]


def test_reinforce_plus_plus_returns_hand_case():
    kl = [torch.tensor([0.1, 0.2, 0.3, 0.4])]
    mask = [torch.tensor([1, 1, 1, 0])]
    (ret,) = get_reinforce_plus_plus_returns(torch.tensor([1.0]), kl, mask, [4], [10], kl_coef=0.5, gamma=0.9)
    # token rewards -0.5*kl*mask = [-.05, -.1, -.15, 0]; +1 at the last masked-in token (index 2)
    g3 = 0.0
    g2 = 0.85 + 0.9 * g3
    g1 = -0.1 + 0.9 * g2
    g0 = -0.05 + 0.9 * g1
    assert torch.allclose(ret, torch.tensor([g0, g1, g2, g3]))


def test_reinforce_plus_plus_long_sequence_matches_recursion():
    g = torch.Generator().manual_seed(3)
    n = 700  # spans several chunks of the vectorised scan
    kl = torch.randn(n, generator=g) * 0.1
    mask = torch.ones(n, dtype=torch.int)
    mask[-5:] = 0
    for gamma in (1.0, 0.99):
        (ret,) = get_reinforce_plus_plus_returns(
            torch.tensor([2.0]), [kl], [mask], [n], [n + 3], kl_coef=0.1, gamma=gamma
        )
        r = (-0.1 * kl * mask).tolist()
        r[n - 6] += 2.0
        expect, running = [0.0] * n, 0.0
        for t in reversed(range(n)):
            running = r[t] + gamma * running
            expect[t] = running
        assert torch.allclose(ret, torch.tensor(expect), atol=1e-4), gamma


def test_reinforce_plus_plus_fully_masked_sample_is_an_error():
    with pytest.raises(ValueError, match="sample 0"):
        get_reinforce_plus_plus_returns(
            torch.tensor([1.0]), [torch.zeros(2)], [torch.zeros(2, dtype=torch.int)], [2], [5], kl_coef=0.0, gamma=1.0
        )


def test_reinforce_plus_plus_baseline():
    (adv,) = get_reinforce_plus_plus_baseline_advantages(torch.tensor([0.5]), [torch.tensor([0.2, 0.4])], None, 0.1)
    assert torch.allclose(adv, torch.tensor([0.48, 0.46]))


def test_rloo_equals_leave_one_out_baseline():
    raw = [1.0, 0.0, 0.0, 1.0]
    centred = torch.tensor(raw) - 0.5  # what the rollout controller hands over for rloo
    out = get_rloo_returns(centred, [torch.zeros(2)] * 4, n_samples_per_prompt=4)
    # r_i - mean of the other three
    expect = [1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3]
    assert torch.allclose(torch.stack([o[0] for o in out]), torch.tensor(expect))
    assert all(o.shape == (2,) for o in out)
    with pytest.raises(ValueError, match="n-samples-per-prompt"):
        get_rloo_returns(centred, [torch.zeros(2)] * 4, n_samples_per_prompt=1)


# ---------------------------------------------------------------- whitening
def test_masked_whiten_hand_case():
    values = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1, 1, 1, 0])
    # masked mean 2, Bessel-corrected variance ((1+0+1)/3)*3/2 = 1
    out = distributed_masked_whiten(values, mask, eps=0.0)
    assert torch.allclose(out, torch.tensor([-1.0, 0.0, 1.0, 98.0]))
    assert torch.allclose(distributed_masked_whiten(values, mask, shift_mean=False, eps=0.0), out + 2.0)
    with pytest.raises(ValueError, match="no loss-masked-in token"):
        distributed_masked_whiten(values, torch.zeros(4))


def _whiten_two_ranks(rank):
    values = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 100.0])][rank]
    mask = [torch.tensor([1, 1]), torch.tensor([1, 0])][rank]
    out = distributed_masked_whiten(values, mask, eps=0.0)
    assert torch.allclose(out, [torch.tensor([-1.0, 0.0]), torch.tensor([1.0, 98.0])][rank]), out


def _two_rank_checks(rank):
    _tp2_vocab_parallel(rank)
    _whiten_two_ranks(rank)


def test_vocab_parallel_log_probs_entropy_and_whitening_on_two_gloo_ranks():
    """One spawn (rank start-up dominates): TP=2 vocab-sharded log-probs/entropy/grads, then whitening over 2 ranks."""
    spawn(_two_rank_checks, 2, timeout=240)
