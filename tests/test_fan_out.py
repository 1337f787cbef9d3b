"""Fan-out rollouts: a generate function that returns several samples of one rollout (siblings sharing
`Sample.rollout_id`, as current slime's multi-agent example does). The controller normalises rewards over each
prompt's samples; the trainer keeps a rollout's samples on one DP rank and in one optimizer step, and averages its
loss over all of the rollout's tokens, so a rollout counts once however many samples it split into."""

import copy

import numpy as np
import pytest
import torch

import train as sync_driver
from slime.rollout.train_data import convert_samples_to_train_data
from slime.utils.types import Sample
from tests._args import make_args
from tests._megatron_helpers import fixed_rollout, spawn, train_args
from tests.test_e2e import make_args as e2e_args
from tests.test_e2e import read_metrics


def _sample(index, group, rollout, reward):
    return Sample(
        index=index,
        group_index=group,
        rollout_id=rollout,
        tokens=[1, 2, 3, 4],
        response_length=2,
        reward=reward,
        status=Sample.Status.COMPLETED,
    )


def test_fan_out_rewards_are_normalised_over_each_prompts_samples():
    """GRPO over fan-out: prompt 0 has rewards (1, 0, 0) over 3 samples of 2 rollouts, prompt 1 (1, 1): by hand,
    mean 1/3 and sample std sqrt(1/3) give (2/3, -1/3, -1/3) / 0.57735; a constant group centres to 0."""
    samples = [_sample(0, 0, 0, 1.0), _sample(1, 0, 0, 0.0), _sample(2, 0, 2, 0.0)]
    samples += [_sample(3, 1, 3, 1.0), _sample(4, 1, None, 1.0)]
    data = convert_samples_to_train_data(make_args(n_samples_per_prompt=2), samples)
    assert data["rewards"] == pytest.approx([1.1547, -0.57735, -0.57735, 0.0, 0.0], abs=1e-4)
    assert data["raw_reward"] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert data["rollout_ids"] == [0, 0, 2, 3, -5]  # an unset id is a rollout of its own
    # without shared rollout ids nothing changes: consecutive groups of --n-samples-per-prompt, no rollout ids
    plain = convert_samples_to_train_data(
        make_args(n_samples_per_prompt=2), [_sample(i, 0, i, i % 2) for i in range(4)]
    )
    assert "rollout_ids" not in plain and plain["rewards"] == pytest.approx([-0.7071, 0.7071] * 2, abs=1e-4)


def test_fan_out_samples_without_a_prompt_group_are_named():
    samples = [_sample(0, 0, 0, 1.0), _sample(1, None, 0, 0.0)]
    with pytest.raises(ValueError, match=r"sample 1 \(position 1\) from rollout function 'gen'.*no group_index"):
        convert_samples_to_train_data(make_args(n_samples_per_prompt=2), samples, fn_path="gen")


class _Ref:
    def __init__(self, data):
        self.inner = data


# Rollout 1 of fixed_rollout split into 3 identical samples, rollout 2 into 2: the mean over a rollout's tokens is
# the single sample's, so the step must be the one on the plain rollout.
_COPIES = [1, 3, 2, 1]


def _fanned_out(data):
    out = {k: [] for k in data}
    out["rollout_ids"] = []
    for i, copies in enumerate(_COPIES):
        for _ in range(copies):
            for k in data:
                out[k].append(copy.deepcopy(data[k][i]))
            out["rollout_ids"].append(i)
    return out


def _one_step(rank, model_dir, fan_out, dynamic, out_path):
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.advantages import compute_advantages_and_returns
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import forward_only, initialize_model_and_optimizer, train
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    extra = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=24) if dynamic else {}
    args = train_args(model_dir, optimizer="sgd", lr=0.5, clip_grad=0.0, **extra)
    init(args)
    model, opt, sched, _ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    data = _fanned_out(fixed_rollout()) if fan_out else fixed_rollout()
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    rollout = process_rollout_data(args, _Ref(data), dp_rank, dp_size)
    # strided over rollouts: a rollout's samples stay together on one rank
    assert rollout["rollout_sizes"] == [_COPIES[k] if fan_out else 1 for k in range(dp_rank, 4, dp_size)]
    iters, nmb = get_data_iterator(args, model, rollout)
    rollout.update(forward_only(args, model, iters, nmb, store_prefix="ref_"))
    rollout.update(forward_only(args, model, iters, nmb))
    compute_advantages_and_returns(args, rollout)
    before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
    history = train(args, 0, model, opt, sched, iters, nmb)
    if rank == 0:
        params = {n: p.detach().clone() for n, p in model[0].named_parameters()}
        moved = max((params[n] - before[n]).abs().max().item() for n in params)
        torch.save({"history": history, "params": params, "nmb": nmb, "moved": moved}, out_path)


@pytest.mark.slow
def test_a_fanned_out_rollout_trains_as_the_rollout_itself(tiny_kit, tmp_path):
    """One SGD step on fixed_rollout equals one step on the same rollout with two of its samples split into
    identical siblings (3 and 2), on one rank with fixed micro-batches and on two DP ranks with dynamic ones."""
    model_dir = tiny_kit[0]
    runs = {
        "plain": (1, False, False),
        "fan_out": (1, True, False),
        "fan_out_dp2_dynamic": (2, True, True),
    }
    for name, (world, fan_out, dynamic) in runs.items():
        spawn(_one_step, world, model_dir, fan_out, dynamic, str(tmp_path / f"{name}.pt"))
    got = {name: torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in runs}
    plain = got["plain"]
    assert got["fan_out"]["nmb"] == [4]  # 7 samples in micro-batches of 2
    assert plain["moved"] > 1e-3  # the step did something
    for name in ("fan_out", "fan_out_dp2_dynamic"):
        h, h0 = got[name]["history"][0], plain["history"][0]
        assert h["train/pg_loss"] == pytest.approx(h0["train/pg_loss"], abs=1e-6), name
        assert h["train/grad_norm"] == pytest.approx(h0["train/grad_norm"], rel=1e-5), name
        for key, p in got[name]["params"].items():
            assert torch.allclose(p, plain["params"][key], atol=1e-6), (name, key)


def _uneven(rank, model_dir):
    import ray
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.initialize import init
    from slime.backends.megatron_utils.model import initialize_model_and_optimizer
    from slime.backends.megatron_utils.rollout_data import process_rollout_data

    args = train_args(model_dir, micro_batch_size=1, global_batch_size=4)
    init(args)
    model, *_ = initialize_model_and_optimizer(args)
    ray.get = lambda x: x
    data = fixed_rollout()
    data["rollout_ids"] = [0, 1, 2, 3]
    data = {k: v + [v[0]] for k, v in data.items()}  # rollout 0 (DP rank 0) gains a sibling
    data["rollout_ids"][-1] = 0
    rollout = process_rollout_data(args, _Ref(data), mpu.get_data_parallel_rank(), 2)
    with pytest.raises(
        ValueError, match=r"different micro-batch counts per step on the DP ranks \(\[\[3\], \[2\]\]\)"
    ):
        get_data_iterator(args, model, rollout)
    # a rollout function that returned 2 of --rollout-batch-size's 4 groups
    short = {k: v[:2] for k, v in fixed_rollout().items()}
    with pytest.raises(ValueError, match=r"the rollout holds 2 rollouts \(2 samples\) but the trainer takes"):
        process_rollout_data(args, _Ref(short), mpu.get_data_parallel_rank(), 2)


@pytest.mark.slow
def test_uneven_fan_out_with_fixed_micro_batches_is_refused_on_every_rank(tiny_kit):
    spawn(_uneven, 2, tiny_kit[0])


@pytest.mark.e2e
@pytest.mark.slow
def test_train_py_runs_a_fan_out_generate_function(ray_session, tiny_kit, tmp_path):
    """train.py with a custom generate that returns 1-3 siblings per call: every rollout trains (its loss is logged)
    and the rollout's samples are all there."""
    args = e2e_args(
        tiny_kit,
        tmp_path,
        *["--rollout-num-gpus", "1", "--custom-generate-function-path", "tests._fan_out_generate.generate"],
        *["--save-debug-rollout-data", str(tmp_path / "rollout_{rollout_id}.pt")],
    )
    sync_driver.train(args)
    metrics = read_metrics(tmp_path)
    assert [m["rollout_id"] for m in metrics if "train/pg_loss" in m] == [0, 1]
    for rollout_id in range(2):
        samples = torch.load(tmp_path / f"rollout_{rollout_id}.pt", weights_only=False)["samples"]
        per_rollout = {}
        for s in samples:
            per_rollout.setdefault(s["rollout_id"], []).append(s["index"])
        assert len(per_rollout) == 16
        assert sorted(len(v) for v in per_rollout.values()) == sorted(1 + i % 3 for i in per_rollout)
        assert np.all([len(set(v)) == 1 for v in per_rollout.values()])
