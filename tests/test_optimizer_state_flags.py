"""--reset-optimizer-states and --use-stateless-adam on the real Megatron trainer (CPU/gloo, tiny kit).

By hand: Adam's first step from zero moments (bias-corrected) moves every weight by lr * g / (|g| + eps), i.e. by lr
wherever |g| >> eps. With fresh moments at every rollout (reset) or at every step (stateless), the second rollout's
single step must move each weight by exactly lr again; plain Adam carries its moments and does not."""

import pytest
import torch

from tests._megatron_helpers import fixed_rollout, spawn, train_args
from tests.test_megatron_model import _setup

LR = 1e-3


def _second_rollout_step_sizes(rank, model_dir, flags, out_path):
    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train

    args = train_args(model_dir, lr=LR, **flags)
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    params = [p for p in model[0].parameters() if p.requires_grad]

    def one_rollout(rollout_id):
        data = dict(rollout)
        data.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
        data.update(forward_only(args, model, iters, nmb))
        compute_advantages_and_returns(args, data)
        for it in iters:
            it.rollout_data = data
        train(args, rollout_id, model, opt, sched, iters, nmb)

    one_rollout(0)
    before = [p.detach().clone() for p in params]
    one_rollout(1)
    ratios = []
    for p, b in zip(params, before):
        g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
        big = g.abs() > 1e-4  # |g| >> eps = 1e-8
        ratios.append(((p.detach() - b).abs()[big] / LR).flatten())
    states = sum(len(o.optimizer.state) for o in getattr(opt, "chained_optimizers", [opt]))
    torch.save({"ratios": torch.cat(ratios), "states": states}, out_path)


@pytest.mark.parametrize(
    "flags, fresh, kept_states",
    [
        ({}, False, True),
        ({"reset_optimizer_states": True}, True, True),
        ({"use_stateless_adam": True, "no_save_optim": True}, True, False),
    ],
)
def test_adam_moments_are_fresh_each_rollout(tiny_kit, tmp_path, flags, fresh, kept_states):
    out = tmp_path / "out.pt"
    spawn(_second_rollout_step_sizes, 1, tiny_kit[0], flags, str(out))
    got = torch.load(out)
    ratios = got["ratios"]
    assert ratios.numel() > 1000
    if fresh:
        assert (ratios - 1).abs().max().item() < 5e-3  # fp32 rounding of weight - weight_before
    else:  # plain Adam: the carried moments make most steps differ from lr
        assert (ratios - 1).abs().gt(0.05).float().mean().item() > 0.5
    assert (got["states"] > 0) == kept_states  # stateless Adam keeps no moments between steps


def test_stateless_adam_needs_adam_and_no_save_optim(capsys):
    from tests._args import make_args

    for argv, msg in (
        (["--use-stateless-adam"], "add --no-save-optim"),
        (["--use-stateless-adam", "--no-save-optim", "--optimizer", "sgd"], "drop --optimizer sgd"),
    ):
        with pytest.raises(SystemExit):
            make_args(*argv)
        assert msg in capsys.readouterr().err
