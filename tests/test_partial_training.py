"""--only-train-params-name-list / --freeze-params-name-list on the real Megatron trainer (CPU/gloo, tiny kit):
exactly the selected parameters change in a training step, weight sync still names every parameter."""

import pytest
import torch

from tests._args import make_args
from tests._megatron_helpers import fixed_rollout, spawn, train_args
from tests.test_megatron_model import _setup


def _changed_after_one_step(rank, model_dir, flags, out_path):
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns
    from slime.backends.megatron_utils.model import forward_only, train
    from slime.backends.megatron_utils.param_utils import named_parameters

    args = train_args(model_dir, **flags)
    model, opt, sched, _, rollout, iters, nmb = _setup(args, fixed_rollout())
    before = {n: p.detach().clone() for n, p in model[0].module.named_parameters()}
    data = dict(rollout)
    data.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    data.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, data)
    for it in iters:
        it.rollout_data = data
    train(args, 0, model, opt, sched, iters, nmb)
    changed = {n: not torch.equal(p.detach(), before[n]) for n, p in model[0].module.named_parameters()}
    synced = [n for n, _ in named_parameters(args, model)]  # what a weight update sends
    torch.save({"changed": changed, "synced": synced}, out_path)


def _run(tiny_kit, tmp_path, flags):
    out = tmp_path / "out.pt"
    spawn(_changed_after_one_step, 1, tiny_kit[0], flags, str(out))
    return torch.load(out)


def test_only_train_and_freeze_lists(tiny_kit, tmp_path):
    got = _run(tiny_kit, tmp_path, {"only_train_params_name_list": ["final_layernorm", r"layers\.1\.mlp"]})
    changed = got["changed"]
    trained = [n for n, c in changed.items() if c]
    assert trained and all("final_layernorm" in n or "layers.1.mlp" in n for n in trained), trained
    assert len(got["synced"]) == len(changed)  # weight sync still sends every weight, frozen ones included

    got = _run(tiny_kit, tmp_path, {"freeze_params_name_list": ["embedding"]})
    changed = got["changed"]
    assert not any(c for n, c in changed.items() if "embedding" in n)
    assert all(c for n, c in changed.items() if "embedding" not in n and "layers" in n and "weight" in n)


def test_a_pattern_matching_no_parameter_is_named(tiny_kit, tmp_path):
    with pytest.raises(Exception, match=r"--freeze-params-name-list: \['no_such_param'\] match no parameter"):
        _run(tiny_kit, tmp_path, {"freeze_params_name_list": ["embedding", "no_such_param"]})


def test_partial_training_flags_at_start_up(capsys):
    with pytest.raises(SystemExit):
        make_args("--only-train-params-name-list", "a", "--freeze-params-name-list", "b")
    assert "exclude each other" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_args("--freeze-params-name-list", "layers.(")
    assert "--freeze-params-name-list 'layers.(': not a regular expression" in capsys.readouterr().err
