"""PPO with a critic (--advantage-estimator ppo): the clipped value loss on hand values, the critic's flags and their
start-up refusals, the critic's arguments (the critic role of --megatron-config-path, its checkpoint paths)."""

import pytest
import torch

from slime.config.critic import _check_critic_model_split
from slime.ray.critic import critic_args
from slime.utils.ppo_utils import compute_value_loss, vanilla_gae
from tests._args import make_args
from tests.test_arguments import parse, parse_error

PPO = ["--advantage-estimator", "ppo"]


# ---------------------------------------------------------------- the value loss
def test_value_loss_hand_case():
    old = torch.tensor([0.0, 0.0, 1.0, 1.0])
    new = torch.tensor([0.1, 0.5, 0.5, 1.1])
    returns = torch.tensor([1.0, 1.0, 0.0, 1.0])
    losses, clipfrac = compute_value_loss(new, old, returns, value_clip=0.2)
    # token 0: inside the clip, (0.1 - 1)^2 = .81
    # token 1: moved 0.5 > 0.2; clipped value 0.2: max((.5-1)^2, (.2-1)^2) = max(.25, .64) = .64
    # token 2: moved -0.5; clipped 0.8: max((.5-0)^2, (.8-0)^2) = .64 (the clip keeps the larger error)
    # token 3: moved 0.1, inside: (1.1 - 1)^2 = .01
    assert torch.allclose(losses, torch.tensor([0.81, 0.64, 0.64, 0.01]))
    assert clipfrac.tolist() == [0.0, 1.0, 1.0, 0.0]


def test_value_loss_clip_does_not_hide_an_improvement():
    # a move of 0.5 towards the return: the clipped value (0.2 from the old one) has the larger error, so the loss is
    # the clipped branch's, which is constant in the new value: no gradient pushes the value further this step
    old, returns = torch.tensor([0.0]), torch.tensor([1.0])
    new = torch.tensor([0.5], requires_grad=True)
    losses, _ = compute_value_loss(new, old, returns, value_clip=0.2)
    losses.sum().backward()
    assert losses.item() == pytest.approx(0.64) and new.grad.item() == 0.0
    new = torch.tensor([0.1], requires_grad=True)  # inside the clip: d/dV (V - R)^2 = 2 (V - R)
    compute_value_loss(new, old, returns, value_clip=0.2)[0].sum().backward()
    assert new.grad.item() == pytest.approx(2 * (0.1 - 1.0))


# ---------------------------------------------------------------- flags
def test_critic_flags_defaults_and_use_critic():
    a = parse()
    assert (a.gamma, a.lambd, a.value_clip, a.num_critic_only_steps) == (1.0, 1.0, 0.2, 0)
    assert a.use_critic is False
    a = parse(*PPO, "--lambd", "0.95", "--gamma", "0.99", "--num-critic-only-steps", "2", "--value-clip", "0.5")
    assert a.use_critic and (a.gamma, a.lambd, a.value_clip, a.num_critic_only_steps) == (0.99, 0.95, 0.5, 2)
    assert (a.critic_num_nodes, a.critic_num_gpus_per_node) == (a.actor_num_nodes, a.actor_num_gpus_per_node)


def test_critic_flag_refusals(capsys):
    assert "--value-clip 0.0: the value clip must be > 0" in parse_error(capsys, *PPO, "--value-clip", "0")
    assert "--value-clip -1.0" in parse_error(capsys, *PPO, "--value-clip", "-1")
    assert "--lambd 1.5" in parse_error(capsys, *PPO, "--lambd", "1.5")
    assert "--num-critic-only-steps -1" in parse_error(capsys, *PPO, "--num-critic-only-steps", "-1")
    parse("--value-clip", "0")  # no critic: the flag is unused


def test_critic_role_parallel_sizes_must_divide_its_gpus(capsys, tmp_path):
    path = tmp_path / "roles.yaml"
    path.write_text("megatron:\n  - role: critic\n    overrides: {tensor_model_parallel_size: 3, lr: '1e-5'}\n")
    err = parse_error(capsys, *PPO, "--megatron-config-path", str(path), "--actor-num-gpus-per-node", "4")
    assert f"--megatron-config-path {path}: the critic's tensor_model_parallel_size=3" in err
    assert "does not divide its 4 GPUs" in err
    path.write_text("megatron:\n  - role: critic\n    overrides: {tensor_model_parallel_size: 2, lr: '1e-5'}\n")
    a = parse(*PPO, "--megatron-config-path", str(path), "--actor-num-gpus-per-node", "4")
    assert a.critic_overrides == {"tensor_model_parallel_size": 2, "lr": 1e-5} and a.tensor_model_parallel_size == 1


def _critic_role(tmp_path, overrides):
    path = tmp_path / "roles.yaml"
    path.write_text(f"megatron:\n  - role: critic\n    overrides: {overrides}\n")
    return ["--megatron-config-path", str(path)]


def test_critic_role_takes_several_steps_per_rollout(tmp_path):
    # BASE: 4 prompts x 2 samples = 8 samples per rollout, --global-batch-size 8: the actor takes 1 step
    a = parse(*PPO, *_critic_role(tmp_path, "{num_steps_per_rollout: 4}"))
    assert (a.global_batch_size, a.num_steps_per_rollout) == (8, None)
    c = critic_args(a)
    assert (c.global_batch_size, c.num_steps_per_rollout) == (8 // 4, 4)
    c = critic_args(parse(*PPO, *_critic_role(tmp_path, "{global_batch_size: 4}")))
    assert (c.global_batch_size, c.num_steps_per_rollout) == (4, 2)
    c = critic_args(parse(*PPO, *_critic_role(tmp_path, "{global_batch_size: 2, num_steps_per_rollout: 4}")))
    assert (c.global_batch_size, c.num_steps_per_rollout) == (2, 4)
    # no batch key in the role: the critic takes the actor's steps
    c = critic_args(parse(*PPO, "--global-batch-size", "4", *_critic_role(tmp_path, "{lr: 1e-5}")))
    assert (c.global_batch_size, c.num_steps_per_rollout, c.lr) == (4, None, 1e-5)


def test_critic_role_batch_refusals(capsys, tmp_path):
    err = parse_error(capsys, *PPO, *_critic_role(tmp_path, "{num_steps_per_rollout: 3}"))
    assert "the critic's num_steps_per_rollout 3 does not divide the rollout's" in err and "= 8 samples" in err
    err = parse_error(capsys, *PPO, *_critic_role(tmp_path, "{global_batch_size: 3}"))
    assert "the critic's global_batch_size 3 does not divide the rollout's" in err
    err = parse_error(capsys, *PPO, *_critic_role(tmp_path, "{global_batch_size: 4, num_steps_per_rollout: 4}"))
    assert "the critic's global_batch_size 4 contradicts its num_steps_per_rollout 4 (8 samples)" in err
    err = parse_error(capsys, *PPO, *_critic_role(tmp_path, "{num_steps_per_rollout: 0}"))
    assert "the critic's num_steps_per_rollout 0 must be a positive integer" in err
    # 8 GPUs, critic TP 1: data-parallel 8; a critic batch of 4 samples cannot give each of its 8 ranks a sample
    roles = _critic_role(tmp_path, "{num_steps_per_rollout: 2}")
    err = parse_error(capsys, *PPO, *roles, "--actor-num-gpus-per-node", "8")
    assert (
        "the critic's global_batch_size 4 is not divisible by its micro_batch_size 1 x its data-parallel size 8" in err
    )


def test_critic_role_parallel_sizes_must_split_the_model(capsys, tmp_path):
    # TINY_MODEL: 2 layers, 4 heads; 8 GPUs so that every size divides the critic's GPUs
    gpus = ["--actor-num-gpus-per-node", "8"]
    err = parse_error(capsys, *PPO, *gpus, *_critic_role(tmp_path, "{tensor_model_parallel_size: 8}"))
    assert "the critic's tensor_model_parallel_size 8 does not divide --num-attention-heads 4" in err
    err = parse_error(capsys, *PPO, *gpus, *_critic_role(tmp_path, "{pipeline_model_parallel_size: 4}"))
    assert "the critic's pipeline_model_parallel_size 4 does not divide --num-layers 2" in err
    # the actor's sequence parallelism (TP 2; kept on GPU, where parse_args leaves it on) cannot reach a critic at TP 1
    a = parse(
        *PPO, *gpus, "--tensor-model-parallel-size", "2", *_critic_role(tmp_path, "{tensor_model_parallel_size: 1}")
    )
    a.sequence_parallel = True
    _check_critic_model_split(a, None, {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1})
    assert critic_args(a).sequence_parallel is False and a.sequence_parallel


def test_resume_without_the_critics_checkpoint_is_refused(capsys, tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000003").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("3")
    err = parse_error(capsys, *PPO, "--load", str(ckpt))
    assert f"--load {ckpt}: resuming rollout 3" in err and f"{ckpt}/critic/iter_0000003 is missing" in err
    (ckpt / "critic" / "iter_0000003").mkdir(parents=True)
    assert parse(*PPO, "--load", str(ckpt)).load == str(ckpt)


# ---------------------------------------------------------------- the critic's arguments
def test_critic_args_apply_the_critic_role_and_own_checkpoints(tmp_path):
    path = tmp_path / "roles.yaml"
    path.write_text(
        "megatron:\n  - role: actor\n    overrides: {lr: '1e-6'}\n"
        "  - role: critic\n    overrides: {lr: '1e-5', clip_grad: 0.5}\n"
    )
    args = make_args(
        *PPO,
        "--megatron-config-path",
        str(path),
        "--kl-coef",
        "0.1",
        "--save",
        str(tmp_path / "save"),
    )
    c = critic_args(args)
    assert (args.lr, c.lr, c.clip_grad, args.clip_grad) == (1e-6, 1e-5, 0.5, 1.0)
    assert (c.loss_type, c.kl_coef, args.kl_coef) == ("value_loss", 0.0, 0.1)
    assert c.untie_embeddings_and_output_weights and c.save == str(tmp_path / "save" / "critic")
    assert c.load == args.load  # a fresh run: the critic starts from the actor's initial weights
    resumed = make_args(*PPO, "--load", str(tmp_path / "save"), finetune=False, ckpt_step=None)
    (tmp_path / "save").mkdir(exist_ok=True)
    (tmp_path / "save" / "latest_checkpointed_iteration.txt").write_text("5")
    c = critic_args(resumed)
    assert (c.load, c.ckpt_step) == (str(tmp_path / "save" / "critic"), 5)


# ---------------------------------------------------------------- the critic as a real trainer (Ray, gloo, CPU)
def _hand_returns(data, values, gamma, lambd):
    """GAE returns and advantages of `data` (reward on the last token, no KL) from the critic's `values`."""
    rewards = [torch.zeros(len(v)) for v in values]
    for r, reward in zip(rewards, data["rewards"]):
        r[-1] = reward
    out = [vanilla_gae(r[None], torch.tensor(v)[None], gamma, lambd) for r, v in zip(rewards, values)]
    return [a[0] for a, _ in out], [ret[0] for _, ret in out]


@pytest.mark.slow
def test_critic_trains_hands_values_to_the_actor_and_resumes(ray_session, tiny_kit, tmp_path):
    import numpy as np

    from slime.utils.checkpoint_tracker import write_tracker
    from slime.utils.ray_utils import Box
    from tests._megatron_helpers import fixed_rollout, train_args
    from tests.test_megatron_actor import _kill, _make_actors

    ray = ray_session
    model_dir, _ = tiny_kit
    save, actor_ckpt = str(tmp_path / "ckpt"), str(tmp_path / "actor")
    ppo = dict(advantage_estimator="ppo", use_critic=True, gamma=0.99, lambd=0.95, use_kl_loss=False)
    args = train_args(model_dir, save=save, **ppo)
    actor_args = train_args(model_dir, save=actor_ckpt, **ppo)
    data = fixed_rollout()
    data_ref = Box(ray.put(data))
    n = len(data["tokens"])
    critic, actor = _make_actors(ray, 1) + _make_actors(ray, 1)
    try:
        assert ray.get(critic.init.remote(critic_args(args), "critic"), timeout=300) == 0
        r0 = ray.get(critic.train.remote(0, data_ref), timeout=300)
        assert sorted(r0["values"]) == list(range(n))
        values = [r0["values"][i] for i in range(n)]
        assert [len(v) for v in values] == data["response_lengths"]
        # the first step's values are the old values: no clipping, the loss is the per-sample mean (V - R)^2
        _, returns = _hand_returns(data, values, 0.99, 0.95)
        expect = np.mean([((torch.tensor(v) - r) ** 2).mean().item() for v, r in zip(values, returns)])
        step = r0["train"][0]
        assert step["train/critic-value_loss"] == pytest.approx(expect, rel=1e-4)
        assert step["train/critic-value_clipfrac"] == 0.0 and step["train/critic-grad_norm"] > 0
        assert step["train/critic-global_batch_size"] == n and "train/global_batch_size" not in step
        assert r0["rollout"]["rollout/critic_value_mean"] == pytest.approx(np.concatenate(values).mean(), rel=1e-4)
        assert "rollout/critic_explained_variance" in r0["rollout"]

        # the actor trains on the GAE advantages of those values
        assert ray.get(actor.init.remote(actor_args, "actor", None, with_ref=False), timeout=300) == 0
        values_ref = Box(ray.put({"values": values}))
        a0 = ray.get(actor.train.remote(0, data_ref, values_ref), timeout=300)
        advantages, _ = _hand_returns(data, values, 0.99, 0.95)
        expect_adv = np.mean([a.mean().item() for a in advantages])
        assert a0["rollout"]["rollout/advantages"] == pytest.approx(expect_adv, rel=1e-4)
        assert a0["train"][0]["train/pg_loss"] != 0.0

        ray.get(actor.save_model.remote(0), timeout=300)  # an actor checkpoint (vocabulary-sized output layer)
        ray.get(critic.save_model.remote(0, commit=False), timeout=300)
        write_tracker(save, 0)  # the driver's last act of a save (slime.ray.checkpoint)
        later = [ray.get(critic.train.remote(i, data_ref), timeout=300) for i in (1, 2)]
    finally:
        _kill(ray, [critic, actor])

    # a resumed critic has the saved weights and optimizer state: the same values at rollouts 1 and 2; a critic
    # started from the actor's Megatron checkpoint (as --ref-load) gets a new value head, the actor's body
    resumed, from_actor = _make_actors(ray, 1) + _make_actors(ray, 1)
    try:
        rargs = train_args(model_dir, load=save, save=save, **ppo)
        assert ray.get(resumed.init.remote(critic_args(rargs), "critic"), timeout=300) == 1
        again = [ray.get(resumed.train.remote(i, data_ref), timeout=300) for i in (1, 2)]
        fargs = critic_args(train_args(model_dir, ref_load=actor_ckpt, **ppo))
        assert (fargs.load, fargs.finetune) == (actor_ckpt, True)
        assert ray.get(from_actor.init.remote(fargs, "critic"), timeout=300) == 0
        fresh = ray.get(from_actor.train.remote(0, data_ref), timeout=300)
    finally:
        _kill(ray, [resumed, from_actor])
    assert [len(fresh["values"][i]) for i in range(n)] == data["response_lengths"]
    for before, after in zip(later, again):
        for i in range(n):
            np.testing.assert_allclose(after["values"][i], before["values"][i], rtol=0, atol=1e-6)
    assert not np.allclose(later[0]["values"][0], values[0])  # the critic did learn between rollouts


@pytest.mark.slow
@pytest.mark.e2e
def test_train_py_ppo_critic_only_warm_up_checkpoint_and_resume(ray_session, tiny_kit, tmp_path):
    """A critic under train_async.py's loop then train.py's: rollout 0 trains only the critic, then both; the
    critic's checkpoint is written with the actor's (by --async-save's writers in the first run) and a restart with
    --load continues with it. The critic role
    takes 4 optimizer steps per rollout (its num_steps_per_rollout) where the actor takes 2 (16 samples,
    --global-batch-size 8)."""
    import train as sync_driver
    import train_async as async_driver
    from tests.test_e2e import make_args as e2e_args
    from tests.test_e2e import read_metrics

    ckpt = tmp_path / "ckpt"
    ppo = [*PPO, "--num-critic-only-steps", "1", "--gamma", "0.99", "--lambd", "0.95", "--rollout-num-gpus", "1"]
    ppo += ["--save", str(ckpt), "--save-interval", "1", *_critic_role(tmp_path, "{num_steps_per_rollout: 4}")]
    first = tmp_path / "first"
    first.mkdir()
    # --async-save: the actor's and the critic's writes are both finished (at the run's end) before the tracker
    async_driver.train(e2e_args(tiny_kit, first, *ppo, "--async-save", num_rollout=2))
    rows = read_metrics(first)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert "train/critic-value_loss" in rows[0] and "train/pg_loss" not in rows[0]  # the critic-only warm-up
    assert "train/critic-value_loss" in rows[1] and "train/pg_loss" in rows[1]
    # the record keeps each rollout's last step: the critic's alone in the warm-up (its 4th step of rollout 0,
    # train/step 0 * 4 + 3), then the actor's (its 2nd step of rollout 1: 1 * 2 + 1; the critic's would be 7)
    assert (rows[0]["train/step"], rows[1]["train/step"]) == (3, 3)
    for key in ("train/critic-value_clipfrac", "rollout/critic_value_mean", "rollout/critic_explained_variance"):
        assert key in rows[1], key
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert (ckpt / "critic" / "iter_0000001").is_dir() and (ckpt / "iter_0000001").is_dir()
    assert not list(ckpt.glob("**/*.tmp"))

    second = tmp_path / "second"
    second.mkdir()
    # a longer run continues the saved LR schedule (actor's and critic's alike)
    resume = ["--load", str(ckpt), "--use-checkpoint-opt_param-scheduler"]
    sync_driver.train(e2e_args(tiny_kit, second, *ppo, *resume, num_rollout=3))
    rows = read_metrics(second)
    assert [r["rollout_id"] for r in rows] == [2]
    assert rows[0]["train/step"] == 2 * 2 + 1
    assert "train/critic-value_loss" in rows[0] and "train/pg_loss" in rows[0]
    assert (ckpt / "critic" / "iter_0000002").is_dir()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["colocate", "fully_async"])
def test_ppo_with_a_critic_colocated_and_asynchronous(ray_session, tiny_kit, tmp_path, mode):
    """The critic in the other layouts: colocated (trainers, critic and engine share the logical GPU; the critic
    sleeps between its steps) and fully async (the one-step-off loop is the resume test's first run above)."""
    import train as sync_driver
    import train_async as async_driver
    from tests.test_e2e import make_args as e2e_args
    from tests.test_e2e import read_metrics

    fully_async = ["--rollout-function-path", "slime.rollout.fully_async_rollout.generate_rollout_fully_async"]
    extra = {"colocate": ["--colocate"], "fully_async": fully_async}[mode]
    if mode != "colocate":
        extra += ["--rollout-num-gpus", "1"]
    args = e2e_args(tiny_kit, tmp_path, *PPO, "--num-critic-only-steps", "1", *extra, num_rollout=2)
    (sync_driver if mode == "colocate" else async_driver).train(args)
    rows = read_metrics(tmp_path)
    assert [r["rollout_id"] for r in rows] == [0, 1]
    assert "train/pg_loss" not in rows[0] and "train/critic-value_loss" in rows[0]
    assert "train/pg_loss" in rows[1] and "rollout/critic_explained_variance" in rows[1]


# ---------------------------------------------------------------- --kl-coef: the critic's returns carry the KL penalty
def _one_sample(values=None):
    """One response of 2 tokens, reward 1; old log-probs -0.5, reference -0.7: k1 KL 0.2 per token."""
    data = {
        "log_probs": [torch.full((2,), -0.5)],
        "ref_log_probs": [torch.full((2,), -0.7)],
        "rewards": [1.0],
        "loss_masks": [torch.ones(2, dtype=torch.int)],
        "response_lengths": [2],
        "total_lengths": [6],
    }
    if values is not None:
        data["values"] = [torch.as_tensor(v, dtype=torch.float32) for v in values]
    return data


class _FakeCritic:
    """The critic's side of train_step, as MegatronTrainRayActor.train_critic: values [0.5, 0.25]; without a given
    phase it trains on the GAE returns of its own arguments (critic_args), with phase "train" on the given ones."""

    def __init__(self, args):
        self.args, self.calls, self.trained_on = args, [], None

    def async_train(self, rollout_id, data_ref, values_ref=None):
        import numpy as np

        from slime.backends.megatron_utils.advantages import compute_advantages_and_returns

        extra = values_ref.inner if values_ref is not None else {}
        phase = extra.get("phase")
        self.calls.append(phase)
        if phase == "train":
            self.trained_on = [np.asarray(r).tolist() for r in extra["returns"]]
            return [{"values": {}, "train": [{"train/critic-value_loss": 0.0}], "rollout": {}}]
        values = {0: np.array([0.5, 0.25], dtype=np.float32)}
        if phase == "values":
            return [{"values": values}]
        data = _one_sample(values=[values[0]])
        compute_advantages_and_returns(critic_args(self.args), data)
        self.trained_on = [r.tolist() for r in data["returns"]]
        return [{"values": values, "train": [{"train/critic-value_loss": 0.0}], "rollout": {}}]


class _FakeActor:
    """The actor's side: GAE (compute_advantages_and_returns, its own arguments) on the critic's values; returns
    its returns for phases "returns" / "returns_only"."""

    def __init__(self, args):
        self.args, self.calls = args, []

    def async_train(self, rollout_id, data_ref, values_ref=None):
        from slime.backends.megatron_utils.advantages import compute_advantages_and_returns

        extra = values_ref.inner
        self.calls.append(extra.get("phase"))
        data = _one_sample(values=extra["values"])
        compute_advantages_and_returns(self.args, data)
        self.advantages = [a.tolist() for a in data["advantages"]]
        out = {"returns": {0: data["returns"][0].numpy()}} if extra.get("phase") else {}
        if extra.get("phase") == "returns_only":
            return [out]
        return [{**out, "train": [{"train/pg_loss": 1.0}], "rollout": {}}]


@pytest.mark.usefixtures("mpu_world1")
@pytest.mark.parametrize("rollout_id", [0, 1])  # --num-critic-only-steps 1: rollout 0 trains the critic only
def test_with_kl_coef_the_critic_regresses_on_the_actors_kl_penalised_returns(monkeypatch, rollout_id):
    """By hand, --kl-coef 0.5, --gamma 0.9, --lambd 0.5, values V = [0.5, 0.25], KL 0.2 per token:
    token rewards r = [-0.5 * 0.2, 1 - 0.5 * 0.2] = [-0.1, 0.9];
    TD errors d1 = 0.9 - 0.25 = 0.65, d0 = -0.1 + 0.9 * 0.25 - 0.5 = -0.375;
    advantages A1 = 0.65, A0 = -0.375 + 0.45 * 0.65 = -0.0825; returns A + V = [0.4175, 0.9].
    (Without the KL the returns would be [0.5625, 1.0]: what the critic learned before.)"""
    from slime.ray import critic as critic_mod

    monkeypatch.setattr(critic_mod.ray, "put", lambda x: x)  # fakes read Box.inner directly
    args = make_args(*PPO, "--kl-coef", "0.5", "--gamma", "0.9", "--lambd", "0.5", "--num-critic-only-steps", "1")
    critic, actor = _FakeCritic(args), _FakeActor(args)
    results = critic_mod.train_step(args, rollout_id, actor, critic, "data", lambda x: x)
    assert critic.trained_on[0] == pytest.approx([0.4175, 0.9], abs=1e-6)
    assert critic.calls == ["values", "train"]
    if rollout_id == 0:  # the warm-up: the actor computes its returns and does not train
        assert actor.calls == ["returns_only"] and results == [
            {"critic": {"train": [{"train/critic-value_loss": 0.0}], "rollout": {}}}
        ]
    else:
        assert actor.calls == ["returns"] and actor.advantages[0] == pytest.approx([-0.0825, 0.65], abs=1e-6)
        assert "returns" not in results[0] and results[0]["train"] == [{"train/pg_loss": 1.0}]
        assert results[0]["critic"]["train"] == [{"train/critic-value_loss": 0.0}]
    # --kl-coef 0: one critic call, on its own (identical) returns of the task reward
    args0 = make_args(*PPO, "--gamma", "0.9", "--lambd", "0.5")
    critic = _FakeCritic(args0)
    critic_mod.train_step(args0, 1, _FakeActor(args0), critic, "data", lambda x: x)
    assert critic.calls == [None] and critic.trained_on[0] == pytest.approx([0.5625, 1.0], abs=1e-6)
