"""RolloutController: reward post-processing, sample -> train-data conversion, metrics, debug save/load, eval, and
the Ray actor itself (driven by rollout functions defined here and loaded by dotted path)."""

import gc
import json
import math
import os

import numpy as np
import pytest
import torch

from slime.rollout import RolloutSamples
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.train_data import (
    check_train_data,
    convert_samples_to_train_data,
    flatten_rollout_output,
    post_process_rewards,
)
from slime.utils.types import Sample
from tests._args import make_args as real_args

HERE = "tests.test_rollout_controller"


def make_args(**overrides):
    base = dict(
        rollout_function_path=f"{HERE}.fixed_rollout",
        eval_function_path=None,
        custom_reward_post_process_path=None,
        rollout_global_dataset=False,
        prompt_data=None,
        n_samples_per_prompt=2,
        rollout_batch_size=2,
        global_batch_size=4,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        reward_key=None,
        rollout_num_gpus=2,
        load_debug_rollout_data=None,
        save_debug_rollout_data=None,
        debug_train_only=False,
        use_wandb=False,
        buffer_filter_path=None,
        save=None,
        load=None,
        data_source_path="slime.rollout.data_source.RolloutDataSourceWithBuffer",
        custom_convert_samples_to_train_data_path=None,
        custom_rollout_log_function_path=None,
        custom_eval_rollout_log_function_path=None,
    )
    base.update(overrides)
    return real_args(**base)


def sample(index, prompt_len=3, response_len=2, reward=1.0, **kw):
    tokens = list(range(10, 10 + prompt_len + response_len))
    return Sample(index=index, tokens=tokens, response_length=response_len, reward=reward, **kw)


# ------------------------------------------------------------------ rollout functions loaded by path


def fixed_rollout(args, rollout_id, data_source, evaluation=False):
    """rollout_batch_size groups of n samples: rewards 1,0 / 1,1 ...; response length grows with the index."""
    groups = []
    for g in range(args.rollout_batch_size):
        group = []
        for j in range(args.n_samples_per_prompt):
            idx = g * args.n_samples_per_prompt + j
            s = sample(
                idx,
                response_len=idx + 1,
                reward=float((g + j + 1) % 2 or g),
                status=Sample.Status.TRUNCATED if idx == 0 else Sample.Status.COMPLETED,
            )
            s.weight_versions = [str(rollout_id + 1)]
            group.append(s)
        groups.append(group)
    return RolloutSamples(groups, metrics={"rollout/dynamic_filter/drop": 3})


def flat_rollout(args, rollout_id, data_source, evaluation=False):
    return [sample(i, reward=float(i)) for i in range(4)]


def bad_shape_rollout(args, rollout_id, data_source, evaluation=False):
    return {"not": "a list"}


def none_reward_rollout(args, rollout_id, data_source, evaluation=False):
    return [[sample(0), sample(1, reward=None)]]


def raising_rollout(args, rollout_id, data_source, evaluation=False):
    row = {"question": "1+1"}
    return row["answer"]  # the user's bug: a KeyError in their own code


def buffer_rollout(args, rollout_id, data_source, evaluation=False):
    """Returns one group and leaves one group in the data source's buffer (what a partial rollout does)."""
    data_source.add_samples([[sample(100), sample(101)]])
    return [[sample(0, reward=0.0), sample(1, reward=1.0)]]


def eval_rollout(args, rollout_id, data_source, evaluation=False):
    assert evaluation
    return {"toy": {"rewards": [1.0, 0.0, 1.0, 1.0], "truncated": [False, True, False, False]}}


def custom_post_process(args, samples):
    raw = [s.reward for s in samples]
    return raw, [r * 10 for r in raw]


# ------------------------------------------------------------------ reward post-processing


def test_grpo_group_mean_and_std():
    args = make_args(n_samples_per_prompt=4)
    samples = [sample(i, reward=r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])]
    raw, rewards = post_process_rewards(args, samples)
    assert raw == [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    # group 1: mean 0.5, deviations +-0.5, unbiased std = sqrt(4 * 0.25 / 3); group 2: all equal -> 0
    std = math.sqrt(1 / 3)
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6), 0, 0, 0, 0]
    assert rewards == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "reinforce_plus_plus_baseline", "rloo"])
def test_group_mean_without_std(estimator):
    # gspo/grpo with the std toggle off (Dr.GRPO), and the estimators that never divide by std
    args = make_args(n_samples_per_prompt=3, advantage_estimator=estimator, grpo_std_normalization=False)
    _, rewards = post_process_rewards(args, [sample(i, reward=r) for i, r in enumerate([3.0, 0.0, 0.0])])
    assert rewards == pytest.approx([2.0, -1.0, -1.0])


def test_gspo_divides_by_std():
    args = make_args(n_samples_per_prompt=2, advantage_estimator="gspo")
    _, rewards = post_process_rewards(args, [sample(0, reward=2.0), sample(1, reward=0.0)])
    # deviations +-1, unbiased std of (2, 0) = sqrt(2)
    assert rewards == pytest.approx([1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6)], abs=1e-6)


@pytest.mark.parametrize(
    "overrides", [dict(advantage_estimator="reinforce_plus_plus"), dict(rewards_normalization=False)]
)
def test_no_normalisation(overrides):
    args = make_args(**overrides)
    raw, rewards = post_process_rewards(args, [sample(0, reward=3.0), sample(1, reward=1.0)])
    assert raw == rewards == [3.0, 1.0]


def test_reward_key_selects_from_dict_rewards():
    args = make_args(reward_key="score", rewards_normalization=False)
    raw, _ = post_process_rewards(args, [sample(0, reward={"score": 0.5, "acc": 1}), sample(1, reward={"score": 1.5})])
    assert raw == [0.5, 1.5]


def test_none_reward_names_function_and_sample():
    args = make_args()
    with pytest.raises(ValueError, match=r"sample 7 \(position 1\).*my\.rollout\.fn.*no reward"):
        post_process_rewards(args, [sample(6), sample(7, reward=None)], fn_path="my.rollout.fn")


def test_non_number_reward_names_the_reward_function_and_type():
    samples = [sample(0, reward=1.0), sample(1, reward="correct")]
    with pytest.raises(TypeError) as exc:
        post_process_rewards(make_args(custom_rm_path="my_rm.score"), samples, fn_path="f.rollout")
    assert str(exc.value) == (
        "sample 1: the reward function --custom-rm-path my_rm.score returned a str 'correct'; "
        "a reward must be a number"
    )
    samples = [sample(0, reward={"score": 1.0, "acc": True}), sample(1)]
    with pytest.raises(
        TypeError,
        match=r"^sample 0: the reward function of --rm-type dapo returned a dict .*"
        r"pick the training reward with --reward-key",
    ):
        post_process_rewards(make_args(rm_type="dapo"), samples, fn_path="f.rollout")
    with pytest.raises(TypeError, match=r"^sample 0: rollout function 'f\.rollout' returned a list \[1\]"):
        post_process_rewards(make_args(), [sample(0, reward=[1]), sample(1)], fn_path="f.rollout")
    # numbers of any kind pass: ints, bools, numpy and 0-d tensors
    raw, _ = post_process_rewards(make_args(), [sample(0, reward=np.float32(0.5)), sample(1, reward=torch.tensor(1))])
    assert raw == [0.5, 1]


def test_incomplete_groups_are_rejected():
    with pytest.raises(ValueError, match="3 samples, not a multiple of --n-samples-per-prompt=2"):
        post_process_rewards(make_args(), [sample(i) for i in range(3)], fn_path="f")


# ------------------------------------------------------------------ conversion


def test_convert_samples_to_train_data_shapes_and_defaults():
    args = make_args(advantage_estimator="reinforce_plus_plus")
    samples = [
        sample(0, prompt_len=3, response_len=2, reward=1.0, status=Sample.Status.TRUNCATED),
        sample(1, prompt_len=2, response_len=4, reward=0.0, loss_mask=[1, 0, 0, 1], status=Sample.Status.COMPLETED),
    ]
    data = convert_samples_to_train_data(args, samples)
    assert set(data) == {
        "tokens",
        "response_lengths",
        "rewards",
        "raw_reward",
        "truncated",
        "sample_indices",
        "loss_masks",
    }
    assert [t.dtype for t in data["tokens"]] == [np.int64, np.int64]
    assert [t.tolist() for t in data["tokens"]] == [[10, 11, 12, 13, 14], [10, 11, 12, 13, 14, 15]]
    assert data["response_lengths"] == [2, 4]
    assert data["truncated"] == [1, 0]
    assert data["sample_indices"] == [0, 1]
    assert data["rewards"] == data["raw_reward"] == [1.0, 0.0]
    assert [m.dtype for m in data["loss_masks"]] == [np.int32, np.int32]
    assert [m.tolist() for m in data["loss_masks"]] == [[1, 1], [1, 0, 0, 1]]  # missing mask -> all ones


def test_convert_optional_fields():
    args = make_args(rewards_normalization=False)
    samples = [
        sample(
            i,
            response_len=2,
            reward=0.5,
            rollout_log_probs=[-0.1 * i, -0.2],
            metadata={"raw_reward": i, "round_number": 3 + i},
        )
        for i in range(2)
    ]
    data = convert_samples_to_train_data(args, samples)
    assert data["raw_reward"] == [0, 1]  # raw reward kept by the rollout (e.g. an external buffer) wins
    # a batch of mixed sources carries it on some samples only: the others keep their own reward, whichever comes first
    for first in (0, 1):
        samples[first].metadata.pop("raw_reward")
        expected = [0.5, 1] if first == 0 else [0, 0.5]
        assert convert_samples_to_train_data(args, samples)["raw_reward"] == expected
        samples[first].metadata["raw_reward"] = first
    assert data["round_number"] == [3, 4]
    assert data["rollout_log_probs"][1].dtype == np.float32
    assert data["rollout_log_probs"][1].tolist() == pytest.approx([-0.1, -0.2])


def test_train_data_contract_is_declared_once_and_read_whole_by_the_trainers():
    """The converter returns exactly the keys `TrainData` declares (required ones always, optional ones when the
    samples carry them), and the trainers partition every per-sample key of it across DP ranks."""
    from slime.backends.megatron_utils.rollout_data import PARTITIONED_KEYS
    from slime.utils.types import OPTIONAL_TRAIN_DATA_KEYS, TRAIN_DATA_KEYS, TrainData

    assert set(TRAIN_DATA_KEYS) == TrainData.__required_keys__
    assert set(OPTIONAL_TRAIN_DATA_KEYS) == TrainData.__optional_keys__
    samples = [
        sample(
            i,
            rollout_log_probs=[-0.5, -0.25],
            teacher_log_probs=[-0.75, -1.0],
            metadata={"round_number": 1},
            train_metadata={"turn": i},
        )
        for i in range(2)
    ]
    data = convert_samples_to_train_data(make_args(rewards_normalization=False), samples)
    top_p_sets = {"rollout_top_p_token_ids", "rollout_top_p_token_offsets"}  # only with truncated sampling
    routing = {"rollout_routed_experts"}  # only with --use-rollout-routing-replay
    fan_out = {"rollout_ids"}  # only when samples share a rollout_id
    temperatures = {"rollout_temperatures"}  # only when a trained token was sampled at another temperature
    images = {"multimodal_train_inputs"}  # only when a sample carries the processor's outputs
    optional = set(OPTIONAL_TRAIN_DATA_KEYS) - top_p_sets - routing - fan_out - temperatures - images
    assert set(data) == set(TRAIN_DATA_KEYS) | optional
    assert set(TrainData.__annotations__) - {"raw_reward"} <= set(PARTITIONED_KEYS)  # raw_reward: global, for logs
    with pytest.raises(ValueError, match=r"my_converter returned no rewards, loss_masks; it must return"):
        check_train_data({k: data[k] for k in TRAIN_DATA_KEYS if k not in ("rewards", "loss_masks")}, "my_converter")


def test_mask_length_mismatch_names_sample():
    args = make_args()
    samples = [sample(0), sample(5, response_len=3, loss_mask=[1, 1])]
    with pytest.raises(
        ValueError,
        match=r"sample 5 \(position 1\) from rollout function 'fn'.*loss_mask has 2 entries but response_length is 3",
    ):
        convert_samples_to_train_data(args, samples, fn_path="fn")


def test_log_prob_length_mismatch_names_sample():
    samples = [sample(0, rollout_log_probs=[0.0, 0.0]), sample(1, rollout_log_probs=[0.0])]
    with pytest.raises(ValueError, match=r"sample 1 .*rollout_log_probs has 1 entries"):
        convert_samples_to_train_data(make_args(), samples)


def test_flatten_rollout_output():
    groups = fixed_rollout(make_args(), 0, None)
    flat, metrics = flatten_rollout_output(groups, "f")
    assert [s.index for s in flat] == [0, 1, 2, 3]
    assert metrics == {"rollout/dynamic_filter/drop": 3}
    assert flatten_rollout_output(flat, "f")[0] == flat  # a flat list is accepted as is
    for bad in [{"a": 1}, [], [[sample(0)], "x"], [sample(0), 3]]:
        with pytest.raises(TypeError, match="rollout function 'my.fn' returned .*list\\[list\\[Sample\\]\\]"):
            flatten_rollout_output(bad, "my.fn")


# ------------------------------------------------------------------ the Ray actor


@pytest.fixture(scope="module")
def ray_mod(ray_session):
    return ray_session


def _controller(ray, args):
    from slime.ray.buffer import RolloutController

    return RolloutController.options(num_cpus=0, num_gpus=0).remote(args, None)


def test_controller_generate_returns_boxed_train_data_and_metrics(ray_mod, tmp_path):
    ray = ray_mod
    debug_path = str(tmp_path / "debug" / "rollout_{rollout_id}.pt")
    args = make_args(save_debug_rollout_data=debug_path)
    controller = _controller(ray, args)
    try:
        ray.get(controller.set_weight_version.remote(5))  # the push fixed_rollout's samples record
        # start-up's objects (modules, the dataset) are out of the cyclic GC's sight: the collections the rollout's
        # allocations trigger scan only what it made (a fifth of the controller's CPU in the main job before)
        assert ray.get(controller.__ray_call__.remote(lambda self: gc.get_freeze_count())) > 100_000
        box = ray.get(controller.generate.remote(4), timeout=120)
        data = ray.get(box.inner)
        metrics = ray.get(controller.pop_metrics.remote(4))
    finally:
        ray.kill(controller)

    assert data["sample_indices"] == [0, 1, 2, 3]
    assert data["response_lengths"] == [1, 2, 3, 4]
    # raw rewards of fixed_rollout: group 0 -> [1, 0], group 1 -> [1, 1]; grpo: group 0 -> +-1/(sqrt(0.5)+1e-6)
    assert data["raw_reward"] == [1.0, 0.0, 1.0, 1.0]
    d = 0.5 / (math.sqrt(0.5) + 1e-6)
    assert data["rewards"] == pytest.approx([d, -d, 0.0, 0.0], abs=1e-5)
    assert metrics["rollout/raw_reward"] == pytest.approx(0.75)
    assert metrics["rollout/response_length"] == pytest.approx(2.5)
    assert metrics["rollout/response_length_max"] == 4
    assert metrics["rollout/truncated_ratio"] == pytest.approx(0.25)
    assert metrics["rollout/weight_version"] == 5
    assert metrics["rollout/dynamic_filter/drop"] == 3  # the rollout function's own metrics come along
    assert metrics["perf/rollout_time"] > 0
    # 10 trained tokens over 2 rollout GPUs
    assert metrics["perf/tokens_per_gpu_per_sec"] == pytest.approx(10 / metrics["perf/rollout_time"] / 2)
    assert metrics["perf/longest_sample_tokens_per_sec"] == pytest.approx(4 / metrics["perf/rollout_time"])

    # The saved debug data replays to identical train data in a controller that never calls the rollout function.
    assert os.path.exists(debug_path.format(rollout_id=4))
    saved = torch.load(debug_path.format(rollout_id=4), weights_only=False)
    assert saved["rollout_id"] == 4 and len(saved["samples"]) == 4
    # each dumped sample says which weights generated it
    assert saved["samples"][0]["metadata"]["provenance"] == {"weight_versions": ["5"], "weight_version_spans": []}
    replay = _controller(
        ray, make_args(load_debug_rollout_data=debug_path, rollout_function_path=f"{HERE}.bad_shape_rollout")
    )
    try:
        replayed = ray.get(ray.get(replay.generate.remote(4), timeout=120).inner)
        replay_metrics = ray.get(replay.pop_metrics.remote(4))
    finally:
        ray.kill(replay)
    assert replayed["raw_reward"] == data["raw_reward"] and replayed["rewards"] == pytest.approx(data["rewards"])
    assert [t.tolist() for t in replayed["tokens"]] == [t.tolist() for t in data["tokens"]]
    assert "perf/rollout_time" not in replay_metrics  # no generation happened


def test_controller_errors_name_the_rollout_function(ray_mod):
    ray = ray_mod
    for fn, pattern in [
        ("bad_shape_rollout", r"rollout function 'tests\.test_rollout_controller\.bad_shape_rollout' returned dict"),
        (
            "none_reward_rollout",
            r"sample 1 \(position 1\) returned by rollout function 'tests\.test_rollout_controller\.none_reward_rollout' has no reward",
        ),
    ]:
        controller = _controller(ray, make_args(rollout_function_path=f"{HERE}.{fn}"))
        try:
            with pytest.raises(ray.exceptions.RayTaskError, match=pattern):
                ray.get(controller.generate.remote(0), timeout=120)
        finally:
            ray.kill(controller)


def test_rollout_function_exception_reaches_the_driver_as_the_users_own(ray_mod, capsys):
    """The driver's wait re-raises the user's exception (their traceback first) with one line of slime context,
    not Ray's wrapping of it."""
    import types

    from slime.ray.driver import Watchdog
    from slime.utils.user_errors import UserCodeError, exit_on_user_error

    controller = _controller(ray_mod, make_args(rollout_function_path=f"{HERE}.raising_rollout"))
    manager = types.SimpleNamespace(
        raise_if_failed=lambda: None, check_engines_alive=lambda: None, actor_names=dict
    )  # no engine or router fault to report (the wait checks the engines every few seconds on a slow machine)
    try:
        with pytest.raises(SystemExit) as exc, exit_on_user_error():
            Watchdog(manager).get(controller.generate.remote(3))
    finally:
        ray_mod.kill(controller)
    assert exc.value.code == 1 and isinstance(exc.value.__context__, UserCodeError)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].endswith("in raising_rollout") and "test_rollout_controller.py" in lines[1]
    assert lines[-2] == "KeyError: 'answer'"
    assert lines[-1].endswith(f"error: raised by --rollout-function-path {HERE}.raising_rollout in rollout 3")
    assert not any("ray" in line.lower() or "buffer.py" in line for line in lines[:-1])


def test_controller_custom_post_process_eval_and_buffer(ray_mod):
    ray = ray_mod
    args = make_args(
        rollout_function_path=f"{HERE}.buffer_rollout",
        eval_function_path=f"{HERE}.eval_rollout",
        custom_reward_post_process_path=f"{HERE}.custom_post_process",
    )
    controller = _controller(ray, args)
    try:
        data = ray.get(ray.get(controller.generate.remote(0), timeout=120).inner)
        assert data["rewards"] == [0.0, 10.0] and data["raw_reward"] == [0.0, 1.0]
        assert ray.get(controller.get_buffer_length.remote()) == 1
        metrics = ray.get(controller.eval.remote(0), timeout=120)
        assert metrics == {"eval/toy": pytest.approx(0.75), "eval/toy-truncated_ratio": pytest.approx(0.25)}
    finally:
        ray.kill(controller)


def test_flat_rollout_output_is_accepted(ray_mod):
    ray = ray_mod
    controller = _controller(
        ray, make_args(rollout_function_path=f"{HERE}.flat_rollout", advantage_estimator="reinforce_plus_plus")
    )
    try:
        data = ray.get(ray.get(controller.generate.remote(0), timeout=120).inner)
    finally:
        ray.kill(controller)
    assert data["rewards"] == [0.0, 1.0, 2.0, 3.0]


# ------------------------------------------------------------------ current slime's controller extension points


class CountingDataSource(RolloutDataSourceWithBuffer):
    """--data-source-path: a DataSource subclass built as cls(args) (the rollout function sees its type)."""


def typed_rollout(args, rollout_id, data_source, evaluation=False):
    """Current slime's output types; the data source is the --data-source-path instance."""
    tag = type(data_source).__name__
    if evaluation:
        return RolloutFnEvalOutput(
            data={"toy": {"rewards": [1.0, 0.0], "truncated": [False, False], "samples": [sample(0), sample(1)]}},
            metrics={"eval/extra": 1.0},
        )
    groups = [[sample(0, reward=1.0, metadata={"ds": tag}), sample(1, reward=0.0)]]
    return RolloutFnTrainOutput(samples=groups, metrics={"rollout/extra": 2.0})


def custom_convert(args, samples):
    return {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": [42.0] * len(samples),
        "raw_reward": [s.reward for s in samples],
        "truncated": [0] * len(samples),
        "sample_indices": [s.index for s in samples],
        "loss_masks": [[1] * s.response_length for s in samples],
        "ds": [s.metadata.get("ds") for s in samples],
    }


def missing_key_convert(args, samples):
    return {"tokens": [s.tokens for s in samples]}


def file_logger(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    with open(os.path.join(args.save, f"rollout_{rollout_id}.json"), "w") as f:
        json.dump({"n": len(samples), "extra": rollout_extra_metrics, "time": rollout_time > 0}, f)
    return True


def eval_file_logger(rollout_id, args, data, extra_metrics):
    with open(os.path.join(args.save, f"eval_{rollout_id}.json"), "w") as f:
        json.dump({"names": sorted(data), "samples": len(data["toy"]["samples"]), "extra": extra_metrics}, f)
    return False


def test_controller_data_source_convert_and_log_functions(ray_mod, tmp_path):
    ray = ray_mod
    args = make_args(
        rollout_function_path=f"{HERE}.typed_rollout",
        data_source_path=f"{HERE}.CountingDataSource",
        custom_convert_samples_to_train_data_path=f"{HERE}.custom_convert",
        custom_rollout_log_function_path=f"{HERE}.file_logger",
        custom_eval_rollout_log_function_path=f"{HERE}.eval_file_logger",
        save=str(tmp_path),
    )
    controller = _controller(ray, args)
    try:
        data = ray.get(ray.get(controller.generate.remote(3), timeout=120).inner)
        metrics = ray.get(controller.pop_metrics.remote(3))
        eval_metrics = ray.get(controller.eval.remote(3), timeout=120)
    finally:
        ray.kill(controller)
    # the custom converter replaced the conversion and the reward post-processing
    assert (
        data["rewards"] == [42.0, 42.0] and data["raw_reward"] == [1.0, 0.0] and data["ds"][0] == "CountingDataSource"
    )
    assert metrics["rollout/extra"] == 2.0 and metrics["rollout/raw_reward"] == 0.5
    with open(tmp_path / "rollout_3.json") as f:
        assert json.load(f) == {"n": 2, "extra": {"rollout/extra": 2.0}, "time": True}
    # the rewards' mean and truncation from `data`; the sample metrics from the samples (two 2-token responses, both
    # reward 1.0 in one group, so one zero-std group)
    per_sample = {"response_len/mean": 2.0, "response_len/median": 2.0, "response_len/max": 2.0}
    per_sample |= {"response_len/min": 2.0, "zero_std/count_1.0": 1, "prefix_cache_hit_rate": 0.0}
    per_sample |= {"avg_cached_tokens_per_sample": 0.0, "repetition_frac": 0.0, "truncated_ratio": 0.0}
    assert eval_metrics == {
        "eval/toy": 0.5,
        "eval/toy-truncated_ratio": 0.0,
        "eval/extra": 1.0,
        **{f"eval/toy/{k}": v for k, v in per_sample.items()},
    }
    with open(tmp_path / "eval_3.json") as f:
        assert json.load(f) == {"names": ["toy"], "samples": 2, "extra": {"eval/extra": 1.0}}

    controller = _controller(
        ray,
        make_args(
            rollout_function_path=f"{HERE}.typed_rollout",
            custom_convert_samples_to_train_data_path=f"{HERE}.missing_key_convert",
        ),
    )
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match=r"missing_key_convert returned no response_lengths"):
            ray.get(controller.generate.remote(0), timeout=120)
    finally:
        ray.kill(controller)


# ------------------------------------------------------------------ log functions' return values (no Ray cluster)

LOG_CALLS = []


def log_true(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    LOG_CALLS.append(("rollout", rollout_id))
    return True


def log_false(rollout_id, args, samples, rollout_extra_metrics, rollout_time):
    LOG_CALLS.append(("rollout", rollout_id))
    return False


def eval_log_true(rollout_id, args, data, extra_metrics):
    LOG_CALLS.append(("eval", rollout_id))
    return True


def eval_log_false(rollout_id, args, data, extra_metrics):
    LOG_CALLS.append(("eval", rollout_id))
    return None  # falsy, as a function that only adds to the default logging returns


@pytest.mark.parametrize("skips", [True, False])
def test_a_truthy_log_function_return_skips_the_default_logging(monkeypatch, skips):
    """docs/customization.md: the log functions return True to replace slime's own logging, False to add to it."""
    import slime.ray.buffer as buffer

    monkeypatch.setattr(buffer.ray, "put", lambda x: x)  # the controller's class itself, outside Ray
    monkeypatch.setattr(buffer, "freeze_startup_objects", lambda: None)  # gc.freeze is for the actor's process
    args = make_args(
        eval_function_path=f"{HERE}.eval_rollout",
        custom_rollout_log_function_path=f"{HERE}.{'log_true' if skips else 'log_false'}",
        custom_eval_rollout_log_function_path=f"{HERE}.{'eval_log_true' if skips else 'eval_log_false'}",
    )
    controller = buffer.RolloutController.__ray_metadata__.modified_class(args)
    controller.set_weight_version("4")  # the push fixed_rollout's samples of rollout 3 record
    logged = []
    controller._log = lambda kind, rollout_id, metrics: logged.append((kind, rollout_id, dict(metrics)))
    LOG_CALLS.clear()
    data = controller.generate(3).inner
    assert data["raw_reward"] == [1.0, 0.0, 1.0, 1.0]  # the rollout ran and converted whatever the logging did
    metrics = controller.eval(3)
    assert LOG_CALLS == [("rollout", 3), ("eval", 3)]  # the custom functions ran in both cases
    if skips:
        assert logged == []
    else:
        assert [(kind, rid) for kind, rid, _ in logged] == [("rollout", 3), ("eval", 3)]
        assert logged[0][2]["rollout/raw_reward"] == pytest.approx(0.75) and logged[1][2] == metrics
    assert controller.pop_metrics(3)["rollout/raw_reward"] == pytest.approx(0.75)  # returned to the driver either way
