"""PPO's critic as a real trainer (`MegatronTrainRayActor` with role "critic", no Ray) in spawned gloo ranks with the
tiny Qwen3 kit: several critic optimizer steps per rollout (the critic role's `num_steps_per_rollout`), and its
values and value-loss steps under the critic role's TP=2, PP=2 and CP=2 (the actor's at 1) equal to TP=PP=CP=1.

Each layout runs the same program: init the critic from the HF checkpoint (a new value head), then two rollouts of
the fixed batch, each computing the values (before the update) and training on the clipped value loss."""

import numpy as np
import pytest
import torch

from slime.ray.critic import critic_args
from tests._megatron_helpers import fixed_rollout, spawn, train_args
from tests.test_critic import _hand_returns

PPO = dict(advantage_estimator="ppo", use_critic=True, gamma=0.99, lambd=0.95, use_kl_loss=False)
NUM_ROLLOUTS = 2
_COMPARED = ("train/critic-value_loss", "train/critic-value_clipfrac", "train/critic-grad_norm")


class _Ref:
    """What `process_rollout_data` receives from Ray: a Box whose `.inner` is passed to `ray.get`."""

    def __init__(self, data):
        self.inner = data


def _adam_steps(actor):
    from slime.backends.megatron_utils.model import _inner_optimizers

    actor.wake_up(("model",))  # asleep between train steps: its optimizer state is in CPU backups
    steps = {int(s["step"]) for o in _inner_optimizers(actor.optimizer) for s in o.state.values()}
    actor.sleep(("model",))
    return steps


def _run_critic(rank, world_size, model_dir, critic_overrides, out_dir):
    import ray
    from megatron.core import parallel_state as mpu

    import slime.ray.train_actor as train_actor
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    ray.get = lambda x: x  # the test hands the dict itself instead of an ObjectRef
    # `spawn` already joined the gloo group (and its store holds the rendezvous port)
    train_actor.tcp_store = train_actor.dist.init_process_group = lambda *a, **k: None
    # the actor's arguments (TP = PP = CP = 1) with the critic role's overrides: the critic's own layout
    args = critic_args(
        train_args(model_dir, actor_num_gpus_per_node=world_size, critic_overrides=critic_overrides, **PPO)
    )
    critic = object.__new__(MegatronTrainRayActor)  # a Ray actor's body without Ray
    assert critic.init(args, "critic") == 0
    data = fixed_rollout()
    result = {"values": [], "history": [], "adam_steps": [], "rollout": []}
    result["sizes"] = (
        mpu.get_tensor_model_parallel_world_size(),
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_context_parallel_world_size(),
    )
    for rollout_id in range(NUM_ROLLOUTS):
        out = critic.train(rollout_id, _Ref(data))
        result["values"].append(out["values"])
        result["history"].append(out.get("train"))
        result["rollout"].append(out.get("rollout"))
        result["adam_steps"].append(_adam_steps(critic))
    torch.save(result, f"{out_dir}/rank{rank}.pt")


def _launch(tmp_path_factory, model_dir, name, world_size, critic_overrides=None):
    out_dir = tmp_path_factory.mktemp(name)
    spawn(_run_critic, world_size, world_size, model_dir, critic_overrides or {}, str(out_dir), timeout=300)
    ranks = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    # the values of every sample, from the ranks that return them (TP 0, CP 0 of the last stage); one report
    values = []
    for k in range(NUM_ROLLOUTS):
        merged = {}
        for r in ranks:
            merged.update(r["values"][k])
        values.append([merged[i] for i in range(len(merged))])
    (main,) = [r for r in ranks if r["history"][0] is not None]
    sizes = {r["sizes"] for r in ranks}
    assert len(sizes) == 1
    return {
        "values": values,
        "history": main["history"],
        "rollout": main["rollout"],
        "ranks": ranks,
        "sizes": sizes.pop(),
    }


@pytest.fixture(scope="module")
def ref(tiny_kit, tmp_path_factory):
    return _launch(tmp_path_factory, tiny_kit[0], "critic_ref", 1)


def test_critic_takes_the_critic_roles_steps_per_rollout(ref, tiny_kit, tmp_path_factory):
    """The critic role's num_steps_per_rollout 2 (global batch 2 of the rollout's 4 samples): two critic optimizer
    steps per rollout, where the actor's arguments (global batch 4) take one."""
    actor = train_args(tiny_kit[0], **PPO)
    overrides = dict(global_batch_size=2, num_steps_per_rollout=2)  # what parse_args derives from the role
    critic = critic_args(train_args(tiny_kit[0], critic_overrides=overrides, **PPO))
    assert (actor.global_batch_size, critic.global_batch_size, critic.num_steps_per_rollout) == (4, 2, 2)
    run = _launch(tmp_path_factory, tiny_kit[0], "critic_k2", 1, critic_overrides=overrides)
    assert [len(h) for h in run["history"]] == [2, 2] and [len(h) for h in ref["history"]] == [1, 1]
    assert [[s["train/step"] for s in h] for h in run["history"]] == [[0, 1], [2, 3]]
    assert run["ranks"][0]["adam_steps"] == [{2}, {4}] and ref["ranks"][0]["adam_steps"] == [{1}, {2}]
    # the same new value head and body: the same values before any update
    values = run["values"][0]
    for got, exp in zip(values, ref["values"][0]):
        np.testing.assert_array_equal(got, exp)
    # step 0 runs on samples 0 and 1 with the values from before the update (nothing clipped): the per-sample mean
    # of (V - R)^2 over those two; step 1 on samples 2 and 3
    _, returns = _hand_returns(fixed_rollout(), values, 0.99, 0.95)
    per_sample = [((torch.tensor(v) - r) ** 2).mean().item() for v, r in zip(values, returns)]
    first = run["history"][0][0]
    assert first["train/critic-value_loss"] == pytest.approx(np.mean(per_sample[:2]), rel=1e-5)
    assert first["train/critic-value_clipfrac"] == 0.0
    assert ref["history"][0][0]["train/critic-value_loss"] == pytest.approx(np.mean(per_sample), rel=1e-5)
    # the second rollout's values come from a critic updated twice: not those of the critic updated once
    assert not np.allclose(run["values"][1][0], ref["values"][1][0], atol=1e-6)


def _max_diff(a, b):
    return max(np.abs(x - y).max() for x, y in zip(a, b))


def _assert_matches(run, ref, after_tol):
    """Values before any update within 1e-5 (fp32 reductions in another order), each step's value-loss metrics
    within 1e-5 relative; the values after the first update within `after_tol` (Adam's first step is about lr * sign
    of the gradient, so weights whose gradients are near zero amplify rounding)."""
    print(
        "critic parity: values",
        _max_diff(run["values"][0], ref["values"][0]),
        "after one update",
        _max_diff(run["values"][1], ref["values"][1]),
    )
    assert [v.shape for v in run["values"][0]] == [v.shape for v in ref["values"][0]]
    assert _max_diff(run["values"][0], ref["values"][0]) <= 1e-5
    assert _max_diff(ref["values"][1], ref["values"][0]) > 100 * after_tol  # the update moved the values
    for got_h, exp_h in zip(run["history"], ref["history"]):
        assert len(got_h) == len(exp_h)
        for got, exp in zip(got_h, exp_h):
            for key in _COMPARED:
                assert got[key] == pytest.approx(exp[key], rel=1e-5, abs=1e-7), (key, got[key], exp[key])
    assert _max_diff(run["values"][1], ref["values"][1]) <= after_tol
    for got, exp in zip(run["rollout"], ref["rollout"]):
        assert got == pytest.approx(exp, rel=1e-5)


@pytest.mark.parametrize(
    "layout",
    [
        dict(tensor_model_parallel_size=2),
        dict(pipeline_model_parallel_size=2),
        dict(context_parallel_size=2),
    ],
    ids=["tp2", "pp2", "cp2"],
)
@pytest.mark.slow  # development tier: a multi-rank layout or several processes (tens of seconds)
def test_critic_parallel_layout_matches_a_single_rank(ref, tiny_kit, tmp_path_factory, layout):
    run = _launch(tmp_path_factory, tiny_kit[0], "critic_" + "_".join(layout), 2, critic_overrides=layout)
    assert run["sizes"] == tuple(
        layout.get(k, 1)
        for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
    )
    _assert_matches(run, ref, after_tol=1e-5)
