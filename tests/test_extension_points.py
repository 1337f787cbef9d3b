"""Current slime's extension-point contracts that need no server: rollout output types and `call_rollout_fn`,
`DynamicFilterOutput` drop rule, rollout sample hooks, deep fan-out flattening, `remove_sample` and
`train_metadata` at conversion, `--custom-config-path`, the start-up table rows of the new path flags."""

import asyncio

import numpy as np
import pytest

from slime.ray.buffer import convert_samples_to_train_data, flatten_rollout_output
from slime.rollout import RolloutSamples
from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.filter_hub.base_types import (
    DynamicFilterOutput,
    MetricGatherer,
    call_dynamic_filter,
    should_drop_dynamic_filter_output,
)
from slime.rollout.filter_hub.dynamic_sampling_filters import (
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
)
from slime.rollout.sample_hooks import apply_rollout_sample_hooks, set_current_rollout_id
from slime.utils.sampling_record import applied_sampling_params, response_temperatures
from slime.utils.types import Sample
from tests._args import BASE, make_args

HERE = "tests.test_extension_points"


# ---------------------------------------------------------------- rollout function outputs


def test_call_rollout_fn_passes_evaluation_by_keyword_and_wraps_bare_results():
    calls = []

    def legacy(args, rollout_id, data_source, evaluation=False):
        calls.append((args, rollout_id, data_source, evaluation))
        return {"d": {"rewards": [1]}} if evaluation else [[Sample(index=0)]]

    train = call_rollout_fn(legacy, "A", 3, "DS", evaluation=False)
    assert isinstance(train, RolloutFnTrainOutput) and train.metrics is None and train.samples[0][0].index == 0
    ev = call_rollout_fn(legacy, "A", 3, "DS", evaluation=True)
    assert isinstance(ev, RolloutFnEvalOutput) and ev.data == {"d": {"rewards": [1]}} and ev.metrics is None
    assert calls == [("A", 3, "DS", False), ("A", 3, "DS", True)]

    typed = RolloutFnTrainOutput(samples=[], metrics={"m": 1})
    assert call_rollout_fn(lambda *a, evaluation: typed, 1, 2, 3, evaluation=False) is typed
    # the default rollout's list result keeps its metrics when wrapped
    wrapped = call_rollout_fn(lambda *a, evaluation: RolloutSamples([[Sample()]], {"x": 2}), 1, 2, 3, evaluation=False)
    assert wrapped.metrics == {"x": 2} and len(wrapped.samples) == 1


def test_fan_out_outputs_of_any_depth_are_flattened_in_order():
    s = [Sample(index=i) for i in range(5)]
    out = RolloutFnTrainOutput(samples=[[s[0], [s[1], s[2]]], [[s[3]], s[4]]], metrics={"k": 1.0})
    flat, metrics = flatten_rollout_output(out, "my.fn")
    assert [x.index for x in flat] == [0, 1, 2, 3, 4] and metrics == {"k": 1.0}
    with pytest.raises(TypeError, match="my.fn.*a list containing int"):
        flatten_rollout_output([[s[0], [1]]], "my.fn")


# ---------------------------------------------------------------- dynamic filter output


@pytest.mark.parametrize(
    "output, remaining, target, drop",
    [
        (DynamicFilterOutput(keep=True), 5, 2, False),
        (DynamicFilterOutput(keep=False), 2, 2, True),
        (DynamicFilterOutput(keep=False, keep_when_insufficient=True), 3, 2, True),  # enough others still in flight
        (DynamicFilterOutput(keep=False, keep_when_insufficient=True), 2, 2, False),  # dropping would need a new round
        (DynamicFilterOutput(keep=False, keep_when_insufficient=True), 1, 2, False),
    ],
)
def test_should_drop_dynamic_filter_output(output, remaining, target, drop):
    assert should_drop_dynamic_filter_output(output, remaining_batch_size=remaining, target_data_size=target) is drop


def test_call_dynamic_filter_and_metric_gatherer():
    assert call_dynamic_filter(None, "args", []).keep is True
    legacy = call_dynamic_filter(lambda args, group: False, "args", [])
    assert isinstance(legacy, DynamicFilterOutput) and legacy.keep is False and legacy.reason is None
    args = make_args()
    same = [Sample(reward=1.0), Sample(reward=1.0)]
    out = check_reward_nonzero_std(args, same)
    assert (bool(out), out.reason, out.keep_when_insufficient) == (False, "zero_std_1.0", False)
    assert check_reward_nonzero_std_with_fallback(args, same).keep_when_insufficient is True
    # current slime's metric names: an int reward's group is zero_std_1, a float's rounded as Python rounds (0.25: zero_std_0.2)
    assert check_reward_nonzero_std(args, [Sample(reward=1), Sample(reward=1)]).reason == "zero_std_1"
    assert check_reward_nonzero_std(args, [Sample(reward=0.25), Sample(reward=0.25)]).reason == "zero_std_0.2"
    assert check_reward_nonzero_std(args, [Sample(reward=0.0), Sample(reward=1.0)]).reason is None
    gatherer = MetricGatherer()
    for reason in ("zero_std_1.0", "zero_std_1.0", None, "zero_std_0.0"):
        gatherer.on_dynamic_filter_drop(reason)
    assert gatherer.collect() == {
        "rollout/dynamic_filter/drop_zero_std_1.0": 2,
        "rollout/dynamic_filter/drop_zero_std_0.0": 1,
    }


# ---------------------------------------------------------------- rollout sample hooks

SEEN = []


def tag_hook(args, sample):
    sample.metadata["tags"] = [*sample.metadata.get("tags", []), "tag"]


def id_hook(args, sample, rollout_id):
    SEEN.append(("id", sample.index, rollout_id))


async def async_all_kwargs_hook(args, sample, **kwargs):
    SEEN.append(("kw", sample.index, kwargs))


def replacing_hook(args, sample, evaluation):
    return Sample(index=sample.index + 100, metadata=dict(sample.metadata))


def bad_hook(args, sample):
    return 3


def run(coro):
    return asyncio.run(coro)


def hook_args(*paths):
    return make_args(*[a for p in paths for a in ("--rollout-sample-hook-path", f"{HERE}.{p}")])


def test_hooks_run_in_order_with_declared_keywords_and_keep_nesting():
    SEEN.clear()
    set_current_rollout_id(7)
    args = hook_args("tag_hook", "id_hook", "async_all_kwargs_hook", "replacing_hook")
    assert args.rollout_sample_hook_path == [
        f"{HERE}.tag_hook",
        f"{HERE}.id_hook",
        f"{HERE}.async_all_kwargs_hook",
        f"{HERE}.replacing_hook",
    ]
    inner = [Sample(index=1), Sample(index=2)]
    nested = [Sample(index=0), inner]
    out = run(apply_rollout_sample_hooks(args, nested, evaluation=True))
    assert [out[0].index, [s.index for s in out[1]]] == [100, [101, 102]]
    assert out is not nested and out[1] is not inner  # new lists, same shape
    assert all(s.metadata["tags"] == ["tag"] for s in [out[0], *out[1]])
    assert SEEN == [  # as current slime: all hooks on a sample, then the next sample
        ("id", 0, 7),
        ("kw", 0, {"rollout_id": 7, "evaluation": True}),
        ("id", 1, 7),
        ("kw", 1, {"rollout_id": 7, "evaluation": True}),
        ("id", 2, 7),
        ("kw", 2, {"rollout_id": 7, "evaluation": True}),
    ]
    # an explicit rollout_id wins over the current one
    SEEN.clear()
    run(apply_rollout_sample_hooks(hook_args("id_hook"), Sample(index=5), rollout_id=9))
    assert SEEN == [("id", 5, 9)]


def test_hooks_none_configured_and_errors():
    sample = Sample()
    assert run(apply_rollout_sample_hooks(make_args(), sample)) is sample
    with pytest.raises(TypeError, match="expected Sample or None"):
        run(apply_rollout_sample_hooks(hook_args("bad_hook"), Sample()))
    with pytest.raises(TypeError, match="Sample or a list"):
        run(apply_rollout_sample_hooks(hook_args("tag_hook"), "not a sample"))


# ---------------------------------------------------------------- conversion: remove_sample, train_metadata


def test_removed_samples_train_with_a_zero_mask_but_count_in_group_normalisation():
    args = make_args("--n-samples-per-prompt", "2", "--disable-grpo-std-normalization")
    samples = [
        Sample(
            index=i,
            tokens=[1, 2, 3, 4],
            response_length=2,
            reward=float(r),
            train_metadata={"i": i},
            remove_sample=i == 1,
        )
        for i, r in enumerate([1, 0, 1, 1])
    ]
    data = convert_samples_to_train_data(args, samples)
    assert [m.tolist() for m in data["loss_masks"]] == [[1, 1], [0, 0], [1, 1], [1, 1]]
    assert data["rewards"] == [0.5, -0.5, 0.0, 0.0]  # the removed sample still shifts its group's mean
    assert data["metadata"] == [{"i": 0}, {"i": 1}, {"i": 2}, {"i": 3}]


# ---------------------------------------------------------------- --custom-config-path and the start-up table


def test_custom_config_sets_args_after_validation(tmp_path, capsys):
    path = tmp_path / "custom.yaml"
    path.write_text("use_rs: true\ntis_level: token\neps_clip: 0.3\n")
    args = make_args("--custom-config-path", str(path))
    assert (args.use_rs, args.tis_level, args.eps_clip) == (True, "token", 0.3)
    assert args.eps_clip_high == 0.2  # derived from --eps-clip before the override: not re-derived
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(SystemExit):
        make_args("--custom-config-path", str(bad))
    assert f"--custom-config-path {bad}: expected a mapping" in capsys.readouterr().err


def test_custom_tis_function_needs_use_tis_or_mismatch_metrics(capsys):
    with pytest.raises(SystemExit):
        make_args("--custom-tis-function-path", "slime.backends.megatron_utils.loss.icepop_function")
    assert (
        "--custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function is called only with "
        "--use-tis or --get-mismatch-metrics" in capsys.readouterr().err
    )
    make_args(
        "--get-mismatch-metrics", "--custom-tis-function-path", "slime.backends.megatron_utils.loss.icepop_function"
    )


def test_update_weight_post_write_hook_is_refused_at_start_up(capsys):
    with pytest.raises(SystemExit):
        make_args("--custom-update-weight-post-write-path", "my.hook")
    assert "--custom-update-weight-post-write-path" in capsys.readouterr().err


def two_arg_fn(args, rollout_data):
    pass


@pytest.mark.parametrize(
    "flag, good",
    [
        ("--data-source-path", "slime.rollout.data_source.RolloutDataSourceWithBuffer"),
        ("--rollout-sample-hook-path", f"{HERE}.id_hook"),
        ("--custom-advantage-function-path", f"{HERE}.two_arg_fn"),
        ("--custom-tis-function-path", "slime.backends.megatron_utils.loss.vanilla_tis_function"),
        ("--custom-tis-function-path", "slime.backends.megatron_utils.loss.icepop_function"),
    ],
)
def test_startup_table_covers_current_path_flags(flag, good):
    from slime.utils.startup_checks import EXTENSION_POINTS, check_extension_point

    (point,) = [p for p in EXTENSION_POINTS if p.flag == flag]
    assert check_extension_point(point, good) is None
    assert "cannot be called as slime calls it" in check_extension_point(point, f"{HERE}.bad_arity")


def bad_arity():
    pass


def test_every_current_path_flag_parses():
    flags = [
        "--data-source-path",
        "--rollout-sample-hook-path",
        "--rollout-sample-filter-path",
        "--rollout-all-samples-process-path",
        "--custom-convert-samples-to-train-data-path",
        "--custom-rollout-log-function-path",
        "--custom-eval-rollout-log-function-path",
        "--custom-advantage-function-path",
        "--custom-tis-function-path",
        "--custom-pg-loss-reducer-function-path",
        "--custom-model-provider-path",
        "--custom-generate-function-path",
        "--custom-rm-path",
        "--dynamic-sampling-filter-path",
        "--custom-reward-post-process-path",
        "--buffer-filter-path",
        "--rollout-data-postprocess-path",
        "--custom-loss-function-path",
        "--custom-megatron-init-path",
        "--custom-megatron-before-log-prob-hook-path",
        "--custom-megatron-before-train-step-hook-path",
        "--rollout-function-path",
        "--eval-function-path",
    ]
    argv = [x for f in flags for x in (f, "pkg.mod.fn")]
    args = make_args(*argv, "--loss-type", "custom_loss", "--use-tis")
    assert args.custom_tis_function_path == "pkg.mod.fn" and args.rollout_sample_hook_path == ["pkg.mod.fn"]
    assert np.all([getattr(args, f[2:].replace("-", "_")) in ("pkg.mod.fn", ["pkg.mod.fn"]) for f in flags])


# ---------------------------------------------------------------- per-sample generate / RM paths, hooks in generate_and_rm

CALLS = []


async def eval_aware_generate(args, sample, sampling_params, evaluation):
    CALLS.append(("eval_aware", sample.index, evaluation))
    sample.tokens, sample.response, sample.response_length = [1, 2, 3], "x", 1
    sample.status = Sample.Status.COMPLETED
    return sample


async def plain_generate(args, sample, sampling_params):
    CALLS.append(("plain", sample.index))
    sample.tokens, sample.response, sample.response_length = [1, 2], "7", 1
    sample.status = Sample.Status.COMPLETED
    return sample


async def forwarding_generate(args, sample, sampling_params, **kwargs):
    """Forwards its keywords to a callee that takes none: as in current slime, `evaluation=` is not among them."""
    return await plain_generate(args, sample, sampling_params, **kwargs)


async def sample_rm(args, sample, **kwargs):
    return 5.0


def reward_seen_by_hook(args, sample):
    CALLS.append(("hook", sample.index, sample.reward))  # hooks run before the reward


def test_per_sample_generate_and_rm_paths_and_hooks(tiny_kit):
    from slime.rollout.sglang_rollout import GenerateState, generate_and_rm
    from slime.utils.misc import SingletonMeta

    CALLS.clear()
    SingletonMeta.clear_instances(GenerateState)
    args = make_args(
        "--custom-generate-function-path",
        f"{HERE}.plain_generate",
        "--rm-type",
        "answer_match",
        "--rollout-sample-hook-path",
        f"{HERE}.reward_seen_by_hook",
        hf_checkpoint=tiny_kit[0],
    )
    try:
        own = Sample(
            index=0,
            label="x",
            generate_function_path=f"{HERE}.eval_aware_generate",
            custom_rm_path=f"{HERE}.sample_rm",
        )
        out = asyncio.run(generate_and_rm(args, own, {}, evaluation=True))
        flagged = asyncio.run(generate_and_rm(args, Sample(index=1, label="7"), {}, evaluation=False))
        forwarding = Sample(index=2, label="7", generate_function_path=f"{HERE}.forwarding_generate")
        asyncio.run(generate_and_rm(args, forwarding, {}, evaluation=True))
    finally:
        SingletonMeta.clear_instances(GenerateState)
    assert CALLS == [
        ("eval_aware", 0, True),
        ("hook", 0, None),
        ("plain", 1),
        ("hook", 1, None),
        ("plain", 2),
        ("hook", 2, None),
    ]
    assert out.reward == 5.0  # the sample's own RM wins over --rm-type
    assert flagged.reward == 1  # --rm-type answer_match: "7" answers label "7"


# ---------------------------------------------------------------- --custom-model-provider-path


def provider_without_vp(pre_process, post_process):
    return ("no_vp", pre_process, post_process)


def provider_with_vp(pre_process=True, post_process=True, vp_stage=None):
    return ("vp", pre_process, post_process, vp_stage)


def test_custom_model_provider_gets_vp_stage_only_if_declared():
    from slime.backends.megatron_utils.model_provider import get_model_provider_func

    no_vp = get_model_provider_func(make_args("--custom-model-provider-path", f"{HERE}.provider_without_vp"))
    assert no_vp(pre_process=True, post_process=False, vp_stage=1) == ("no_vp", True, False)
    vp = get_model_provider_func(make_args("--custom-model-provider-path", f"{HERE}.provider_with_vp"))
    assert vp(pre_process=False, post_process=True, vp_stage=1) == ("vp", False, True, 1)


def test_megatron_config_overrides_the_actor_role(tmp_path, capsys):
    path = tmp_path / "roles.yaml"
    path.write_text(
        "megatron:\n  - name: policy\n    role: actor\n    overrides:\n      lr: '2e-5'\n"
        "      clip_grad: 0.5\n      num_nodes: 4\n"
    )
    args = make_args("--megatron-config-path", str(path))
    assert (args.lr, args.clip_grad, args.actor_num_nodes) == (2e-5, 0.5, 1)  # numeric string coerced; nodes ignored
    i = BASE.index("--lr")
    args = make_args("--megatron-config-path", str(path), base=BASE[:i] + BASE[i + 2 :])  # --lr from the file only
    assert args.lr == 2e-5 and isinstance(args.lr, float)
    path.write_text("megatron:\n  - name: value\n    role: critic\n    overrides: {lr: 1.0}\n")
    with pytest.raises(SystemExit):
        make_args("--megatron-config-path", str(path))
    assert "a critic role needs --advantage-estimator ppo" in capsys.readouterr().err
    args = make_args("--megatron-config-path", str(path), "--advantage-estimator", "ppo")
    assert (args.lr, args.critic_overrides, args.use_critic) == (1e-6, {"lr": 1.0}, True)  # the actor keeps its lr
    path.write_text("megatron:\n  - role: sampler\n")
    with pytest.raises(SystemExit):
        make_args("--megatron-config-path", str(path))
    assert "role 'sampler'" in capsys.readouterr().err
    path.write_text("megatron:\n  - role: actor\n    overrides: {no_such_flag: 1}\n")
    with pytest.raises(SystemExit):
        make_args("--megatron-config-path", str(path))
    assert "'no_such_flag' is not an argument" in capsys.readouterr().err


def test_append_response_tokens_keeps_masks_and_log_probs_aligned():
    s = Sample(tokens=[1, 2])
    s.append_response_tokens(tokens=[7, 8], log_probs=[-0.1, -0.2], text="ab", meta_info={"weight_version": 3})
    s.append_response_tokens(tokens=[9], trainable=False, text="<tool>")
    s.append_response_tokens(tokens=[10], log_probs=[-0.3], meta_info={"finish_reason": {"type": "length"}})
    assert s.tokens == [1, 2, 7, 8, 9, 10] and s.response == "ab<tool>" and s.response_length == 4
    assert s.loss_mask == [1, 1, 0, 1] and s.rollout_log_probs == [-0.1, -0.2, 0.0, -0.3]
    assert s.status == Sample.Status.TRUNCATED and s.weight_versions == ["3"]
    with pytest.raises(ValueError, match="need their rollout log-probs"):
        s.append_response_tokens(tokens=[1])
    with pytest.raises(ValueError, match="log_probs length 1 != tokens length 2"):
        s.append_response_tokens(tokens=[1, 2], log_probs=[0.0])
    with pytest.raises(ValueError, match="no rollout_log_probs"):
        Sample(response_length=2, tokens=[1, 2, 3]).append_response_tokens(tokens=[4], log_probs=[-1.0])


def test_append_response_tokens_records_what_each_turn_was_sampled_with():
    """A multi-turn generate function's turns are scored at what they were sampled with: the CPU server's echo when
    the engine sends one, else the request's parameters when the caller passes them; tool tokens get no record and
    an unrecorded turn keeps the flag's temperature."""
    s = Sample(tokens=[1, 2])
    echo = applied_sampling_params({"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    s.append_response_tokens(tokens=[7, 8], log_probs=[-0.1, -0.2], meta_info={"sampling_params": echo})
    s.append_response_tokens(tokens=[9], trainable=False, meta_info={"sampling_params": echo})
    s.append_response_tokens(tokens=[10], log_probs=[-0.3], meta_info={}, sampling_params={"temperature": 1.4})
    s.append_response_tokens(tokens=[11], log_probs=[-0.4], meta_info={})
    records = s.metadata["sampling_params"]
    assert [(r["response_span"], r["origin"], r["temperature"]) for r in records] == [
        ([0, 2], "engine echo", 0.6),
        ([3, 4], "request", 1.4),
    ]
    assert records[0]["top_k"] == 20 and records[0]["top_p"] == 0.9 and records[1]["top_k"] == -1
    assert all(r["source"] == "Sample.append_response_tokens" for r in records)
    assert response_temperatures(s, 1.0).tolist() == pytest.approx([0.6, 0.6, 1.0, 1.4, 1.0])


def test_append_response_tokens_extends_the_lists_a_generate_function_holds():
    """Current slime's retool example keeps `masks = sample.loss_mask` before its turns and assigns it back after:
    the appends must land in that same list."""
    s = Sample(tokens=[1, 2], loss_mask=[])
    masks, log_probs = s.loss_mask, []
    s.rollout_log_probs = log_probs
    s.append_response_tokens(tokens=[7], log_probs=[-0.5])
    s.append_response_tokens(tokens=[9], trainable=False)
    s.loss_mask = masks
    assert s.loss_mask == [1, 0] and log_probs == [-0.5, 0.0]
