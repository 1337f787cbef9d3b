"""Megatron losses: response log-probs in padded and packed layouts, sum-of-sample-mean reducers,
PPO/GSPO policy loss (dual clip, TIS, KL loss, entropy), SFT/custom losses and slime's loss scaling, advantage
estimators over rollout data. Runs in a one-rank gloo world with Megatron's parallel state."""

import math
import pickle

import pytest
import torch

from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
from slime.backends.megatron_utils.log_probs import get_log_probs_and_entropy
from slime.backends.megatron_utils.loss import loss_function, policy_loss_function
from slime.utils.ppo_utils import get_sum_of_sample_mean
from slime.utils.user_errors import UserCodeError, exit_on_user_error
from tests._args import make_args as real_args

V = 16


pytestmark = pytest.mark.usefixtures("mpu_world1")  # a one-rank Megatron world (conftest)


def _args(**kw):
    base = dict(
        rollout_temperature=1.0,
        advantage_estimator="grpo",
        eps_clip=0.2,
        eps_clip_high=0.2,
        eps_clip_c=None,
        use_tis=False,
        tis_clip=2.0,
        tis_clip_low=0.0,
        tis_mode="truncate",
        entropy_coef=0.0,
        use_kl_loss=False,
        kl_loss_coef=0.0,
        kl_loss_type="kl",
        loss_type="policy_loss",
        calculate_per_token_loss=False,
        global_batch_size=4,
        custom_loss_function_path=None,
        kl_coef=0.0,
        gamma=1.0,
        normalize_advantages=False,
        n_samples_per_prompt=2,
        rewards_normalization=True,
        custom_tis_function_path=None,
        custom_pg_loss_reducer_function_path=None,
        custom_advantage_function_path=None,
    )
    base.update(kw)
    return real_args(**base)


def _ref_response_log_probs(logits_row, tokens, total_len, resp_len, temperature=1.0):
    logp = torch.log_softmax(logits_row[total_len - resp_len - 1 : total_len - 1] / temperature, -1)
    return logp.gather(-1, tokens[total_len - resp_len : total_len, None])[:, 0]


# ---------------------------------------------------------------- public paths
# upstream slime's loss.py names (and this module's before log-probs and advantages moved out), which user code and
# plugins import from slime.backends.megatron_utils.loss: each is the object of the module that defines it now
LOSS_PATH_NAMES = {
    "slime.backends.megatron_utils.log_probs": (
        "get_responses",
        "get_log_probs_and_entropy",
        "get_values",
        "get_rollout_top_p_logprob_kwargs",
    ),
    "slime.backends.megatron_utils.advantages": ("compute_advantages_and_returns", "apply_opd_kl_to_advantages"),
    "slime.utils.ppo_utils": ("get_sum_of_sample_mean",),
    "slime.backends.megatron_utils.loss": (
        "policy_loss_function",
        "value_loss_function",
        "sft_loss_function",
        "loss_function",
        "vanilla_tis_function",
        "icepop_function",
    ),
}


def test_the_loss_module_keeps_its_public_names():
    import importlib

    from slime.backends.megatron_utils import loss

    for home, names in LOSS_PATH_NAMES.items():
        module = importlib.import_module(home)
        for name in names:
            assert getattr(loss, name) is getattr(module, name), name
            assert getattr(module, name).__module__ == home, name


# ---------------------------------------------------------------- reducers
def test_sum_of_sample_mean_per_sample_and_per_token():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 7.0])
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1, 1]), torch.tensor([0])]
    per_sample = get_sum_of_sample_mean([5, 4, 2], [3, 2, 1], masks)
    per_token = get_sum_of_sample_mean([5, 4, 2], [3, 2, 1], masks, calculate_per_token_loss=True)
    assert per_sample(x).item() == pytest.approx((1 + 2) / 2 + (4 + 5) / 2 + 0.0)  # fully masked sample adds 0
    assert per_token(x).item() == pytest.approx(1 + 2 + 4 + 5)
    # fan-out: the first two samples are one rollout, averaged over its 4 masked tokens together
    per_rollout = get_sum_of_sample_mean([5, 4, 2], [3, 2, 1], masks, sample_denoms=[4, 4, 0])
    assert per_rollout(x).item() == pytest.approx((1 + 2 + 4 + 5) / 4 + 0.0)
    assert get_sum_of_sample_mean([], [], [])(torch.zeros(0, requires_grad=True)).item() == 0
    with pytest.raises(ValueError, match=r"\(5,\) values for 6 response tokens"):
        per_sample(x[:5])


# ---------------------------------------------------------------- log-probs from logits
def test_log_probs_padded_and_packed_layouts_match_log_softmax():
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, V, (n,), generator=g) for n in (5, 8, 3)]
    total, resp = [5, 8, 3], [3, 2, 1]
    padded = torch.randn(3, 8, V, generator=g)
    packed = torch.cat([padded[i, :n] for i, n in enumerate(total)]).unsqueeze(0)
    args = _args(rollout_temperature=0.7)
    for logits in (padded, packed):
        out = get_log_probs_and_entropy(
            logits, args=args, unconcat_tokens=tokens, total_lengths=total, response_lengths=resp, with_entropy=True
        )
        for i in range(3):
            want = _ref_response_log_probs(padded[i], tokens[i], total[i], resp[i], temperature=0.7)
            assert torch.allclose(out["log_probs"][i], want, atol=1e-5)
            p = torch.log_softmax(padded[i, total[i] - resp[i] - 1 : total[i] - 1] / 0.7, -1)
            assert torch.allclose(out["entropy"][i], -(p.exp() * p).sum(-1), atol=1e-5)
    # temperature really matters
    t1 = get_log_probs_and_entropy(
        packed, args=_args(), unconcat_tokens=tokens, total_lengths=total, response_lengths=resp
    )
    assert not torch.allclose(t1["log_probs"][0], out["log_probs"][0]) and "entropy" not in t1


def test_padded_vocab_rows_are_excluded_from_the_softmax():
    # Megatron pads the vocab (here 12 -> 16); the engine's softmax only knows the 12 real ids
    g = torch.Generator().manual_seed(4)
    tokens = [torch.randint(0, 12, (6,), generator=g)]
    logits = torch.randn(1, 6, V, generator=g).requires_grad_()
    out = get_log_probs_and_entropy(
        logits,
        args=_args(vocab_size=12),
        unconcat_tokens=tokens,
        total_lengths=[6],
        response_lengths=[4],
        with_entropy=True,
    )
    logp = torch.log_softmax(logits[0, 1:5, :12].detach(), -1)
    assert torch.allclose(out["log_probs"][0], logp.gather(-1, tokens[0][2:, None])[:, 0], atol=1e-5)
    assert torch.allclose(out["entropy"][0], -(logp.exp() * logp).sum(-1), atol=1e-5)
    (out["log_probs"][0].sum() + out["entropy"][0].sum()).backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[..., 12:].abs().max() == 0


def test_empty_response_and_prompt_less_sample():
    logits = torch.randn(1, 4, V)
    out = get_log_probs_and_entropy(
        logits,
        args=_args(),
        unconcat_tokens=[torch.zeros(4, dtype=torch.long)],
        total_lengths=[4],
        response_lengths=[0],
        with_entropy=True,
    )
    assert out["log_probs"][0].shape == (0,) and out["entropy"][0].shape == (0,)
    with pytest.raises(ValueError, match="no prompt token"):
        get_log_probs_and_entropy(
            logits,
            args=_args(),
            unconcat_tokens=[torch.zeros(4, dtype=torch.long)],
            total_lengths=[4],
            response_lengths=[4],
        )


# ---------------------------------------------------------------- policy loss
def _one_sample_batch(ratios, advantages, seed=0, mask=None):
    """One sample: 2 prompt + len(ratios) response tokens; old log-probs chosen so exp(new - old) == ratios."""
    g = torch.Generator().manual_seed(seed)
    r = len(ratios)
    tokens = torch.randint(0, V, (2 + r,), generator=g)
    logits = torch.randn(1, 2 + r, V, generator=g).requires_grad_()
    new = _ref_response_log_probs(logits[0].detach(), tokens, 2 + r, r)
    old = new - torch.log(torch.tensor(ratios))
    batch = {
        "unconcat_tokens": [tokens],
        "total_lengths": [2 + r],
        "response_lengths": [r],
        "loss_masks": [torch.tensor(mask or [1] * r, dtype=torch.int)],
        "log_probs": [old],
        "advantages": [torch.tensor(advantages)],
    }
    return batch, logits, new


def _reducer(batch, per_token=False):
    return get_sum_of_sample_mean(
        batch["total_lengths"], batch["response_lengths"], batch["loss_masks"], calculate_per_token_loss=per_token
    )


def test_policy_loss_dual_clip_passes_eps_clip_c():
    batch, logits, _ = _one_sample_batch([2.0, 2.0, 0.5], [2.0, -2.0, 2.0])
    args = _args(eps_clip_c=1.5)
    loss, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["pg_loss"].item() == pytest.approx((-2.4 + 3.0 - 1.0) / 3, abs=1e-5)
    assert m["pg_clipfrac"].item() == pytest.approx(1 / 3)
    assert m["ppo_kl"].item() == pytest.approx(-(math.log(2) * 2 + math.log(0.5)) / 3, abs=1e-5)
    assert loss.item() == pytest.approx(m["pg_loss"].item())
    loss.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    # without --eps-clip-c the A<0 token costs ratio*|A| = 4
    loss, m = policy_loss_function(_args(), batch, logits, _reducer(batch))
    assert m["pg_loss"].item() == pytest.approx((-2.4 + 4.0 - 1.0) / 3, abs=1e-5)


def test_policy_loss_on_policy_first_step_has_zero_kl_and_clipfrac():
    batch, logits, new = _one_sample_batch([1.0, 1.0], [0.5, -0.5], mask=[1, 0])
    loss, m = policy_loss_function(_args(), batch, logits, _reducer(batch))
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6) and m["pg_clipfrac"].item() == 0.0
    assert m["pg_loss"].item() == pytest.approx(-0.5, abs=1e-5)  # only the masked-in token counts


def test_tis_weights_are_clamped():
    batch, logits, new = _one_sample_batch([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    old = batch["log_probs"][0]
    batch["rollout_log_probs"] = [old - torch.log(torch.tensor([3.0, 1.0, 0.05]))]  # tis = exp(old - rollout)
    args = _args(use_tis=True, tis_clip=2.0, tis_clip_low=0.1)
    loss, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["tis"].item() == pytest.approx((3.0 + 1.0 + 0.05) / 3, rel=1e-5)
    assert m["tis_clipfrac"].item() == pytest.approx(2 / 3)
    assert m["ois"].item() == pytest.approx(1.0, abs=1e-5)
    # ratio 1, A 1 -> per-token loss -1, times the clamped weights [2, 1, 0.1]
    assert m["pg_loss"].item() == pytest.approx(-(2.0 + 1.0 + 0.1) / 3, abs=1e-5)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        del batch["rollout_log_probs"]
        policy_loss_function(args, batch, logits, _reducer(batch))


def test_tis_mask_mode_zeroes_tokens_outside_the_range():
    batch, logits, new = _one_sample_batch([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    old = batch["log_probs"][0]
    batch["rollout_log_probs"] = [old - torch.log(torch.tensor([3.0, 1.5, 0.05]))]
    loss, m = policy_loss_function(
        _args(use_tis=True, tis_clip=2.0, tis_clip_low=0.1, tis_mode="mask"), batch, logits, _reducer(batch)
    )
    # weights [0, 1.5, 0]: only the middle token, within [0.1, 2], keeps its (unclipped) weight
    assert m["pg_loss"].item() == pytest.approx(-1.5 / 3, abs=1e-5)
    assert m["tis_clipfrac"].item() == pytest.approx(2 / 3)


def test_gspo_uses_the_sequence_level_ratio():
    batch, logits, _ = _one_sample_batch([2.0, 1.0], [1.0, 1.0])
    # sequence ratio = exp(mean(new - old)) = sqrt(2) = 1.414 > 1.2 -> clipped for both tokens
    loss, m = policy_loss_function(_args(advantage_estimator="gspo"), batch, logits, _reducer(batch))
    assert m["pg_loss"].item() == pytest.approx(-1.2, abs=1e-5)
    assert m["pg_clipfrac"].item() == pytest.approx(1.0)
    loss, m = policy_loss_function(
        _args(advantage_estimator="gspo", eps_clip_high=0.5), batch, logits, _reducer(batch)
    )
    assert m["pg_loss"].item() == pytest.approx(-math.sqrt(2), abs=1e-5)
    # token-level PPO on the same data: token ratios 2 (clipped to 1.2) and 1
    _, m = policy_loss_function(_args(), batch, logits, _reducer(batch))
    assert m["pg_loss"].item() == pytest.approx(-(1.2 + 1.0) / 2, abs=1e-5)


def test_kl_loss_entropy_bonus_and_rollout_logprob_diff():
    batch, logits, new = _one_sample_batch([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    batch["ref_log_probs"] = [new - 0.1]  # k1 KL = +0.1 per token
    batch["rollout_log_probs"] = [new + torch.tensor([0.1, -0.2, 0.3])]
    args = _args(use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.01)
    loss, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["kl_loss"].item() == pytest.approx(0.1, abs=1e-5)
    p = torch.log_softmax(logits[0, 1:4].detach(), -1)
    entropy = -(p.exp() * p).sum(-1).mean().item()
    assert m["entropy_loss"].item() == pytest.approx(entropy, abs=1e-5)
    assert loss.item() == pytest.approx(0.0 - 0.01 * entropy + 0.5 * 0.1, abs=1e-5)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.2, abs=1e-5)
    # KL is reported even with a zero coefficient
    _, m = policy_loss_function(_args(use_kl_loss=True), batch, logits, _reducer(batch))
    assert m["kl_loss"].item() == pytest.approx(0.1, abs=1e-5)


def test_opd_reverse_kl_is_logged_per_step_over_the_trained_tokens():
    # --use-opd: each token's log pi_student - log pi_teacher (computed before training), averaged per sample over the
    # loss mask: the masked-out 5.0 does not count
    batch, logits, _ = _one_sample_batch([1.0, 1.0, 1.0], [0.0, 0.0, 0.0], mask=[1, 1, 0])
    batch["opd_reverse_kl"] = [torch.tensor([0.3, 0.1, 5.0])]
    _, m = policy_loss_function(_args(), batch, logits, _reducer(batch))
    assert m["opd_reverse_kl"].item() == pytest.approx(0.2, abs=1e-6)
    del batch["opd_reverse_kl"]
    assert "opd_reverse_kl" not in policy_loss_function(_args(), batch, logits, _reducer(batch))[1]


# ---------------------------------------------------------------- loss_function
def _custom_loss(args, batch, logits, sum_of_sample_mean):
    loss = logits.sum() * 0 + 7.0
    return loss, {"my_metric": torch.tensor(3.0)}


def test_loss_function_scaling_and_return_shape():
    batch, logits, new = _one_sample_batch([1.0, 1.0], [1.0, 1.0])
    args = _args(loss_type="sft_loss", global_batch_size=8)
    loss, denom, report = loss_function(args, batch, num_microbatches=2, logits=logits)
    nll = -new.mean().item()
    assert loss.item() == pytest.approx(nll * 2 / 8, abs=1e-5)  # * num_microbatches / gbs * dp(=1)
    assert denom == 1 and report["keys"] == ["loss"]
    assert report["values"].tolist() == pytest.approx([1.0, nll], abs=1e-5)  # [num_samples, *metrics]

    loss, denom, report = loss_function(
        _args(loss_type="sft_loss", calculate_per_token_loss=True, global_batch_size=8), batch, 2, logits
    )
    assert denom.item() == 2 and report["values"][0].item() == 2.0  # token count
    # per-token: a plain token sum; Megatron divides the gradients by the global token count (num_microbatches-independent)
    assert loss.item() == pytest.approx(-new.sum().item(), abs=1e-5)

    loss, _, report = loss_function(_args(loss_type="policy_loss"), batch, 1, logits)
    assert report["keys"][:5] == ["loss", "pg_loss", "entropy_loss", "pg_clipfrac", "ppo_kl"]

    args = _args(
        loss_type="custom_loss", custom_loss_function_path="tests.test_loss._custom_loss", global_batch_size=7
    )
    loss, _, report = loss_function(args, batch, 1, logits)
    assert loss.item() == pytest.approx(1.0) and report["keys"] == ["my_metric"] and report["values"][1].item() == 3.0
    # --loss-type custom_loss without a path is refused at start-up: tests/test_startup_checks.py


def _raising_loss(args, batch, logits, sum_of_sample_mean):
    return batch["advantage"], {}  # a typo of the user's: the key is "advantages"


def test_custom_loss_exception_is_reported_as_the_users_own_with_the_flag(capsys):
    """Inside a trainer the user's loss fails: the driver prints their traceback from their function's frame, then
    one line naming the flag and the function (exit 1), as for a rollout function (the error crosses Ray pickled)."""
    batch, logits, _ = _one_sample_batch([1.0, 1.0], [1.0, 1.0])
    path = "tests.test_loss._raising_loss"
    with pytest.raises(UserCodeError) as exc:
        loss_function(_args(loss_type="custom_loss", custom_loss_function_path=path), batch, 1, logits)
    with pytest.raises(SystemExit) as end, exit_on_user_error():
        raise pickle.loads(pickle.dumps(exc.value))
    assert end.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].endswith("in _raising_loss") and "test_loss.py" in lines[1]
    assert lines[-2] == "KeyError: 'advantage'"
    assert lines[-1].endswith(f"error: raised by --custom-loss-function-path {path}")
    assert not any('loss.py"' in line and "test_loss.py" not in line for line in lines)  # none of slime's frames


def test_loss_with_no_response_tokens_keeps_the_graph():
    tokens = torch.arange(3)
    logits = torch.randn(1, 3, V, requires_grad=True)
    batch = {
        "unconcat_tokens": [tokens],
        "total_lengths": [3],
        "response_lengths": [0],
        "loss_masks": [torch.zeros(0, dtype=torch.int)],
        "log_probs": [torch.zeros(0)],
        "advantages": [torch.zeros(0)],
    }
    loss, _, _ = loss_function(_args(), batch, 1, logits)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


# ---------------------------------------------------------------- advantages over rollout data
def _rollout(rewards=(1.0, -1.0), resp=(3, 2)):
    return {
        "log_probs": [torch.full((r,), -0.5) for r in resp],
        "ref_log_probs": [torch.full((r,), -0.7) for r in resp],
        "rewards": list(rewards),
        "loss_masks": [torch.ones(r, dtype=torch.int) for r in resp],
        "response_lengths": list(resp),
        "total_lengths": [r + 4 for r in resp],
    }


def test_compute_advantages_grpo_and_normalisation():
    data = _rollout()
    compute_advantages_and_returns(_args(), data)
    assert [a.tolist() for a in data["advantages"]] == [[1.0] * 3, [-1.0] * 2]
    assert data["returns"][0].tolist() == [1.0] * 3
    data = _rollout()
    compute_advantages_and_returns(_args(normalize_advantages=True), data)
    values = torch.tensor([1.0] * 3 + [-1.0] * 2)
    want = (values - values.mean()) / values.std()
    assert torch.allclose(torch.cat(data["advantages"]), want, atol=1e-5)


def test_compute_advantages_reinforce_family_and_rloo():
    data = _rollout()
    compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus", kl_coef=0.5, gamma=1.0), data)
    # kl (k1) = -0.5 - (-0.7) = 0.2 per token -> token reward -0.1; reward at the last token; gamma 1 -> suffix sums
    assert torch.allclose(data["advantages"][0], torch.tensor([0.7, 0.8, 0.9]))
    assert torch.allclose(data["returns"][1], torch.tensor([-1.2, -1.1]))

    data = _rollout()
    compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5), data)
    assert torch.allclose(data["advantages"][0], torch.full((3,), 0.9)) and data["returns"] is data["advantages"]

    data = _rollout(rewards=(0.5, -0.5))  # group [1, 0] centred
    compute_advantages_and_returns(_args(advantage_estimator="rloo"), data)
    assert torch.allclose(data["advantages"][0], torch.ones(3)) and torch.allclose(
        data["advantages"][1], -torch.ones(2)
    )

    # an unknown --advantage-estimator is refused by argparse's choices (tests/test_arguments.py)
    # no old-log-prob forward ran (the training forward's log-probs are reused): GRPO needs only the rewards
    data = _rollout()
    del data["log_probs"]
    compute_advantages_and_returns(_args(), data)
    assert torch.allclose(data["advantages"][0], torch.ones(3)) and torch.allclose(data["kl"][1], torch.zeros(2))
    with pytest.raises(ValueError, match="--kl-coef != 0 needs the old log-probs"):
        compute_advantages_and_returns(_args(advantage_estimator="reinforce_plus_plus", kl_coef=0.5), data)


# ---------------------------------------------------------------- current slime's loss hooks
HERE = "tests.test_loss"


def reject_middle_tis(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths
):
    """Rejection sampling: drop the middle token of each sample, weight 1 elsewhere; one per-token metric."""
    masks = [m.clone() for m in loss_masks]
    for m in masks:
        m[len(m) // 2] = 0
    return pg_loss, masks, {"rejected": torch.cat([1 - m for m in masks]).float()}


def reject_middle_tis_in_place(
    args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths
):
    """reject_middle_tis, editing the masks it was given."""
    for m in loss_masks:
        m[len(m) // 2] = 0
    return pg_loss, loss_masks, {"rejected": torch.cat([1 - m for m in loss_masks]).float()}


def constant_denominator_reducer(total_lengths, response_lengths, loss_masks, calculate_per_token_loss):
    """Dr.GRPO: masked token sum over a constant 10."""
    mask = torch.cat(loss_masks).float()
    return lambda x: (x * mask).sum() / 10


def plus_kl_advantages(args, rollout_data):
    """A custom estimator: reward + 2 per token, plus the kl slime computed first."""
    rollout_data["advantages"] = [
        torch.full_like(k, r) + 2 + k for k, r in zip(rollout_data["kl"], rollout_data["rewards"])
    ]
    rollout_data["returns"] = [torch.full_like(k, 7.0) for k in rollout_data["kl"]]


def test_tis_function_by_path_icepop_and_rejection():
    batch, logits, new = _one_sample_batch([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    batch["rollout_log_probs"] = [batch["log_probs"][0] - torch.log(torch.tensor([3.0, 1.0, 0.05]))]
    icepop = _args(
        use_tis=True,
        tis_clip=2.0,
        tis_clip_low=0.1,
        custom_tis_function_path="slime.backends.megatron_utils.loss.icepop_function",
    )
    _, m = policy_loss_function(icepop, batch, logits, _reducer(batch))
    # ratios [3, 1, 0.05] in band [0.1, 2] -> weights [0, 1, 0]; per-token loss -1
    assert m["pg_loss"].item() == pytest.approx(-1 / 3, abs=1e-5)
    assert m["tis_clipfrac"].item() == pytest.approx(2 / 3) and m["tis_abs"].item() == pytest.approx(
        (2 + 0 + 0.95) / 3
    )

    for tis in ("reject_middle_tis", "reject_middle_tis_in_place"):
        reject = _args(use_tis=True, custom_tis_function_path=f"{HERE}.{tis}")
        _, m = policy_loss_function(reject, batch, logits, _reducer(batch))
        # middle token rejected: numerator -(1 + 1), denominator still the 3 original mask tokens
        assert m["pg_loss"].item() == pytest.approx(-2 / 3, abs=1e-5), tis
        assert m["rejected"].item() == pytest.approx(1 / 3)  # reduced with the pre-rejection reducer
        assert batch["loss_masks"][0].tolist() == [1, 1, 1]  # the batch's own masks are not changed

    # the rejected token leaves the entropy and KL terms too (and their metrics), over the same 3-token denominator
    logp = torch.log_softmax(logits[0, 1:4].detach(), -1)
    entropy = -(logp.exp() * logp).sum(-1)
    batch["ref_log_probs"] = [batch["log_probs"][0] - torch.tensor([0.5, 0.25, 0.125])]  # k1 KL = new - ref
    kl = new - batch["ref_log_probs"][0]
    args = _args(use_tis=True, custom_tis_function_path=f"{HERE}.reject_middle_tis", entropy_coef=0.1)
    args.use_kl_loss, args.kl_loss_coef = True, 1.0
    loss, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["entropy_loss"].item() == pytest.approx((entropy[0] + entropy[2]).item() / 3, abs=1e-5)
    assert m["kl_loss"].item() == pytest.approx((kl[0] + kl[2]).item() / 3, abs=1e-5)
    assert loss.item() == pytest.approx(-2 / 3 - 0.1 * m["entropy_loss"].item() + m["kl_loss"].item(), abs=1e-5)


def test_pg_loss_reducer_by_path_applies_to_pg_loss_only():
    batch, logits, _ = _one_sample_batch([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], mask=[1, 1, 1, 0])
    args = _args(custom_pg_loss_reducer_function_path=f"{HERE}.constant_denominator_reducer", entropy_coef=0.0)
    _, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["pg_loss"].item() == pytest.approx(-3 / 10, abs=1e-5)
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6)  # other metrics keep the default reducer


def test_custom_advantage_function_replaces_the_estimator_but_not_normalisation():
    data = _rollout()
    compute_advantages_and_returns(_args(custom_advantage_function_path=f"{HERE}.plus_kl_advantages"), data)
    assert [a.tolist() for a in data["advantages"]] == [[3.0] * 3, [1.0] * 2]  # rewards 1, -1; kl 0 (kl_coef 0)
    assert data["returns"][1].tolist() == [7.0, 7.0] and [k.tolist() for k in data["kl"]] == [[0.0] * 3, [0.0] * 2]
    data = _rollout()
    compute_advantages_and_returns(
        _args(custom_advantage_function_path=f"{HERE}.plus_kl_advantages", normalize_advantages=True), data
    )
    values = torch.tensor([3.0] * 3 + [1.0] * 2)
    assert torch.allclose(torch.cat(data["advantages"]), (values - values.mean()) / values.std(), atol=1e-5)


# ---------------------------------------------------------------- --recompute-loss-function
_LOSS_CALLS = []


def _counting_policy_loss(args, batch, logits, sum_of_sample_mean):
    _LOSS_CALLS.append(1)
    return policy_loss_function(args, batch, logits, sum_of_sample_mean)


def _loss_grads_saved(args, batch, logits):
    """Loss, report values, d loss / d logits, and the number of elements autograd saved for the backward pass."""
    logits = logits.detach().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _, report = loss_function(args, batch, 1, logits)
    loss.backward()
    return loss.detach(), report["values"], logits.grad, sum(saved)


@pytest.mark.parametrize("loss_type", ["policy_loss", "sft_loss", "custom_loss"])
def test_recompute_loss_function_gives_the_same_loss_and_gradients_saving_less(loss_type):
    batch, logits, _ = _one_sample_batch([1.5, 0.7, 1.0], [1.0, -2.0, 0.5])
    kw = dict(
        loss_type=loss_type, entropy_coef=0.01, custom_loss_function_path="tests.test_loss._counting_policy_loss"
    )
    plain = _loss_grads_saved(_args(**kw), batch, logits)
    _LOSS_CALLS.clear()
    recomputed = _loss_grads_saved(_args(**kw, recompute_loss_function=True), batch, logits)
    for a, b in zip(plain[:3], recomputed[:3]):
        assert torch.equal(a, b)
    assert plain[2].abs().sum() > 0
    # the loss's intermediates (log-softmax over the vocabulary...) are not kept: only what the checkpoint holds
    assert recomputed[3] < plain[3]
    if loss_type == "custom_loss":
        assert len(_LOSS_CALLS) == 2  # once forward, once again in the backward pass


def test_recomputed_custom_loss_error_is_still_the_users():
    batch, logits, _ = _one_sample_batch([1.0, 1.0], [1.0, 1.0])
    path = "tests.test_loss._raising_loss"
    args = _args(loss_type="custom_loss", custom_loss_function_path=path, recompute_loss_function=True)
    with pytest.raises(UserCodeError) as exc:
        loss_function(args, batch, 1, logits)
    assert exc.value.context == f"raised by --custom-loss-function-path {path}"
    assert "KeyError: 'advantage'" in exc.value.user_traceback
