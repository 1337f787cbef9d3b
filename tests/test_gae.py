"""GAE and discounted returns (PPO with a critic, REINFORCE++): hand-worked values, then slime's own GAE / returns
test cases (upstream tests/test_chunked_gae.py and tests/test_discounted_returns.py) run against our functions."""

import pytest
import torch

from slime.utils.ppo_utils import (
    chunked_discounted_returns,
    chunked_gae,
    get_advantages_and_returns_batch,
    get_ppo_token_rewards,
    get_reinforce_plus_plus_returns,
    vanilla_gae,
)


def _serial_returns(rewards, discount):
    """G_t = r_t + discount * G_{t+1}, one step at a time over `[B, T]`."""
    out = torch.zeros_like(rewards)
    running = torch.zeros(rewards.size(0), dtype=rewards.dtype)
    for t in reversed(range(rewards.size(1))):
        running = rewards[:, t] + discount * running
        out[:, t] = running
    return out


# ---------------------------------------------------------------- hand-worked values
def test_discounted_returns_hand_case():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, -1.0, 0.0]])
    out = chunked_discounted_returns(rewards, 0.5, chunk_size=2)  # the carry crosses a chunk boundary
    # row 0: G2 = 2, G1 = 0 + .5*2 = 1, G0 = 1 + .5*1 = 1.5; row 1: G2 = 0, G1 = -1, G0 = -.5
    assert torch.allclose(out, torch.tensor([[1.5, 1.0, 2.0], [-0.5, -1.0, 0.0]]))


def test_gae_hand_case():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    # gamma .9, lambda .8: deltas d2 = 1 - .4 = .6, d1 = .9*.4 - .2 = .16, d0 = .9*.2 - .5 = -.32
    # A2 = .6, A1 = .16 + .72*.6 = .592, A0 = -.32 + .72*.592 = .10624; returns = A + V
    expect_adv = torch.tensor([[0.10624, 0.592, 0.6]])
    for gae in (vanilla_gae, chunked_gae):
        adv, ret = gae(rewards, values, 0.9, 0.8)
        assert torch.allclose(adv, expect_adv, atol=1e-6), gae.__name__
        assert torch.allclose(ret, torch.tensor([[0.60624, 0.792, 1.0]]), atol=1e-6), gae.__name__


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.2, 0.4]])
    adv, ret = chunked_gae(rewards, values, 1.0, 1.0)
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0]]))  # Monte-Carlo return of a final reward 1
    assert torch.allclose(adv, torch.tensor([[0.5, 0.8, 0.6]]))


def test_ppo_token_rewards_put_the_reward_on_the_last_token():
    kl = [torch.tensor([0.1, -0.2, 0.3]), torch.tensor([0.4])]
    out = get_ppo_token_rewards(torch.tensor([1.0, -1.0]), kl, kl_coef=0.5)
    assert torch.allclose(out[0], torch.tensor([-0.05, 0.1, 0.85]))
    assert torch.allclose(out[1], torch.tensor([-1.2]))


def test_batched_gae_over_samples_of_different_lengths():
    values = [torch.tensor([0.5, 0.2, 0.4]), torch.tensor([1.0])]
    rewards = [torch.tensor([0.0, 0.0, 1.0]), torch.tensor([2.0])]
    adv, ret = get_advantages_and_returns_batch([10, 4], [3, 1], values, rewards, 0.9, 0.8)
    assert [a.shape[0] for a in adv] == [3, 1]
    assert torch.allclose(adv[0], torch.tensor([0.10624, 0.592, 0.6]), atol=1e-6)
    # the short sample's padding does not leak in: V past its end is 0, so A = 2 - 1 = 1, return 2
    assert torch.allclose(adv[1], torch.tensor([1.0])) and torch.allclose(ret[1], torch.tensor([2.0]))
    adv_s, ret_s = get_advantages_and_returns_batch([10, 4], [3, 1], values, rewards, 0.9, 0.8, chunked=False)
    for a, b in zip(adv + ret, adv_s + ret_s):
        assert torch.allclose(a, b, atol=1e-6)
    assert get_advantages_and_returns_batch([], [], [], [], 0.9, 0.8) == ([], [])


# ---------------------------------------------------------------- slime's test cases, against our functions
@pytest.mark.parametrize("discount", [0.0, 0.5, 0.99, 1.0])
@pytest.mark.parametrize("batch_size,sequence_length", [(1, 1), (3, 127), (3, 128), (3, 129), (3, 1000)])
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-5), (torch.float64, 1e-10, 1e-10)])
def test_chunked_discounted_returns_matches_serial(discount, batch_size, sequence_length, dtype, atol, rtol):
    torch.manual_seed(0)
    rewards = torch.randn(batch_size, sequence_length, dtype=dtype)
    actual = chunked_discounted_returns(rewards, discount)
    torch.testing.assert_close(actual, _serial_returns(rewards, discount), atol=atol, rtol=rtol)
    assert actual.dtype == rewards.dtype and actual.device == rewards.device


def test_chunked_discounted_returns_preserves_right_padding():
    torch.manual_seed(0)
    lengths = [3, 129, 511]
    rewards = torch.zeros(len(lengths), max(lengths))
    for i, n in enumerate(lengths):
        rewards[i, :n] = torch.randn(n)
    actual = chunked_discounted_returns(rewards, 0.99)
    for i, n in enumerate(lengths):
        expected = _serial_returns(rewards[i : i + 1, :n], 0.99)[0]
        torch.testing.assert_close(actual[i, :n], expected, atol=1e-4, rtol=1e-5)
        assert torch.count_nonzero(actual[i, n:]) == 0


def test_reinforce_plus_plus_returns_match_serial_for_variable_lengths():
    rewards = torch.tensor([2.0, -1.0])
    kl = [torch.tensor([0.2, 0.1, 0.3, 0.4, 0.5]), torch.tensor([0.4, 0.2, 0.1])]
    loss_masks = [torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 1.0])]
    actual = get_reinforce_plus_plus_returns(
        rewards=rewards,
        kl=kl,
        loss_masks=loss_masks,
        response_lengths=[3, 3],
        total_lengths=[5, 3],
        kl_coef=0.1,
        gamma=0.99,
    )
    assert len(actual) == 2
    for reward, seq_kl, mask, got in zip(rewards, kl, loss_masks, actual):
        token_rewards = -0.1 * seq_kl * mask
        token_rewards[mask.nonzero(as_tuple=True)[0][-1]] += reward
        torch.testing.assert_close(got, _serial_returns(token_rewards[None], 0.99)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sequence_length", [127, 128, 129])
def test_chunked_gae_matches_serial_after_scan_reuse(sequence_length):
    torch.manual_seed(0)
    rewards = torch.randn(3, sequence_length)
    values = torch.randn(3, sequence_length)
    expected = vanilla_gae(rewards, values, gamma=0.99, lambd=0.95)
    actual = chunked_gae(rewards, values, gamma=0.99, lambd=0.95)
    torch.testing.assert_close(actual[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual[1], expected[1], atol=1e-5, rtol=1e-5)


# slime also runs (256, 128 * 1024), a GPU-sized case: its serial reference alone takes minutes on CPU
@pytest.mark.parametrize("B,T", [(16, 4096), (32, 8192)])
@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_gae_parallel_matches_serial(B, T, chunk_size):
    torch.manual_seed(0)
    rewards = torch.randn(B, T)
    values = torch.randn(B, T)
    adv_s, ret_s = vanilla_gae(rewards, values, 0.99, 0.95)
    adv_p, ret_p = chunked_gae(rewards, values, 0.99, 0.95, chunk_size=chunk_size)
    assert (adv_s - adv_p).abs().max().item() < 1e-5
    assert (ret_s - ret_p).abs().max().item() < 1e-5


def _numpy_gae(rewards, values, gamma, lambd):
    """Exact (float64) GAE, one step at a time in NumPy: the reference for long responses."""
    import numpy as np

    r, v = rewards.double().numpy(), values.double().numpy()
    next_v = np.concatenate([v[:, 1:], np.zeros((v.shape[0], 1))], axis=1)
    deltas = r + gamma * next_v - v
    adv = np.empty_like(deltas)
    last = np.zeros(deltas.shape[0])
    for t in range(deltas.shape[1] - 1, -1, -1):
        last = deltas[:, t] + gamma * lambd * last
        adv[:, t] = last
    return torch.from_numpy(adv), torch.from_numpy(adv + v)


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_chunked_gae_is_exact_to_float32_at_128k_tokens(chunk_size):
    # current slime's test_chunked_gae.py asks 1e-5 of the serial recursion at 131k tokens; float32 chunk products
    # drifted 1.2e-5 there. Accumulated in float64 the result is the float32 rounding of the exact GAE (~5e-7 here)
    torch.manual_seed(0)
    rewards, values = torch.randn(2, 128 * 1024), torch.randn(2, 128 * 1024)
    exact_adv, exact_ret = _numpy_gae(rewards, values, 0.99, 0.95)
    adv, ret = chunked_gae(rewards, values, 0.99, 0.95, chunk_size=chunk_size)
    assert adv.dtype == ret.dtype == torch.float32
    assert (adv.double() - exact_adv).abs().max().item() < 1e-6
    assert (ret.double() - exact_ret).abs().max().item() < 1e-6
