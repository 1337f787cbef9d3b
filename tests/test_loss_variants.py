"""Current slime's loss variants: CISPO, OPSM, unbiased KL and the k1 name, checked against values worked out by
hand. Runs in a one-rank gloo world with Megatron's parallel state (the `mpu_world1` fixture of tests/conftest.py)."""

import math

import pytest
import torch

from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
from slime.backends.megatron_utils.loss import policy_loss_function
from tests._args import make_args
from tests.test_loss import _args, _one_sample_batch, _reducer, _rollout

pytestmark = pytest.mark.usefixtures("mpu_world1")  # a one-rank Megatron world (conftest)


def _two_sample_batch(first, second):
    """Two `_one_sample_batch` samples packed back to back in one row, as the trainer packs them."""
    (b1, l1, n1), (b2, l2, n2) = first, second
    logits = torch.cat([l1.detach(), l2.detach()], dim=1).requires_grad_()
    batch = {k: b1[k] + b2[k] for k in b1}
    return batch, logits, (n1, n2)


def test_kl_loss_type_defaults_to_k1_and_kl_is_still_accepted():
    assert make_args().kl_loss_type == "k1"
    assert make_args("--kl-loss-type", "kl").kl_loss_type == "kl"


def test_cispo_clips_the_ratio_under_stop_gradient():
    # token ratios 2, 0.5, 1 with advantages 1, 1, -1; eps 0.2 -> clipped weights 1.2, 0.8, 1.0
    batch, logits, new = _one_sample_batch([2.0, 0.5, 1.0], [1.0, 1.0, -1.0])
    args = _args(advantage_estimator="cispo")
    loss, m = policy_loss_function(args, batch, logits, _reducer(batch))
    lp = new.tolist()
    want = (-1.2 * lp[0] - 0.8 * lp[1] + 1.0 * lp[2]) / 3
    assert m["pg_loss"].item() == pytest.approx(want, abs=1e-5)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 3)
    loss.backward()
    # the gradient is that of sum(-w * A * logp) / 3 with the weights held constant: clipped tokens still learn
    ref_logits = logits.detach().clone().requires_grad_()
    tokens = batch["unconcat_tokens"][0]
    logp = torch.log_softmax(ref_logits[0, 1:4], -1).gather(-1, tokens[2:5, None]).squeeze(-1)
    (-(torch.tensor([1.2, 0.8, 1.0]) * torch.tensor([1.0, 1.0, -1.0]) * logp).sum() / 3).backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-6)
    # PPO on the same data: the token with ratio 2 > 1.2 and A > 0 is clipped and gets no gradient at all
    logits.grad = None
    loss, _ = policy_loss_function(_args(), batch, logits, _reducer(batch))
    loss.backward()
    assert torch.count_nonzero(logits.grad[0, 1]) == 0


def test_cispo_advantages_are_grpo_ones():
    data = _rollout()
    compute_advantages_and_returns(_args(advantage_estimator="cispo"), data)
    assert [a.tolist() for a in data["advantages"]] == [[1.0] * 3, [-1.0] * 2]


def test_opsm_masks_negative_off_policy_sequences():
    # both samples: token ratios 0.5 -> mean(old - new) = log 2 = 0.693 > delta; only the A < 0 one is masked
    batch, logits, _ = _two_sample_batch(
        _one_sample_batch([0.5, 0.5], [-1.0, -1.0], seed=1), _one_sample_batch([0.5, 0.5], [1.0, 1.0], seed=2)
    )
    _, m = policy_loss_function(_args(), batch, logits, _reducer(batch))
    # without OPSM, per-token PPO: A<0 -> max(0.5, 0.8) = 0.8; A>0 -> max(-0.5, -0.8) = -0.5 (sum of sample means)
    assert m["pg_loss"].item() == pytest.approx(0.8 - 0.5, abs=1e-5)
    assert "opsm_clipfrac" not in m
    args = _args(use_opsm=True, opsm_delta=1e-4)
    _, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["pg_loss"].item() == pytest.approx(-0.5, abs=1e-5)
    assert m["opsm_clipfrac"].item() == pytest.approx(1.0)  # one masked sample (divided by the count later)
    # a delta above log 2 keeps both
    _, m = policy_loss_function(_args(use_opsm=True, opsm_delta=0.7), batch, logits, _reducer(batch))
    assert m["pg_loss"].item() == pytest.approx(0.3, abs=1e-5)
    assert m["opsm_clipfrac"].item() == 0.0


def test_unbiased_kl_weights_the_kl_loss_by_the_importance_ratio():
    batch, logits, new = _one_sample_batch([2.0, 0.5, 1.0], [0.0, 0.0, 0.0])
    batch["ref_log_probs"] = [new - 0.1]  # k1 = 0.1 per token
    _, m = policy_loss_function(_args(use_kl_loss=True, kl_loss_type="k1"), batch, logits, _reducer(batch))
    assert m["kl_loss"].item() == pytest.approx(0.1, abs=1e-5)
    args = _args(use_kl_loss=True, kl_loss_type="k1", use_unbiased_kl=True)
    _, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["kl_loss"].item() == pytest.approx(0.1 * (2.0 + 0.5 + 1.0) / 3, abs=1e-5)
    # k3 with ratio weights: k3(d) = exp(-d) - 1 + d at d = 0.1
    k3 = math.exp(-0.1) - 1 + 0.1
    args = _args(use_kl_loss=True, kl_loss_type="k3", use_unbiased_kl=True)
    _, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["kl_loss"].item() == pytest.approx(k3 * 3.5 / 3, abs=1e-5)


def test_cispo_with_a_lower_bound_warns(caplog):
    make_args("--advantage-estimator", "cispo")
    assert "canonical CISPO has no lower bound" in caplog.text
