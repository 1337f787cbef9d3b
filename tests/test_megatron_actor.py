"""`MegatronTrainRayActor` as real Ray actors (logical GPUs): init from the tiny Qwen3 HF checkpoint, train one
rollout with a reference model at TP=1 and TP=2, checkpoint, and resume at the next rollout id; a user's loss that
raises inside the trainers comes back as their own exception; the three Megatron hooks are called where and with
what current slime calls them."""

import gc
import os

import pytest

from slime.utils.flops_utils import forward_flops
from slime.utils.user_errors import UserCodeError
from tests._megatron_helpers import fixed_rollout, train_args


def raising_loss(args, batch, logits, sum_of_sample_mean):
    raise ValueError("my loss is broken")


def _record(args, *event):
    import torch.distributed as dist

    with open(os.path.join(os.path.dirname(args.save), f"hooks.{dist.get_rank()}"), "a") as f:
        f.write(" ".join(map(str, event)) + "\n")


def init_hook(args):  # --custom-megatron-init-path: once per rank, after Megatron's parallel state is set up
    from megatron.core import mpu

    _record(args, "init", mpu.get_tensor_model_parallel_world_size())


def log_prob_hook(args, model, store_prefix):  # before each log-prob pass: the model chunks and where values go
    _record(args, "log_prob", store_prefix, type(model).__name__, len(model), model[0].training)


def train_step_hook(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):  # before each optimizer step
    _record(
        args, "train_step", rollout_id, step_id, len(model), type(optimizer).__name__, opt_param_scheduler.num_steps
    )


def _make_actors(ray, world_size):
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor

    cls = ray.remote(num_gpus=0.8, num_cpus=1)(MegatronTrainRayActor)
    env = {"env_vars": {"SLIME_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}}
    first = cls.options(runtime_env=env).remote(world_size, 0, None, None)
    addr, port = ray.get(first.get_master_addr_and_port.remote(), timeout=120)
    return [first] + [cls.options(runtime_env=env).remote(world_size, r, addr, port) for r in range(1, world_size)]


def _kill(ray, actors):
    for a in actors:
        ray.kill(a)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_actor_trains_tiny_qwen3_and_resumes(ray_session, tiny_kit, tmp_path, tp):
    from slime.utils.ray_utils import Box

    ray = ray_session
    model_dir, _ = tiny_kit
    save = str(tmp_path / "ckpt")
    hooks = dict(
        custom_megatron_init_path=f"{__name__}.init_hook",
        custom_megatron_before_log_prob_hook_path=f"{__name__}.log_prob_hook",
        custom_megatron_before_train_step_hook_path=f"{__name__}.train_step_hook",
    )
    args = train_args(model_dir, tensor_model_parallel_size=tp, save=save, kl_loss_coef=0.01, **hooks)
    actors = _make_actors(ray, tp)
    try:
        starts = ray.get([a.init.remote(args, "actor", None, with_ref=True) for a in actors], timeout=300)
        assert starts == [0] * tp
        # start-up's objects (modules, model, optimizer) are out of the cyclic GC's sight: megatron-core's full
        # collection at each checkpoint save scans only what training made since
        frozen = ray.get(actors[0].__ray_call__.remote(lambda self: gc.get_freeze_count()), timeout=60)
        assert frozen > 100_000, frozen
        data_ref = Box(ray.put(fixed_rollout()))
        results = ray.get([a.train.remote(0, data_ref) for a in actors], timeout=300)
        train = results[0]["train"]  # rank 0 is tp 0 / dp 0 / last stage
        assert len(train) == 1 and train[0]["train/step"] == 0
        assert train[0]["train/ppo_kl"] == 0.0 and train[0]["train/kl_loss"] == 0.0  # --ci-test checks too
        assert train[0]["train/grad_norm"] > 0 and train[0]["train/lr"] == pytest.approx(1e-3)
        assert train[0]["train/global_batch_size"] == len(fixed_rollout()["tokens"])  # the step's samples
        # one optimizer step per rollout: PPO's old log-probs are the training forward's, no separate forward
        assert "rollout/log_probs" not in results[0]["rollout"] and "rollout/ref_log_probs" in results[0]["rollout"]
        # current slime's throughput: the rollout's tokens, and 3 forwards' FLOPs shared by the tp GPUs
        perf, lengths = results[0]["perf"], [len(t) for t in fixed_rollout()["tokens"]]
        flops = ray.get(actors[0].__ray_call__.remote(lambda self: [forward_flops(self.args, n) for n in lengths]))
        train_time, ref_time = perf["perf/actor_train_time"], perf["perf/ref_log_probs_time"]
        assert perf["perf/actor_train_tok_per_s"] == pytest.approx(sum(lengths) / train_time)
        assert perf["perf/actor_train_tflops"] == pytest.approx(3 * sum(flops) / tp / 1e12 / train_time)
        assert perf["perf/ref_log_probs_tflops"] == pytest.approx(sum(flops) / tp / 1e12 / ref_time)
        assert "perf/log_probs_tflops" not in perf
        ray.get([a.save_model.remote(0) for a in actors], timeout=300)
    finally:
        _kill(ray, actors)
    with open(f"{save}/latest_checkpointed_iteration.txt") as f:
        assert f.read() == "0"
    # on every rank: init, then the reference model's log-prob pass (in eval mode), then the rollout's one step
    for rank in range(tp):
        events = (tmp_path / f"hooks.{rank}").read_text().splitlines()
        assert events == [f"init {tp}", "log_prob ref_ list 1 False", "train_step 0 0 1 ChainedOptimizer 0"], events

    resumed = _make_actors(ray, tp)
    loss_path = f"{__name__}.raising_loss"
    try:
        args = train_args(
            model_dir,
            tensor_model_parallel_size=tp,
            save=save,
            load=save,
            kl_loss_coef=0.01,
            loss_type="custom_loss",
            custom_loss_function_path=loss_path,
        )
        starts = ray.get([a.init.remote(args, "actor", None, with_ref=False) for a in resumed], timeout=300)
        assert starts == [1] * tp
        # the driver's wait re-raises the cause as is (tests/test_rollout_controller.py): the user's traceback first
        with pytest.raises(ray.exceptions.RayTaskError) as exc:
            ray.get([a.train.remote(1, Box(ray.put(fixed_rollout()))) for a in resumed], timeout=300)
    finally:
        _kill(ray, resumed)
    err = exc.value.cause
    assert isinstance(err, UserCodeError) and err.context == f"raised by --custom-loss-function-path {loss_path}"
    lines = err.user_traceback.rstrip().splitlines()
    assert lines[1].endswith("in raising_loss") and lines[-1] == "ValueError: my loss is broken"
