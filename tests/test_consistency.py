"""Train/inference consistency: PPO's old log-probs from the engine (--use-rollout-logprobs), mismatch metrics
that leave the loss alone (--get-mismatch-metrics) and the masked/truncated IS helper of
examples/train_infer_mismatch_helper. Loss tests run in a one-rank gloo world with Megatron's parallel state; the
expected values are worked out by hand from log_softmax."""

import math

import pytest
import torch

from slime.backends.megatron_utils.actor import needs_old_log_prob_forward
from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
from slime.backends.megatron_utils.loss import policy_loss_function
from slime.config import parse_args
from slime.utils.ppo_utils import get_sum_of_sample_mean
from tests._args import BASE, TINY_MODEL, make_args

V = 16


pytestmark = pytest.mark.usefixtures("mpu_world1")  # a one-rank Megatron world (conftest)


def parse_error(capsys, *extra):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv=[*BASE, *TINY_MODEL, *extra], check_paths=False)
    assert exc.value.code == 2
    return capsys.readouterr().err


def _sample(ratios, advantages, rollout_shift, seed=0):
    """One sample, 2 prompt + R response tokens; the trainer's old log-probs are new - log(ratios), the engine's
    are old + rollout_shift. Returns (batch, logits, new log-probs)."""
    g = torch.Generator().manual_seed(seed)
    r = len(ratios)
    tokens = torch.randint(0, V, (2 + r,), generator=g)
    logits = torch.randn(1, 2 + r, V, generator=g).requires_grad_()
    logp = torch.log_softmax(logits[0, 1 : 1 + r].detach(), -1)
    new = logp.gather(-1, tokens[2:, None])[:, 0]
    old = new - torch.log(torch.tensor(ratios))
    batch = {
        "unconcat_tokens": [tokens],
        "total_lengths": [2 + r],
        "response_lengths": [r],
        "loss_masks": [torch.ones(r, dtype=torch.int)],
        "log_probs": [old],
        "rollout_log_probs": [old + torch.tensor(rollout_shift)],
        "advantages": [torch.tensor(advantages)],
    }
    return batch, logits, new


def _reducer(batch):
    return get_sum_of_sample_mean(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"])


# ---------------------------------------------------------------- --use-rollout-logprobs
def test_use_rollout_logprobs_is_refused_with_use_tis(capsys):
    err = parse_error(capsys, "--use-rollout-logprobs", "--use-tis")
    assert "--use-rollout-logprobs and --use-tis" in err and len(err.strip().splitlines()) <= 2


def test_use_rollout_logprobs_skips_the_old_log_prob_forward_unless_metrics_need_it():
    # two optimizer steps per rollout: the training forward of step 2 runs on updated weights, so no reuse
    assert needs_old_log_prob_forward(make_args(), num_steps=2)
    assert not needs_old_log_prob_forward(make_args("--use-rollout-logprobs"), num_steps=2)
    assert needs_old_log_prob_forward(make_args("--use-rollout-logprobs", "--get-mismatch-metrics"), num_steps=2)


def test_one_optimizer_step_per_rollout_reuses_the_training_forwards_log_probs():
    assert not needs_old_log_prob_forward(make_args(), num_steps=1)
    assert not needs_old_log_prob_forward(make_args("--use-tis", "--use-kl-loss"), num_steps=1)
    # something needs the old log-probs before training, or the old policy is not the live one
    for flags in (
        ["--kl-coef", "0.1", "--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages"],
        ["--use-rollout-entropy"],
        ["--advantage-estimator", "gspo"],
        ["--loss-type", "sft_loss"],
        ["--custom-advantage-function-path", "my_module.my_advantages"],
        ["--rollout-data-postprocess-path", "my_module.my_postprocess"],
    ):
        assert needs_old_log_prob_forward(make_args(*flags), num_steps=1), flags
    assert needs_old_log_prob_forward(make_args(keep_old_actor=True), num_steps=1)  # train_async.py's flag


def test_keep_old_actor_is_refused_where_the_push_before_the_last_did_not_generate_the_rollout(capsys):
    """The trainers keep the weights of the push before the last: the rollout's own weights in train_async.py's
    one-step-off loop only (the e2e test of that loop checks the log-probs); elsewhere a one-line refusal."""
    from slime.config.rollout import FULLY_ASYNC_ROLLOUT_FUNCTION

    def parse(*argv, asynchronous=True):
        argv = [*BASE, *TINY_MODEL, "--keep-old-actor", *argv]
        return parse_args(argv=argv, check_paths=False, asynchronous=asynchronous)

    def refusal(*argv, asynchronous=True):
        with pytest.raises(SystemExit) as e:
            parse(*argv, asynchronous=asynchronous)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1, err
        return err

    assert parse().keep_old_actor
    assert "train.py generates each rollout with the weights it then trains" in refusal(asynchronous=False)
    assert "several weight versions" in refusal("--rollout-function-path", FULLY_ASYNC_ROLLOUT_FUNCTION)
    assert "--update-weights-interval 2 a rollout" in refusal("--update-weights-interval", "2")
    assert "--debug-train-only pushes no weights" in refusal("--debug-train-only")


def test_without_an_old_log_prob_forward_the_old_policy_is_this_forward_detached():
    batch, logits, new = _sample([1.0, 1.0], [1.0, -1.0], [0.05, -0.05])
    del batch["log_probs"]
    loss, m = policy_loss_function(make_args(), batch, logits, _reducer(batch))
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0
    assert m["pg_loss"].item() == pytest.approx(0.0, abs=1e-6)  # -(1 * 1 + 1 * -1) / 2
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(0.05, abs=1e-6)
    loss.backward()  # the gradient is the on-policy policy gradient: -A * d log pi / 2 per token
    expected = torch.zeros_like(logits)
    for r, a in enumerate([1.0, -1.0]):
        row = logits[0, 1 + r].detach()
        p = torch.softmax(row, -1)
        onehot = torch.nn.functional.one_hot(batch["unconcat_tokens"][0][2 + r], V).float()
        expected[0, 1 + r] = -a * (onehot - p) / 2
    assert torch.allclose(logits.grad, expected, atol=1e-6)


def test_use_rollout_logprobs_makes_the_engine_policy_the_ppo_old_policy():
    # engine log-probs = new - log(2) on every token: ratio exp(new - rollout) = 2 > 1.2, clipped for A > 0
    batch, logits, new = _sample([1.0, 1.0], [1.0, 1.0], [-math.log(2)] * 2)
    del batch["log_probs"]  # no trainer forward ran
    args = make_args("--use-rollout-logprobs")
    loss, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert m["ppo_kl"].item() == pytest.approx(-math.log(2), abs=1e-5)
    assert m["pg_loss"].item() == pytest.approx(-1.2, abs=1e-5)  # -min(2 A, clip(2, 0.8, 1.2) A)
    assert m["pg_clipfrac"].item() == pytest.approx(1.0)
    # the trainer's side of the reported gap is this forward's log-probs (the same weights on the first step)
    assert m["train_rollout_logprob_abs_diff"].item() == pytest.approx(math.log(2), abs=1e-5)
    # without the flag the trainer's old log-probs are used: ratio 1
    batch2, logits2, _ = _sample([1.0, 1.0], [1.0, 1.0], [-math.log(2)] * 2)
    _, m = policy_loss_function(make_args(), batch2, logits2, _reducer(batch2))
    assert m["ppo_kl"].item() == pytest.approx(0.0, abs=1e-6) and m["pg_loss"].item() == pytest.approx(-1.0)


def test_use_rollout_logprobs_needs_rollout_log_probs():
    batch, logits, _ = _sample([1.0], [1.0], [0.0])
    del batch["rollout_log_probs"]
    with pytest.raises(ValueError, match="--use-rollout-logprobs"):
        policy_loss_function(make_args("--use-rollout-logprobs"), batch, logits, _reducer(batch))


def test_use_rollout_logprobs_is_the_kl_base_of_the_reward():
    # REINFORCE++ with kl in the reward: kl = log pi_old - log pi_ref per token, old = the engine's
    rollout = {
        "rewards": [1.0],
        "loss_masks": [torch.ones(2, dtype=torch.int)],
        "response_lengths": [2],
        "total_lengths": [4],
        "rollout_log_probs": [torch.tensor([-1.0, -2.0])],
        "ref_log_probs": [torch.tensor([-1.5, -2.0])],
    }
    args = make_args(
        "--use-rollout-logprobs",
        "--advantage-estimator",
        "reinforce_plus_plus",
        "--normalize-advantages",
        "--kl-coef",
        "0.1",
        "--kl-loss-type",
        "k1",
    )
    compute_advantages_and_returns(args, rollout)
    assert torch.allclose(rollout["kl"][0], torch.tensor([0.5, 0.0]))
    # returns: token 0 gets -0.1*0.5 + (token 1's reward 1 - 0) = 0.95; token 1 gets 1.0
    assert torch.allclose(rollout["returns"][0], torch.tensor([0.95, 1.0]), atol=1e-6)


# ---------------------------------------------------------------- --get-mismatch-metrics
MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"


def test_mismatch_metrics_are_reported_and_the_loss_is_unchanged():
    shift = [0.1, -0.2, 0.3]  # rollout = train + shift, so r = train - rollout = -shift
    batch, logits, _ = _sample([2.0, 1.0, 0.5], [1.0, -1.0, 1.0], shift)
    loss0, m0 = policy_loss_function(make_args(), batch, logits, _reducer(batch))
    loss1, m1 = policy_loss_function(make_args("--get-mismatch-metrics"), batch, logits, _reducer(batch))
    assert loss1.item() == loss0.item() and m1["pg_loss"].item() == m0["pg_loss"].item()
    s = torch.tensor(shift)
    assert m1["mismatch_kl"].item() == pytest.approx(s.mean().item(), abs=1e-6)
    assert m1["mismatch_is_weight"].item() == pytest.approx(torch.exp(-s).mean().item(), abs=1e-6)
    assert m1["mismatch_k3_kl"].item() == pytest.approx((torch.exp(-s) - 1 + s).mean().item(), abs=1e-6)
    assert m1["mismatch_chi2_token"].item() == pytest.approx(torch.exp(-2 * s).mean().item() - 1, abs=1e-6)
    assert m1["mismatch_log_ppl_abs_diff"].item() == pytest.approx(abs(s.mean().item()), abs=1e-6)
    assert "mismatch_kl" not in m0


def test_mismatch_metrics_with_the_mis_helper_keep_the_loss():
    # a band that would reject and truncate tokens if the weights were applied
    batch, logits, _ = _sample([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [-math.log(3), 0.0, math.log(2)])
    plain = policy_loss_function(make_args(), batch, logits, _reducer(batch))[0]
    args = make_args("--get-mismatch-metrics", "--custom-tis-function-path", MIS)
    loss, m = policy_loss_function(args, batch, logits, _reducer(batch))
    assert loss.item() == plain.item() == pytest.approx(-1.0, abs=1e-6)
    # r = log [3, 1, 1/2]: mis_kl = -mean r
    assert m["mis_kl"].item() == pytest.approx(-math.log(1.5) / 3, abs=1e-6)
    assert "mis_tis_weight_before_bound" not in m  # use_tis off: no weights were computed


def _mis_args(tmp_path, **knobs):
    import yaml

    path = tmp_path / "mis.yaml"
    path.write_text(yaml.safe_dump(knobs))
    return make_args("--use-tis", "--custom-tis-function-path", MIS, "--custom-config-path", str(path))


def _two_samples():
    """log rho per token: sample 1 log[3, 1, 0.5]; sample 2 log[1e-5, 1, 1] with its last token masked out."""
    train = [torch.zeros(3), torch.zeros(3)]
    rollout = [-torch.log(torch.tensor([3.0, 1.0, 0.5])), -torch.log(torch.tensor([1e-5, 1.0, 1.0]))]
    masks = [torch.ones(3, dtype=torch.int), torch.tensor([1, 1, 0], dtype=torch.int)]
    return train, rollout, masks


def _mis(args, train, rollout, masks):
    from examples.train_infer_mismatch_helper.mis import compute_mis_weights_with_cp

    return compute_mis_weights_with_cp(
        args,
        pg_loss=torch.ones(sum(len(m) for m in masks)),
        train_log_probs=train,
        rollout_log_probs=rollout,
        loss_masks=masks,
        total_lengths=[5, 5],
        response_lengths=[len(m) for m in masks],
    )


def test_mis_token_truncate_with_rejection_veto_and_batch_normalisation(tmp_path):
    args = _mis_args(tmp_path, use_rs=True, tis_upper_bound=2.0, rs_veto_threshold=1.0e-4, tis_batch_normalize=True)
    pg, masks, metrics = _mis(args, *_two_samples())
    # truncate at 2: weights [2, 1, 0.5] and [1e-5, 1, 0 (masked)]; RS band [1/2, 2] rejects rho 3 and 1e-5, and
    # the veto (1e-5 < 1e-4) drops sample 2 whole; the weights of the 5 loss-masked tokens, rejected ones included
    # (as current slime normalises), have mean (2 + 1 + 0.5 + 1e-5 + 1) / 5 = 0.9
    assert masks[0].tolist() == [0, 1, 1] and masks[1].tolist() == [0, 0, 0]
    expected = torch.tensor([2.0, 1.0, 0.5, 1e-5, 1.0, 0.0]) / 0.900002
    assert torch.allclose(pg, expected, rtol=1e-5)
    assert metrics["mis_tis_truncate_fraction"].tolist() == [1, 0, 0, 0, 0, 0]
    assert metrics["mis_rs_catastrophic_seq_fraction"].tolist() == [0, 0, 0, 1, 1, 1]
    assert torch.allclose(metrics["mis_batch_norm_factor"], torch.full((6,), 0.900002))


@pytest.mark.parametrize(
    "level,expected",
    [("sequence", 1.2), ("geometric", 1.5 ** (1 / 3))],  # product 1.5 clipped to 1.2; geometric mean 1.145 inside
)
def test_mis_sequence_and_geometric_levels_clip_mode(tmp_path, level, expected):
    args = _mis_args(tmp_path, tis_level=level, tis_mode="clip", tis_lower_bound=0.5, tis_upper_bound=1.2)
    train, rollout, masks = _two_samples()
    pg, out_masks, _ = _mis(args, train[:1], rollout[:1], masks[:1])
    assert torch.allclose(pg, torch.full((3,), expected), rtol=1e-5)
    assert out_masks[0].tolist() == [1, 1, 1]


def test_mis_mask_mode_drops_tokens_from_the_loss_numerator_only(tmp_path):
    # one sample through the policy loss: on-policy ratio 1, A = 1, so the per-token loss is -weight
    batch, logits, _ = _sample([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [-math.log(3), 0.0, math.log(2)])
    args = _mis_args(tmp_path, tis_mode="mask", tis_lower_bound=0.6, tis_upper_bound=2.0)
    _, m = policy_loss_function(args, batch, logits, _reducer(batch))
    # rho [3, 1, 0.5]: only the middle token lies in [0.6, 2]; the denominator stays 3
    assert m["pg_loss"].item() == pytest.approx(-1 / 3, abs=1e-6)
    assert m["mis_tis_mask_fraction_high"].item() == pytest.approx(1 / 3)
    assert m["mis_tis_mask_fraction_low"].item() == pytest.approx(1 / 3)


def test_mis_mask_mode_batch_normalises_over_the_rejected_tokens_too(tmp_path):
    args = _mis_args(tmp_path, tis_mode="mask", tis_lower_bound=0.6, tis_upper_bound=2.0, tis_batch_normalize=True)
    train, rollout, masks = _two_samples()
    pg, out_masks, _ = _mis(args, train[:1], rollout[:1], masks[:1])
    # rho [3, 1, 0.5]: the band [0.6, 2] keeps the middle token; as current slime, the batch mean counts every
    # loss-masked token's weight, rejected ones included: (3 + 1 + 0.5) / 3 = 1.5
    assert out_masks[0].tolist() == [0, 1, 0]
    assert pg[1].item() == pytest.approx(1 / 1.5, rel=1e-6)


def test_mis_rejects_an_unknown_level(tmp_path):
    args = _mis_args(tmp_path, tis_level="tokens")
    with pytest.raises(ValueError, match="tis_level is 'tokens'"):
        _mis(args, *_two_samples())


# ---------------------------------------------------------------- reproducible runs
def test_deterministic_mode_seeds_each_sample_of_a_group_from_the_rollout_seed():
    from slime.rollout.sglang_rollout import seeded

    base = {"temperature": 1.0}
    args = make_args("--deterministic-mode", "--rollout-seed", "7")
    assert [seeded(args, base, j)["sampling_seed"] for j in range(3)] == [7, 8, 9]
    assert "sampling_seed" not in base  # a copy
    assert "sampling_seed" not in seeded(make_args(), base, 0)
    assert seeded(make_args("--sglang-enable-deterministic-inference"), base, 2)["sampling_seed"] == 44


def test_deterministic_mode_turns_on_the_engines_deterministic_inference():
    from slime.backends.sglang_utils.server_launch import server_command

    assert make_args().sglang_enable_deterministic_inference is False
    for server in ("cpu", "sglang"):
        args = make_args("--deterministic-mode", inference_server=server)
        assert args.sglang_enable_deterministic_inference is True
        _, cmd = server_command(args, 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")
        assert "--enable-deterministic-inference" in cmd, cmd
        _, cmd = server_command(make_args(inference_server=server), 0, "127.0.0.1", 30000, 30001, "127.0.0.1:30002")
        assert "--enable-deterministic-inference" not in cmd
