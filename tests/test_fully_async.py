"""Fully async rollout (`train_async.py --rollout-function-path slime.rollout.fully_async_rollout.
generate_rollout_fully_async`): the staleness bound, on-policy at K=0, eval on pinned versions, exactly-once across a
crash and resume. The bound is asserted from what every trained sample recorded: the weight version of each of its
generation segments (`Sample.weight_versions`); the trainer's weights at rollout r are version r + 1."""

import asyncio
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch

import train_async as async_driver
from slime.rollout import fully_async_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.fully_async_rollout import Group, select_batch, staleness
from slime.rollout.sglang_rollout import generate
from slime.utils.types import Sample
from slime.utils.user_errors import UserCodeError
from tests.test_e2e import make_args, read_metrics

FULLY_ASYNC = [
    "--rollout-function-path",
    "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
    "--rollout-num-gpus",
    "1",
]


# ---------------------------------------------------------------------------------------------- batch selection
def groups(*start_versions, first_gid=0):
    return [Group(first_gid + i, v, []) for i, v in enumerate(start_versions)]


def test_staleness_counts_from_the_first_segments_weights_and_refuses_an_unknown_label():
    """A sample's staleness is measured from the weights of its first segment; engines start at version 0 (the
    --hf-checkpoint weights), so "0" is the initial weights and any non-integer label (SGLang's "default": an engine
    slime did not label) is an error naming the sample, not silently version 0."""
    assert staleness(Sample(weight_versions=["3", "4"]), trainer_version=5, start_version=3) == 2
    assert staleness(Sample(weight_versions=["0", "4"]), trainer_version=5, start_version=4) == 5
    assert staleness(Sample(), trainer_version=5, start_version=4) == 1  # no version reported: its admission's
    with pytest.raises(RuntimeError, match=r"sample 17 .*weight version 'default'"):
        staleness(Sample(index=17, weight_versions=["default", "4"]), trainer_version=5, start_version=4)


def test_select_batch_takes_the_oldest_finished_groups_first():
    finished = groups(2, 1, 2, 1)
    assert [g.gid for g in select_batch(finished, [], 2, trainer_version=2, max_staleness=1)] == [1, 3]


def test_select_batch_waits_for_a_straggler_that_cannot_wait_any_longer():
    # K=1, trainer at version 3: the group started at version 2 is due now; it is still running, so no batch.
    finished, running = groups(3, 3, 3), groups(2, first_gid=3)
    assert select_batch(finished, running, 2, trainer_version=3, max_staleness=1) is None
    # once it finished it goes first
    chosen = select_batch(finished + running, [], 2, trainer_version=3, max_staleness=1)
    assert [g.start_version for g in chosen] == [2, 3]


def test_select_batch_keeps_later_batches_feasible():
    # K=2, batches of 2, trainer at version 3: four groups started at version 2 must all be trained by version 4.
    # One finished, three running; two version-3 groups finished. Taking (v2, v3) now would leave three v2 groups
    # for the one batch at version 4: the trainer waits instead.
    finished, running = groups(2, 3, 3), groups(2, 2, 2, first_gid=3)
    assert select_batch(finished, running, 2, trainer_version=3, max_staleness=2) is None
    # a second v2 group finishes: (v2, v2) now, the other two v2 groups fit the next batch
    chosen = select_batch(finished + running[:1], running[1:], 2, trainer_version=3, max_staleness=2)
    assert [(g.gid, g.start_version) for g in chosen] == [(0, 2), (3, 2)]


def test_select_batch_with_k0_takes_exactly_the_groups_of_the_current_version():
    assert select_batch(groups(1, 1), groups(1, first_gid=2), 3, trainer_version=1, max_staleness=0) is None
    chosen = select_batch(groups(1, 1, 1), [], 3, trainer_version=1, max_staleness=0)
    assert sorted(g.gid for g in chosen) == [0, 1, 2]


# ---------------------------------------------------------------------------------------------- worker, no engines
@pytest.fixture
def one_fully_async_batch(tiny_kit, tmp_path, monkeypatch):
    """`generate_rollout_fully_async` for rollout 0 at K=0 (2 groups live at a time, so admission order is fixed) on
    a real data source, with `generate_and_rm_group` replaced by `fake(args, samples)`; the worker is stopped after."""
    from slime.utils import async_utils

    monkeypatch.setattr(fully_async_rollout, "GenerateState", lambda args: SimpleNamespace(sampling_params={}))
    monkeypatch.setattr(fully_async_rollout, "run", lambda coro: async_utils.run(coro, timeout=60))
    monkeypatch.setattr(fully_async_rollout, "_worker", None)

    def take(fake, *extra):
        async def generate_and_rm_group(args, samples, sampling_params, evaluation):
            await asyncio.sleep(0)
            return fake(args, samples)

        monkeypatch.setattr(fully_async_rollout, "generate_and_rm_group", generate_and_rm_group)
        args = make_args(tiny_kit, tmp_path, *FULLY_ASYNC, "--rollout-batch-size", "2", "--max-staleness", "0", *extra)
        return fully_async_rollout.generate_rollout_fully_async(args, 0, RolloutDataSourceWithBuffer(args))

    yield take

    async def stop(worker):
        for task in list(worker.tasks.values()):
            task.cancel()

    if fully_async_rollout._worker is not None:
        async_utils.run(stop(fully_async_rollout._worker), timeout=10)


def rewarded(samples, *rewards):
    for s, r in zip(samples, rewards):
        s.reward, s.status = r, Sample.Status.COMPLETED
    return samples


def test_a_group_the_dynamic_filter_rejects_is_dropped_counted_and_its_slot_admitted_again(one_fully_async_batch):
    """docs/async.md: even groups all reward 1 (zero std: dropped), odd ones 0 and 1 (kept); only 2 groups are
    live, so the batch exists only if each dropped group's slot was admitted again."""
    out = one_fully_async_batch(
        lambda args, samples: rewarded(samples, *([1.0] * 4 if samples[0].group_index % 2 == 0 else [0.0, 1.0] * 2)),
        "--dynamic-sampling-filter-path",
        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std",
    )
    assert [g[0].group_index for g in out.samples] == [1, 3]
    assert out.metrics["rollout/dynamic_filter/drop"] == 2  # groups 0 and 2
    assert out.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 2


def test_a_group_whose_generation_raises_is_retried_from_its_prompt_then_dropped_after_3(
    one_fully_async_batch, caplog
):
    """docs/async.md: group 0 raises twice then succeeds (trained, fully_async_failures 2); group 1 always raises
    (dropped after 3 failures, an error in the log, drop_generation_error 1); group 2 takes its slot."""
    caplog.set_level(logging.WARNING, logger="slime.rollout.fully_async_rollout")
    attempts = {}

    def flaky(args, samples):
        g = samples[0].group_index
        attempts[g] = attempts.get(g, 0) + 1
        assert samples[0].response == "" and samples[0].reward is None  # from its prompt, not a partial result
        if g == 1 or (g == 0 and attempts[g] <= 2):
            raise RuntimeError(f"engine error on group {g}")
        return rewarded(samples, 0.0, 1.0, 0.0, 1.0)

    out = one_fully_async_batch(flaky)
    assert [g[0].group_index for g in out.samples] == [0, 2]
    assert [s.metadata.get("fully_async_failures") for s in out.samples[0]] == [2] * 4
    assert all("fully_async_failures" not in s.metadata for s in out.samples[1])
    assert attempts[0] == 3 and attempts[1] == 3
    assert out.metrics["rollout/dynamic_filter/drop"] == 1
    assert out.metrics["rollout/dynamic_filter/drop_generation_error"] == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "fully async: dropping prompt group 1 after 3 failed generations; last error: RuntimeError: engine error on "
        "group 1"
    ]


# ---------------------------------------------------------------------------------------------- end to end
def slow_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    """--custom-megatron-before-train-step-hook-path: a deliberately slow trainer."""
    time.sleep(1.5)


def crash_at_rollout_3(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    slow_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)
    if rollout_id == 3:
        raise RuntimeError("simulated crash at rollout 3")


async def slow_generate(args, sample, sampling_params):
    """--custom-generate-function-path: a deliberately slow engine. Every request goes through the default generate
    and runs to its token budget; every third prompt's budget is 56x the others' (stragglers: the tiny model's whole
    context). So that a weight update surely lands while stragglers run, however fast the trainer is against the
    engine, they start only once the trainer is about to push version 2 (see `push_when_stragglers_run`)."""
    straggler = sample.group_index % 3 == 0
    budget = sampling_params["max_new_tokens"] // (1 if straggler else 56)
    if straggler:
        marks = os.path.dirname(args.save_debug_rollout_data)
        await asyncio.to_thread(wait_for, os.path.join(marks, "pushing_2"))
        open(os.path.join(marks, "straggler_started"), "a").close()
    return await generate(args, sample, dict(sampling_params, max_new_tokens=budget, ignore_eos=True))


def wait_for(path, timeout=300):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"waited {timeout}s for {path}"
        time.sleep(0.05)


def push_when_stragglers_run(monkeypatch, marks):
    """The driver's push of version 2 lets the stragglers start, and goes on once they have run for half a second
    (a few dozen of their 448 tokens)."""
    push = async_driver.Run.push_weights

    def gated(run, weight_version=None):
        if weight_version == 2:
            open(marks / "pushing_2", "a").close()
            wait_for(marks / "straggler_started")
            time.sleep(0.5)
        return push(run, weight_version)

    monkeypatch.setattr(async_driver.Run, "push_weights", gated)


def trained_batches(pattern, rollout_ids):
    return {r: torch.load(str(pattern).format(rollout_id=r), weights_only=False)["samples"] for r in rollout_ids}


def lags(batches):
    """Per trained sample: trainer version (rollout id + 1) minus the version of its first generated segment."""
    return [r + 1 - int(s["weight_versions"][0]) for r, samples in batches.items() for s in samples]


@pytest.mark.slow
def test_slow_trainer_staleness_bound_eval_versions_and_exactly_once_across_crash_and_resume(
    ray_session, tiny_kit, tmp_path
):
    ckpt = tmp_path / "ckpt"
    common = [
        *FULLY_ASYNC,
        "--max-policy-version-lag",
        "1",
        "--rollout-shuffle",
        "--save",
        str(ckpt),
        "--save-interval",
        "1",
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        "addition",
        f"{tiny_kit[1]}/eval.jsonl",
        "--eval-temperature",
        "0",
    ]
    first = tmp_path / "first"
    first.mkdir()
    with pytest.raises(UserCodeError, match="simulated crash"):  # the hook's own error, named by its flag
        async_driver.train(
            make_args(
                tiny_kit,
                first,
                *common,
                "--custom-megatron-before-train-step-hook-path",
                f"{__name__}.crash_at_rollout_3",
                "--save-debug-rollout-data",
                str(first / "r_{rollout_id}.pt"),
                num_rollout=5,
            )
        )
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    second = tmp_path / "second"
    second.mkdir()
    args = make_args(
        tiny_kit,
        second,
        *common,
        "--load",
        str(ckpt),
        "--custom-megatron-before-train-step-hook-path",
        f"{__name__}.slow_train_step",
        "--save-debug-rollout-data",
        str(second / "r_{rollout_id}.pt"),
        num_rollout=5,
    )
    assert args.max_staleness == 1
    async_driver.train(args)

    batches = {
        **trained_batches(first / "r_{rollout_id}.pt", [0, 1, 2]),
        **trained_batches(second / "r_{rollout_id}.pt", [3, 4]),
    }
    observed = lags(batches)
    # the engines run ahead of the slow trainer exactly as far as the bound lets them
    assert max(observed) == 1 and min(observed) == 0

    # every prompt group handed out by the data source is trained exactly once or still waits in the saved state
    trained = [s["group_index"] for samples in batches.values() for s in samples[::4]]
    assert len(trained) == len(set(trained)) == 5 * 4
    state = torch.load(ckpt / "rollout" / "global_dataset_state_dict_4.pt", weights_only=False)
    fully_async = state["rollout_states"]["fully_async"]
    waiting = [q["samples"][0]["group_index"] for q in fully_async["queued"]]
    waiting += [g[0]["group_index"] for g in fully_async["in_flight"]] + [g[0]["group_index"] for g in state["buffer"]]
    assert not set(waiting) & set(trained)
    assert sorted(waiting + trained) == list(range(state["sample_group_index"]))
    # saved after training rollout 4, before its push: the engines served version 5, the weights after rollout 3
    assert state["weight_version"] == 5

    # evals: before training (weights 1) and after rollout 3 (weights 5) are waited for; the one after rollout 1 ran
    # while rollout 2 trained and is reported if it finished before the crash. Each says what it measured.
    evals = [r for r in read_metrics(first) + read_metrics(second) if "eval/addition" in r]
    measured = {(r["eval/step"], r["eval/weight_version"]) for r in evals}
    assert {(0, 1), (3, 5)} <= measured <= {(0, 1), (1, 3), (3, 5)}, measured
    for r in evals:
        assert r["eval/lag_steps"] == r["rollout_id"] - r["eval/step"] >= 0
        assert r["eval/weight_version"] in (1, r["eval/step"] + 2)
    rows = read_metrics(second)
    assert [r["rollout_id"] for r in rows] == [3, 4]
    for r in rows:
        assert r["rollout/staleness_max"] <= 1 and 0 <= r["perf/trainer_wait_frac"] <= 1
        assert 0 <= r["perf/engine_idle_frac"] <= 1 and r["rollout/queue_depth"] >= 0


@pytest.mark.slow
def test_slow_engine_keeps_the_bound_and_resumes_requests_across_weight_updates(
    ray_session, tiny_kit, tmp_path, monkeypatch
):
    push_when_stragglers_run(monkeypatch, tmp_path)
    args = make_args(
        tiny_kit,
        tmp_path,
        *FULLY_ASYNC,
        "--max-staleness",
        "1",
        "--rollout-max-response-len",
        "448",
        "--custom-generate-function-path",
        f"{__name__}.slow_generate",
        "--save-debug-rollout-data",
        str(tmp_path / "r_{rollout_id}.pt"),
        num_rollout=4,
    )
    async_driver.train(args)
    batches = trained_batches(tmp_path / "r_{rollout_id}.pt", range(4))
    assert max(lags(batches)) <= 1
    # requests cut by a weight update were resumed under the new weights: one version per request, in order
    resumed = [s for samples in batches.values() for s in samples if len(set(s["weight_versions"])) > 1]
    assert resumed, [(s["group_index"], s["weight_versions"]) for samples in batches.values() for s in samples[::4]]
    for s in resumed:
        versions = [int(v) for v in s["weight_versions"]]
        assert versions == sorted(versions)
        # nothing generated before the cut was lost or generated twice: exactly the budget, one log-prob per token,
        # after the same prompt tokens as every other sample of its group
        budget = 448 if s["group_index"] % 3 == 0 else 448 // 56  # see slow_generate
        assert s["response_length"] == budget == len(s["rollout_log_probs"])
        siblings = [t for samples in batches.values() for t in samples if t["group_index"] == s["group_index"]]
        assert len(siblings) == 4
        assert all(t["tokens"][: -t["response_length"]] == s["tokens"][:-budget] for t in siblings)


@pytest.mark.slow
@pytest.mark.parametrize(
    "lora",
    # LoRA adapters, only they sent to the engine, moved visibly by a large LR: still exactly on policy
    [[], ["--enable-lora", "--lora-sync", "adapter", "--lr", "3e-2", "--entropy-coef", "0.01"]],
    ids=["full", "lora_adapter"],
)
def test_max_staleness_0_is_on_policy(ray_session, tiny_kit, tmp_path, lora):
    args = make_args(
        tiny_kit,
        tmp_path,
        *FULLY_ASYNC,
        *lora,
        "--max-staleness",
        "0",
        "--save-debug-rollout-data",
        str(tmp_path / "r_{rollout_id}.pt"),
        num_rollout=3,
    )
    async_driver.train(args)
    batches = trained_batches(tmp_path / "r_{rollout_id}.pt", range(3))
    for r, samples in batches.items():
        assert {v for s in samples for v in s["weight_versions"]} == {str(r + 1)}
        # the same prompts, in the same order, as a synchronous run: the next 4 groups of the data source
        assert [s["group_index"] for s in samples[::4]] == [4 * r + i for i in range(4)]
    rows = read_metrics(tmp_path)
    assert [r["rollout/staleness_max"] for r in rows] == [0, 0, 0]
    # the trainer recomputes exactly the log-probs the engine sampled with: same weights
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rows)
