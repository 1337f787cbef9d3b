"""Default rollout (`slime.rollout.sglang_rollout`) against slime's real CPU inference server behind the real
sglang-router, on the tiny kit: generation, rewards (rule, custom, group), dynamic and over-sampling filters,
abort + partial rollout resumed in the next rollout, eval, and the RolloutController running it inside Ray."""

import copy
import json
import os
import uuid
from collections import Counter

import pytest

from slime.backends.sglang_utils.router import add_worker, start_router, stop_router
from slime.rollout import sglang_rollout
from slime.rollout.data_source import RolloutDataSourceWithBuffer
from slime.rollout.filter_hub.over_sampling_filters import sort_by_reward_std
from slime.rollout.sglang_rollout import GenerateState, generate, generate_rollout
from slime.rollout.sglang_streaming_rollout import generate_streaming
from slime.utils.async_utils import run
from slime.utils.misc import SingletonMeta
from slime.utils.types import Sample
from tests._args import make_args as real_args
from tests.test_cpu_server import start_cpu_server, stop_cpu_server

HERE = "tests.test_sglang_rollout"
# Response budgets of the "short" and "long" groups in the abort tests. The gaps are the margins of their races: a
# long group must still run when the abort after the short ones lands (LONG - SHORT tokens later), and, resumed with
# LONG - SHORT left, finish before a fresh long group admitted with it (SHORT tokens behind) even when the requests
# reach the engine some steps apart on a loaded machine. LONG + the 15-token prompts fits the tiny model's context.
SHORT, LONG = 96, 448


# ------------------------------------------------------------------ plug-ins loaded by path

RECORD = {}


async def response_length_rm(args, sample, **kwargs):
    """Custom RM: the response length (varies with sampling, is known exactly from the sample)."""
    return float(sample.response_length)


async def failing_rm(args, sample, **kwargs):
    if sample.index == 3:
        raise ValueError("grader crashed on sample 3")
    return 0.0


async def parity_rm(args, sample, **kwargs):
    return float(sample.index % 2)


async def group_rank_rm(args, samples, **kwargs):
    """Group RM: called once per group with the whole list."""
    RECORD.setdefault("group_rm_sizes", []).append(len(samples))
    RECORD.setdefault("group_rm_masks", []).append([s.loss_mask for s in samples])
    return [float(i) for i in range(len(samples))]


async def group_1_hangs_once(args, sample, sampling_params):
    """Custom generate: the first attempt at group 1 never finishes (a straggler); everything else generates."""
    import asyncio

    if sample.group_index == 1 and not RECORD.get("hung"):
        RECORD["hung"] = True
        await asyncio.sleep(3600)
    return await generate(args, sample, sampling_params)


async def sample_1_gives_up_once(args, sample, sampling_params):
    """Custom generate: the first attempt at sample 1 comes back aborted after 3 tokens, as an engine's abort leaves
    a sample (what it generated so far kept)."""
    if sample.index == 1 and not RECORD.get("partial"):
        sample = await generate(args, sample, {**sampling_params, "max_new_tokens": 3, "ignore_eos": True})
        sample.status, RECORD["partial"] = Sample.Status.ABORTED, list(sample.tokens)
        return sample
    return await generate(args, sample, sampling_params)


async def always_aborts(args, sample, sampling_params):
    sample.status = Sample.Status.ABORTED
    return sample


def drop_odd_groups(args, samples, **kwargs):
    """Dynamic filter: keep even group_index; records the accounting state it sees."""
    state = GenerateState(args)
    RECORD.setdefault("filter_calls", []).append(
        (state.remaining_batch_size, RECORD["submitted"], len(RECORD.get("drops", [])))
    )
    keep = samples[0].group_index % 2 == 0
    if not keep:
        RECORD.setdefault("drops", []).append(samples[0].group_index)
    return keep


def recording_over_sampling_filter(args, groups, **kwargs):
    RECORD["over_sampling_input"] = [[s.to_dict() for s in g] for g in groups]
    return sort_by_reward_std(args, groups)


def _short_or_long(sample, sampling_params):
    """Even groups stop after SHORT tokens, odd ones run their whole budget (EOS ignored by both)."""
    if sample.group_index % 2 == 0 and sample.response_length == 0:
        sampling_params["max_new_tokens"] = SHORT
    sampling_params["ignore_eos"] = True


async def short_and_long_generate(args, sample, sampling_params):
    """Custom generate: the default generate with `_short_or_long`'s budgets."""
    _short_or_long(sample, sampling_params)
    return await generate(args, sample, sampling_params)


async def short_and_long_streaming(args, sample, sampling_params):
    """The same through the streaming generate function."""
    _short_or_long(sample, sampling_params)
    return await generate_streaming(args, sample, sampling_params)


async def instant_generate(args, sample, sampling_params):
    """Custom generate that answers at once (no engine): every submitted group finishes in the rollout's first wait."""
    RECORD.setdefault("generated", []).append(sample.group_index)
    sample.tokens, sample.response, sample.response_length = [1, 2, 3], "3", 1
    sample.status = Sample.Status.COMPLETED
    return sample


async def pre_scored_generate(args, sample, sampling_params):
    """Custom generate that sets the reward itself: the RM must not overwrite it."""
    sample = await generate(args, sample, sampling_params)
    sample.reward = -1.0
    return sample


async def two_agents_generate(args, sample, sampling_params):
    """Custom generate returning a list: one prompt becomes two samples (e.g. two cooperating agents)."""
    out = []
    for agent in range(2):
        s = copy.deepcopy(sample)
        s.tokens, s.response, s.response_length = [1, 5, 6, 7 + agent], "x", 1
        s.status, s.metadata = Sample.Status.COMPLETED, {"agent": agent}
        out.append(s)
    return out


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def engine(tiny_kit):
    """One CPU inference server registered with one real sglang-router. Yields the router namespace."""
    model_dir, _ = tiny_kit
    # as slime launches its engines: the --hf-checkpoint weights are version 0
    flags = ["--random-seed", "0", "--weight-version", "0", "--max-running-requests", "64", "--log-level", "warning"]
    server, url = start_cpu_server(model_dir, *flags)
    router_args = real_args()
    router = None
    try:
        router = start_router(router_args)
        add_worker(f"http://{router_args.sglang_router_ip}:{router_args.sglang_router_port}", url)
        yield router_args
    finally:
        stop_router(router)
        stop_cpu_server(server)


@pytest.fixture(scope="module")
def prompts(tiny_kit, tmp_path_factory):
    """A train file of 8 distinct addition prompts and an eval file of 3."""
    d = tmp_path_factory.mktemp("prompts")
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a}+{a + 1}?"}], "label": str(2 * a + 1)} for a in range(8)
    ]
    for name, subset in [("train.jsonl", rows), ("eval.jsonl", rows[:3])]:
        with open(d / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in subset)
    return str(d / "train.jsonl"), str(d / "eval.jsonl")


@pytest.fixture(autouse=True)
def fresh_state():
    SingletonMeta.clear_instances(GenerateState)
    sglang_rollout.EVAL_PROMPT_DATASET.clear()
    RECORD.clear()
    yield
    SingletonMeta.clear_instances(GenerateState)


def make_args(engine, tiny_kit, prompts, *argv, **overrides):
    base = dict(
        hf_checkpoint=tiny_kit[0],
        sglang_router_ip=engine.sglang_router_ip,
        sglang_router_port=engine.sglang_router_port,
        sglang_server_concurrency=64,
        rollout_num_gpus=1,
        rollout_num_gpus_per_engine=1,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=8,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        custom_generate_function_path=None,
        custom_rm_path=None,
        rm_type="answer_match",
        reward_key=None,
        group_rm=False,
        partial_rollout=False,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        over_sampling_batch_size=None,
        dynamic_sampling_filter_path=None,
        over_sampling_filter_path=None,
        rollout_global_dataset=True,
        prompt_data=prompts[0],
        input_key="prompt",
        label_key="label",
        metadata_key="metadata",
        tool_key=None,
        apply_chat_template=True,
        rollout_max_prompt_len=None,
        rollout_seed=42,
        rollout_shuffle=False,
        buffer_filter_path=None,
        dump_details=None,
        save=None,
        load=None,
        eval_prompt_data=None,
        eval_input_key=None,
        eval_label_key=None,
        eval_tool_key=None,
        eval_temperature=None,
        eval_top_p=None,
        eval_top_k=None,
        eval_max_response_len=None,
        n_samples_per_eval_prompt=1,
        eval_reward_key=None,
        rollout_sample_hook_path=[],
        rollout_sample_filter_path=None,
        rollout_all_samples_process_path=None,
        rollout_request_timeout=None,
        rollout_group_timeout=None,
    )
    base.update(overrides)
    return real_args(*argv, **base)


def check_generated(sample, tokenizer, max_len):
    prompt_ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    assert sample.tokens[: len(prompt_ids)] == prompt_ids
    assert len(sample.tokens) == len(prompt_ids) + sample.response_length
    assert 0 < sample.response_length <= max_len
    assert len(sample.rollout_log_probs) == sample.response_length
    assert all(lp <= 0 for lp in sample.rollout_log_probs)
    assert sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
    if sample.status == Sample.Status.TRUNCATED:
        assert sample.response_length == max_len
    elif sample.response_length < max_len:  # stopped early: on an EOS id of the tiny kit (<|im_end|>=2, pad 0)
        assert sample.tokens[-1] in (0, 2)
    assert sample.weight_versions == ["0"]
    # the engine's per-token spans (SGLang 0.5.23's meta_info.weight_versions) placed over the response
    assert sample.weight_version_spans == [{"version": "0", "start": 0, "end": sample.response_length}]


# ------------------------------------------------------------------ tests


def test_generate_rollout_default_path(engine, tiny_kit, prompts):
    args = make_args(engine, tiny_kit, prompts, rollout_batch_size=3, n_samples_per_prompt=2)
    ds = RolloutDataSourceWithBuffer(args)
    state, texts = GenerateState(args), Counter()
    real = state.tokenizer

    class CountingTokenizer:  # the texts the generate tokenises
        def __call__(self, text, **kw):
            texts[text] += 1
            return real(text, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    state.tokenizer = CountingTokenizer()
    groups = generate_rollout(args, 0, ds)
    state.tokenizer = real
    assert len(groups) == 3 and all(len(g) == 2 for g in groups)
    assert texts == Counter(g[0].prompt for g in groups)  # a group's prompt tokenised once, not once per sample
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3], [4, 5]]
    assert [g[0].label for g in groups] == ["1", "3", "5"]
    tokenizer = GenerateState(args).tokenizer
    for group in groups:
        for s in group:
            check_generated(s, tokenizer, 8)
            assert s.reward in (0, 1)  # answer_match (rule RM through rm_hub)
            assert s.response == tokenizer.decode(s.tokens[-s.response_length :])
    assert ds.get_buffer_length() == 0
    assert groups.metrics == {}
    # the next rollout continues with the next prompts
    assert [g[0].label for g in generate_rollout(args, 1, ds)] == ["7", "9", "11"]


def _recording_posts(monkeypatch):
    """The /generate bodies the default rollout sends through the router (the real `post`, observed)."""
    bodies, real_post = [], sglang_rollout.post

    async def recording_post(url, payload, **kw):
        if url.endswith("/generate"):
            bodies.append(copy.deepcopy(payload))
        return await real_post(url, payload, **kw)

    monkeypatch.setattr(sglang_rollout, "post", recording_post)
    return bodies


def test_a_groups_fresh_samples_go_out_as_one_batch_request(engine, tiny_kit, prompts, monkeypatch):
    """Each group of 4 is one /generate with 4 input_ids; every sample gets what the per-sample path gives it: greedy,
    the same tokens and log-probs (the engine batches both alike) and its own sampling record."""
    shape = dict(rollout_batch_size=2, n_samples_per_prompt=4, rollout_temperature=0.0)
    args = make_args(engine, tiny_kit, prompts, **shape)
    bodies = _recording_posts(monkeypatch)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(bodies) == 2
    for body, group in zip(sorted(bodies, key=lambda b: b["input_ids"][0]), sorted(groups, key=lambda g: g[0].tokens)):
        assert body["input_ids"] == [s.tokens[: len(s.tokens) - s.response_length] for s in group]
        assert isinstance(body["sampling_params"], dict)  # one for all: sglang-router takes no list here
    tokenizer = GenerateState(args).tokenizer
    for s in (s for g in groups for s in g):
        check_generated(s, tokenizer, 8)
        (record,) = s.metadata["sampling_params"]
        assert record["response_span"] == [0, s.response_length] and record["source"] == sglang_rollout.GENERATE

    bodies.clear()  # the same prompts one request per sample
    SingletonMeta.clear_instances(GenerateState)
    args = make_args(engine, tiny_kit, prompts, "--rollout-request-per-sample", **shape)
    alone = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert len(bodies) == 8 and all(isinstance(b["input_ids"][0], int) for b in bodies)
    assert [[s.tokens for s in g] for g in alone] == [[s.tokens for s in g] for g in groups]
    for a, b in zip((s for g in alone for s in g), (s for g in groups for s in g)):
        assert a.rollout_log_probs == pytest.approx(b.rollout_log_probs, abs=1e-5)
        assert a.metadata["sampling_params"] == b.metadata["sampling_params"]

    # outputs land on their own samples: two different prompts in one batch, each as its own request gives it
    two = [Sample(index=i, prompt=p) for i, p in enumerate(["What is 1+2?", "Tell me a long story"])]
    params = dict(GenerateState(args).sampling_params, temperature=0.0)
    batched = run(sglang_rollout.generate_group(args, copy.deepcopy(two), params))
    single = [run(generate(args, s, dict(params))) for s in copy.deepcopy(two)]
    assert [s.tokens for s in batched] == [s.tokens for s in single] and batched[0].tokens != batched[1].tokens

    # sampled (temperature 1): each sample of a batch draws on its own
    SingletonMeta.clear_instances(GenerateState)
    args = make_args(engine, tiny_kit, prompts, **dict(shape, rollout_temperature=1.0))
    for group in generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)):
        assert len({tuple(s.tokens) for s in group}) > 1


@pytest.mark.parametrize(
    "case",
    [
        "default",
        "evaluation with top-p",
        "custom generate",
        "sample's own generate",
        "deterministic",
        "top-p replay",
        "routing replay",
        "resumed",
        "images",
        "one sample",
        "over the concurrency",
        "--rollout-request-per-sample",
        "sessions under consistent hashing",
    ],
)
def test_only_groups_of_fresh_text_samples_the_default_generate_sends_alone_become_one_request(
    engine, tiny_kit, prompts, case
):
    argv, overrides = [], {"n_samples_per_prompt": 4}
    if case == "evaluation with top-p" or case == "top-p replay":
        overrides.update(rollout_top_p=0.9)
    if case == "custom generate":
        overrides.update(custom_generate_function_path=f"{HERE}.short_and_long_generate")
    if case == "deterministic":
        argv.append("--deterministic-mode")
    if case == "routing replay":
        overrides.update(use_rollout_routing_replay=True)
    if case == "--rollout-request-per-sample":
        argv.append(case)
    if case == "sessions under consistent hashing":
        overrides.update(router_policy="consistent_hashing")
    if case == "over the concurrency":
        overrides.update(sglang_server_concurrency=3)
    args = make_args(engine, tiny_kit, prompts, *argv, **overrides)
    group = [Sample(index=i, prompt="What is 1+2?") for i in range(1 if case == "one sample" else 4)]
    if case == "sample's own generate":
        group[2].generate_function_path = f"{HERE}.short_and_long_generate"
    if case == "resumed":
        group[1].response_length, group[1].status = 2, Sample.Status.ABORTED
    if case == "images":
        group[0].multimodal_inputs = {"images": ["a.png"]}
    if case == "sessions under consistent hashing":  # each its own engine; one session would be one request
        for i, s in enumerate(group):
            s.session_id = f"session-{i}"
    expected = case in ("default", "evaluation with top-p")
    assert sglang_rollout._one_request(args, group, case == "evaluation with top-p") is expected


def test_group_slots_are_taken_whole_so_two_groups_never_wait_on_each_other(engine, tiny_kit, prompts):
    """Concurrency 4, two groups of 3 queued behind a holder of all 4: taken slot by slot they could split 2 + 2 and
    wait forever; a group cancelled while waiting gives back what it took."""
    import asyncio

    args = make_args(engine, tiny_kit, prompts, sglang_server_concurrency=4)
    state = GenerateState(args)
    peak, held = [0], [0]

    async def group(n, hold=0.01):
        async with state.slots(n):
            held[0] += n
            peak[0] = max(peak[0], held[0])
            await asyncio.sleep(hold)
            held[0] -= n

    async def scenario():
        first = asyncio.create_task(group(4, hold=0.05))
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(first, group(3), group(3)), 10)
        blocker = asyncio.create_task(group(2, hold=0.2))
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(group(3))  # takes 2 of 3, then waits
        await asyncio.sleep(0.05)
        cancelled.cancel()
        await asyncio.gather(blocker, cancelled, return_exceptions=True)
        await asyncio.wait_for(group(4), 10)  # every slot came back

    run(scenario())
    assert peak[0] == 4


def test_a_batch_request_holds_one_concurrency_slot_per_sample(tiny_kit, prompts, monkeypatch):
    """docs/usage.md: a group sent as one batch /generate holds one --sglang-server-concurrency slot per sample while
    it runs, as n separate requests would, and gives them all back. No engine: the batch call is a stand-in."""
    args = make_args(
        real_args(sglang_router_ip="127.0.0.1", sglang_router_port=9), tiny_kit, prompts, sglang_server_concurrency=4
    )
    state = GenerateState(args)
    assert state.concurrency == 4  # 4 per engine x 1 GPU // 1 GPU per engine
    free_while_running = []

    async def fake_generate_group(args, group, sampling_params):
        free_while_running.append(state.semaphore._value)
        for s in group:
            s.tokens, s.response, s.response_length = [1, 5, 6], "x", 1
            s.status, s.reward = Sample.Status.COMPLETED, 1.0
        return group

    monkeypatch.setattr(sglang_rollout, "generate_group", fake_generate_group)
    group = [Sample(index=i, prompt="What is 1+2?") for i in range(3)]
    assert sglang_rollout._one_request(args, group, False)
    out = run(sglang_rollout.generate_and_rm_one_request(args, group, dict(state.sampling_params)), timeout=60)
    assert free_while_running == [4 - 3]
    assert state.semaphore._value == 4  # every slot given back
    assert [s.status for s in out] == [Sample.Status.COMPLETED] * 3 and [s.reward for s in out] == [1.0] * 3


def test_top_p_rollout_records_each_steps_kept_set_through_the_router(engine, tiny_kit, prompts):
    from slime.ray.buffer import convert_samples_to_train_data
    from slime.utils.top_p_replay import kept_sets_error

    args = make_args(engine, tiny_kit, prompts, "--deterministic-mode", rollout_top_p=0.9, rollout_top_k=20)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    samples = [s for g in groups for s in g]
    for s in samples:
        assert kept_sets_error(s) is None, kept_sets_error(s)
        offsets = s.rollout_top_p_token_offsets
        assert all(1 <= b - a <= 20 for a, b in zip(offsets, offsets[1:]))
        assert len(s.rollout_log_probs) == s.response_length and max(s.rollout_log_probs) <= 0
    data = convert_samples_to_train_data(args, samples, fn_path="default")
    assert len(data["rollout_top_p_token_offsets"]) == len(samples)
    # --deterministic-mode: seeded requests, so the same prompts give the same tokens in a fresh rollout
    SingletonMeta.clear_instances(GenerateState)
    again = [s for g in generate_rollout(args, 0, RolloutDataSourceWithBuffer(args)) for s in g]
    assert [s.tokens for s in again] == [s.tokens for s in samples]
    assert [s.rollout_top_p_token_ids for s in again] == [s.rollout_top_p_token_ids for s in samples]


def test_custom_rm_and_custom_generate_by_path(engine, tiny_kit, prompts):
    args = make_args(engine, tiny_kit, prompts, custom_rm_path=f"{HERE}.response_length_rm")
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert all(s.reward == float(s.response_length) for g in groups for s in g)

    args = make_args(
        engine,
        tiny_kit,
        prompts,
        custom_generate_function_path=f"{HERE}.pre_scored_generate",
        custom_rm_path=f"{HERE}.response_length_rm",
    )
    SingletonMeta.clear_instances(GenerateState)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert all(s.reward == -1.0 for g in groups for s in g)  # a reward set by the generate function is kept


def test_custom_generate_returning_a_list(engine, tiny_kit, prompts):
    # each member of the list is scored by one list-aware RM call, and the group is flattened
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        n_samples_per_prompt=1,
        custom_generate_function_path=f"{HERE}.two_agents_generate",
        custom_rm_path=f"{HERE}.group_rank_rm",
    )
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [[(s.index, s.metadata["agent"], s.reward) for s in g] for g in groups] == [
        [(0, 0, 0.0), (0, 1, 1.0)],
        [(1, 0, 0.0), (1, 1, 1.0)],
    ]
    assert RECORD["group_rm_sizes"] == [2, 2]


def test_failure_surfaces_and_leaves_a_clean_state(engine, tiny_kit, prompts):
    args = make_args(engine, tiny_kit, prompts, custom_rm_path=f"{HERE}.failing_rm")
    ds = RolloutDataSourceWithBuffer(args)
    with pytest.raises(ValueError, match="grader crashed on sample 3"):
        generate_rollout(args, 0, ds)
    state = GenerateState(args)
    assert not state.aborted and not state.pendings and state.remaining_batch_size == 0
    args.custom_rm_path = f"{HERE}.parity_rm"
    assert len(generate_rollout(args, 1, ds)) == 2  # the next rollout runs normally


def test_group_rm(engine, tiny_kit, prompts):
    args = make_args(
        engine, tiny_kit, prompts, group_rm=True, n_samples_per_prompt=3, custom_rm_path=f"{HERE}.group_rank_rm"
    )
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    assert [[s.reward for s in g] for g in groups] == [[0.0, 1.0, 2.0]] * 2
    assert RECORD["group_rm_sizes"] == [3, 3]  # one call per group, never per sample
    # as current slime's Sample: each its own session (the routing key under consistent hashing), and a loss mask
    # over its response from generation on, which the reward function, hooks and filters see
    samples = [s for g in groups for s in g]
    assert len({str(uuid.UUID(s.session_id)) for s in samples}) == 6
    assert RECORD["group_rm_masks"] == [[[1] * s.response_length for s in g] for g in groups]
    hashing = make_args(engine, tiny_kit, prompts, router_policy="consistent_hashing")
    assert sglang_rollout.routing_headers(hashing, samples[0]) == {"X-SMG-Routing-Key": samples[0].session_id}


def test_dynamic_filter_accounting(engine, tiny_kit, prompts):
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        rollout_batch_size=3,
        over_sampling_batch_size=3,
        custom_rm_path=f"{HERE}.parity_rm",
        dynamic_sampling_filter_path=f"{HERE}.drop_odd_groups",
    )
    ds = RolloutDataSourceWithBuffer(args)
    RECORD["submitted"] = 0

    def counting_source(n):
        groups = ds.get_samples(n)
        RECORD["submitted"] += len(groups)
        return groups

    data, aborted = run(sglang_rollout.generate_rollout_async(args, 0, counting_source))
    assert len(data) == 3 and all(g[0].group_index % 2 == 0 for g in data)
    # a list (slime v0.1.0) and current slime's RolloutFnTrainOutput: .samples, and .metrics with the drops
    assert data.samples is data and data.metrics["rollout/dynamic_filter/drop"] >= 1
    assert [g[0].index for g in data] == sorted(g[0].index for g in data)
    assert aborted == []  # no partial rollout: aborted groups are dropped
    # remaining_batch_size is always "submitted minus dropped so far" and never lets the in-flight count fall short
    for remaining, submitted, dropped in RECORD["filter_calls"]:
        assert remaining == submitted - dropped
    assert len(RECORD["drops"]) >= 1 and all(i % 2 == 1 for i in RECORD["drops"])
    assert GenerateState(args).metrics == {"rollout/dynamic_filter/drop": len(RECORD["drops"])}
    assert (
        GenerateState(args).remaining_batch_size == 0 and not GenerateState(args).pendings
    )  # reset for the next rollout


async def even_groups_tie_generate(args, sample, sampling_params):
    """No engine call: even prompt groups get equal rewards (zero std), odd groups mixed ones."""
    sample.tokens, sample.response, sample.response_length = [1, 5, 6], "x", 1
    sample.status = Sample.Status.COMPLETED
    sample.reward = 1.0 if sample.group_index % 2 == 0 else float(sample.index % 2)
    return sample


def remove_first_of_each_group(args, groups):
    RECORD["sample_filter_groups"] = [g[0].group_index for g in groups]
    for group in groups:
        group[0].remove_sample = True


def record_all_groups(args, all_groups, data_source):
    RECORD["all_groups"] = [g[0].group_index for g in all_groups]
    RECORD["third_argument_is_callable"] = callable(data_source)


@pytest.mark.parametrize("fallback", [False, True])
def test_filter_output_sample_filter_and_all_samples_process(engine, tiny_kit, prompts, fallback):
    filters = "slime.rollout.filter_hub.dynamic_sampling_filters"
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        rollout_batch_size=2,
        over_sampling_batch_size=2,
        custom_generate_function_path=f"{HERE}.even_groups_tie_generate",
        dynamic_sampling_filter_path=f"{filters}.check_reward_nonzero_std{'_with_fallback' if fallback else ''}",
        rollout_sample_filter_path=f"{HERE}.remove_first_of_each_group",
        rollout_all_samples_process_path=f"{HERE}.record_all_groups",
    )
    data, _ = run(sglang_rollout.generate_rollout_async(args, 0, RolloutDataSourceWithBuffer(args).get_samples))
    kept = [g[0].group_index for g in data]
    metrics = GenerateState(args).metrics
    if fallback:
        # group 0 ties but dropping it would leave fewer than 2 groups in flight: kept, no second round
        assert kept == [0, 1] and metrics == {"rollout/dynamic_filter/drop": 0}
        assert RECORD["all_groups"] == [0, 1]
    else:
        assert all(i % 2 == 1 for i in kept) and len(kept) == 2
        drops = metrics["rollout/dynamic_filter/drop"]
        assert drops >= 1 and metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == drops
        assert set(kept) < set(RECORD["all_groups"]) and any(i % 2 == 0 for i in RECORD["all_groups"])
        assert RECORD["all_groups"] == sorted(RECORD["all_groups"])
    assert RECORD["sample_filter_groups"] == kept and RECORD["third_argument_is_callable"]
    assert [[s.remove_sample for s in g] for g in data] == [[True, False]] * 2


def test_over_sampling_then_filter_to_rollout_batch_size(engine, tiny_kit, prompts):
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        rollout_batch_size=2,
        over_sampling_batch_size=4,
        n_samples_per_prompt=3,
        custom_rm_path=f"{HERE}.response_length_rm",
        rollout_max_response_len=6,
        over_sampling_filter_path=f"{HERE}.recording_over_sampling_filter",
    )
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    received = RECORD["over_sampling_input"]
    assert len(received) == 4  # the target is the over-sampling size when an over-sampling filter is set

    def std(rewards):
        m = sum(rewards) / len(rewards)
        return (sum((r - m) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5

    by_std = sorted(received, key=lambda g: std([s["reward"] for s in g]), reverse=True)  # stable, like the filter
    expected = sorted(by_std[:2], key=lambda g: g[0]["index"])
    assert [[s.to_dict() for s in g] for g in groups] == expected
    assert len(groups) == 2


@pytest.mark.parametrize("generate_fn", ["short_and_long_generate", "short_and_long_streaming"])
def test_abort_returns_partial_groups_that_resume_next_rollout(engine, tiny_kit, prompts, generate_fn):
    """Default and streaming generate (`slime.rollout.sglang_streaming_rollout.generate_streaming`, which keeps what
    the stream delivered when the abort cuts it)."""
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        partial_rollout=True,
        rollout_batch_size=2,
        over_sampling_batch_size=4,
        n_samples_per_prompt=1,
        rollout_max_response_len=LONG,
        custom_rm_path=f"{HERE}.response_length_rm",
        custom_generate_function_path=f"{HERE}.{generate_fn}",
    )
    ds = RolloutDataSourceWithBuffer(args)
    groups = generate_rollout(args, 0, ds)
    # the two short groups (0, 2) finish first; the long ones (1, 3) are aborted mid-generation
    assert [g[0].group_index for g in groups] == [0, 2]
    assert [g[0].response_length for g in groups] == [SHORT, SHORT]
    assert ds.get_buffer_length() == 2
    partial = copy.deepcopy(ds.buffer)
    assert sorted(g[0].group_index for g in partial) == [1, 3]
    for (s,) in partial:
        assert s.status == Sample.Status.ABORTED and s.reward is None
        assert 0 < s.response_length < LONG
        assert len(s.rollout_log_probs) == s.response_length
        assert s.metadata["start_rollout_id"] == 0

    # Next rollout: the buffered groups come first and continue from where they stopped, within the same budget.
    SingletonMeta.clear_instances(GenerateState)
    groups = generate_rollout(args, 1, ds)
    done = {g[0].group_index: g[0] for g in groups}
    assert 4 in done and done[4].response_length == SHORT  # the fresh short group
    resumed = [done[i] for i in (1, 3) if i in done]
    assert len(resumed) == 1, f"expected one resumed long group to finish next, got {sorted(done)}"
    old = next(g[0] for g in partial if g[0].group_index == resumed[0].group_index)
    s = resumed[0]
    assert s.tokens[: len(old.tokens)] == old.tokens and s.response.startswith(old.response)
    assert s.rollout_log_probs[: old.response_length] == old.rollout_log_probs
    assert s.response_length == LONG and s.status == Sample.Status.TRUNCATED  # total budget, not LONG more tokens
    assert s.metadata["start_rollout_id"] == 0 and s.reward == float(LONG)
    # what was still running is back in the buffer; the other old group keeps its original start id
    left = {g[0].group_index: g[0] for g in ds.buffer}
    assert set(left) == {1, 3, 5} - set(done)
    assert left[5].metadata["start_rollout_id"] == 1
    assert all(left[i].metadata["start_rollout_id"] == 0 for i in left if i != 5)


def test_partial_rollout_returns_groups_that_finish_past_the_batch_to_the_buffer(engine, tiny_kit, prompts):
    """Over-sampling 4 for a batch of 2: all 4 finish in one wait; the 2 past the batch go back to the buffer whole
    (rewarded, marked with their rollout) and the next rollout trains them first, without generating them again."""
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        partial_rollout=True,
        rollout_batch_size=2,
        over_sampling_batch_size=4,
        n_samples_per_prompt=1,
        custom_rm_path=f"{HERE}.response_length_rm",
        custom_generate_function_path=f"{HERE}.instant_generate",
    )
    ds = RolloutDataSourceWithBuffer(args)
    assert [g[0].group_index for g in generate_rollout(args, 0, ds)] == [0, 1]
    surplus = sorted(g[0].group_index for g in ds.buffer)
    assert surplus == [2, 3] and RECORD["generated"] == [0, 1, 2, 3]
    assert all(g[0].status == Sample.Status.COMPLETED and g[0].reward == 1.0 for g in ds.buffer)
    assert all(g[0].metadata["start_rollout_id"] == 0 for g in ds.buffer)
    SingletonMeta.clear_instances(GenerateState)
    assert [g[0].group_index for g in generate_rollout(args, 1, ds)] == [2, 3]
    assert RECORD["generated"][:4] == [0, 1, 2, 3] and 2 not in RECORD["generated"][4:]


def _wait_until_generating(args, n, prompt_len, timeout=60.0):
    """Poll the engine's /get_load (bounded) until n requests run and each holds some decoded rows beyond its
    prompt: the abort then lands mid-generation, whatever the machine's speed (LONG leaves a wide margin)."""
    import time

    import requests

    from slime.backends.sglang_utils.router import list_workers, router_url

    (worker,) = list_workers(router_url(args))
    deadline, load = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        (load,) = requests.get(f"{worker}/get_load", timeout=5).json()
        if load["num_reqs"] == n and load["num_tokens"] >= n * (prompt_len + 8):
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine did not start generating {n} requests within {timeout}s (last load: {load})")


def test_an_aborted_batch_group_keeps_each_samples_tokens_and_resumes_one_request_per_sample(
    engine, tiny_kit, prompts, monkeypatch
):
    """docs/usage.md (--partial-rollout, batch /generate): a fresh group of 4 goes out as one batch request; aborted
    mid-generation, every sample keeps its own partial tokens and log-probs; resumed, the group goes one request per
    sample, each continuing from its tokens to the whole budget."""
    import asyncio

    args = make_args(
        engine,
        tiny_kit,
        prompts,
        partial_rollout=True,
        n_samples_per_prompt=4,
        rollout_max_response_len=LONG,
        custom_rm_path=f"{HERE}.response_length_rm",
    )
    state = GenerateState(args)
    state.sampling_params["ignore_eos"] = True  # every request runs its whole budget unless aborted
    prompt = state.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1+2?"}], tokenize=False, add_generation_prompt=True
    )
    prompt_len = len(state.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    group = [Sample(index=i, group_index=0, prompt=prompt, label="3") for i in range(4)]
    bodies = _recording_posts(monkeypatch)

    async def submit_then_abort():
        state.submit_generate_tasks([group])
        await asyncio.get_running_loop().run_in_executor(None, _wait_until_generating, args, 4, prompt_len)
        return await sglang_rollout.abort(args, 0)

    (partial,) = run(submit_then_abort(), timeout=180)
    assert len(bodies) == 1 and len(bodies[0]["input_ids"]) == 4  # one batch request for the group
    assert len(partial) == 4
    for s in partial:
        assert s.status == Sample.Status.ABORTED and s.reward is None
        assert 0 < s.response_length < LONG
        assert len(s.tokens) == prompt_len + s.response_length
        assert len(s.rollout_log_probs) == s.response_length
        assert s.metadata["start_rollout_id"] == 0
    old = copy.deepcopy(partial)

    # the next rollout resumes them: one request per sample, each from its own tokens, within the same budget
    state.reset()
    bodies.clear()
    params = dict(state.sampling_params)
    resumed = run(sglang_rollout.generate_and_rm_group(args, partial, params), timeout=300)
    assert len(bodies) == 4 and all(isinstance(b["input_ids"][0], int) for b in bodies)
    assert sorted(b["input_ids"] for b in bodies) == sorted(s.tokens for s in old)
    assert sorted(b["sampling_params"]["max_new_tokens"] for b in bodies) == sorted(
        LONG - s.response_length for s in old
    )
    assert [s.index for s in resumed] == [0, 1, 2, 3]
    for s, o in zip(resumed, old):
        assert s.tokens[: len(o.tokens)] == o.tokens and s.response.startswith(o.response)
        assert s.rollout_log_probs[: o.response_length] == o.rollout_log_probs
        assert s.response_length == LONG and len(s.rollout_log_probs) == LONG
        assert s.status == Sample.Status.TRUNCATED and s.reward == float(LONG)


@pytest.mark.parametrize("mask", [True, False])
def test_mask_offpolicy_in_partial_rollout_masks_what_a_resumed_sample_brought(engine, tiny_kit, prompts, mask):
    """A sample cut after 3 tokens resumes to 8 through the real engine: with the flag its loss mask is 3 zeros (older
    weights' tokens) then 5 ones; without it, 8 ones (every token trains). A finished sample returned to the buffer
    with its group is all zeros."""
    from slime.ray.buffer import convert_samples_to_train_data

    args = make_args(engine, tiny_kit, prompts, partial_rollout=True, mask_offpolicy_in_partial_rollout=mask)
    params = dict(GenerateState(args).sampling_params, ignore_eos=True)  # the full budget of 8
    tokenizer = GenerateState(args).tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1+2?"}], tokenize=False, add_generation_prompt=True
    )
    first = Sample(index=0, prompt=prompt, label="3")
    run(sglang_rollout.generate_and_rm(args, first, dict(params, max_new_tokens=3)))
    assert first.response_length == 3 and first.loss_mask == [1, 1, 1]  # a list from generation on, as upstream
    first.status, first.reward = Sample.Status.ABORTED, None  # as an abort leaves it in the buffer

    resumed = run(sglang_rollout.generate_and_rm(args, first, dict(params)))
    assert resumed.response_length == 8 and len(resumed.rollout_log_probs) == 8
    assert resumed.loss_mask == ([0, 0, 0, 1, 1, 1, 1, 1] if mask else [1] * 8)

    done = Sample(index=1, prompt=prompt, label="3", tokens=list(resumed.tokens), response_length=8, reward=1.0)
    done.status = Sample.Status.COMPLETED
    done.rollout_log_probs = list(resumed.rollout_log_probs)
    done = run(sglang_rollout.generate_and_rm(args, done, dict(params)))
    assert done.loss_mask == ([0] * 8 if mask else None)

    data = convert_samples_to_train_data(args, [resumed, done], fn_path="default")
    expected = [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8] if mask else [[1] * 8, [1] * 8]
    assert [list(m) for m in data["loss_masks"]] == expected


def test_eval_rollout(engine, tiny_kit, prompts):
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        eval_prompt_data=["toy", prompts[1], "toy_again", prompts[1]],
        n_samples_per_eval_prompt=2,
        eval_temperature=0.0,
        eval_max_response_len=4,
        custom_rm_path=f"{HERE}.response_length_rm",
        rollout_max_response_len=30,
    )
    data = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    assert set(data) == {"toy", "toy_again"}
    assert data.data is data  # also current slime's RolloutFnEvalOutput
    # eval_rollout returns (results, []) as slime v0.1.0 and current slime do; again: the same greedy results
    again, aborted = run(sglang_rollout.eval_rollout(args, 1))
    assert aborted == [] and {k: v["rewards"] for k, v in again.data.items()} == {
        k: v["rewards"] for k, v in data.items()
    }
    for name in data:
        rewards, truncated = data[name]["rewards"], data[name]["truncated"]
        assert len(rewards) == len(truncated) == 6  # 3 prompts x 2 samples
        assert all(1 <= r <= 4 for r in rewards)  # eval max response length overrides the rollout one
        assert truncated == [r == 4 for r in rewards]
        assert rewards[0::2] == rewards[1::2]  # greedy eval temperature: both samples of a prompt agree
    # same prompts, same greedy answers; the per-dataset `samples` (for custom eval log functions) carry their own metadata
    assert {k: data["toy"][k] for k in ("rewards", "truncated")} == {
        k: data["toy_again"][k] for k in ("rewards", "truncated")
    }


async def recording_generate(args, sample, sampling_params):
    """Custom generate of one eval dataset: records what it is called with, then generates as the default does."""
    RECORD.setdefault("eval_calls", []).append((dict(sampling_params), dict(sample.metadata)))
    return await generate(args, sample, sampling_params)


def test_eval_config_datasets_get_their_own_params_reward_and_generate(engine, tiny_kit, prompts, tmp_path):
    # the tiny kit's tokenizer with a Qwen3-like template that reads enable_thinking (the engine serves the same vocab)
    model = tmp_path / "model"
    model.mkdir()
    for f in os.listdir(tiny_kit[0]):
        if f != "chat_template.jinja":
            os.symlink(os.path.join(tiny_kit[0], f), model / f)
    (model / "chat_template.jinja").write_text(
        "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{%- endfor %}{{ '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    )
    config = tmp_path / "eval.yaml"
    config.write_text(
        f"""
eval:
  defaults: {{input_key: prompt, label_key: label, apply_chat_template: true, temperature: 0.0}}
  datasets:
    short:
      path: {prompts[1]}
      max_response_len: 2
      n_samples_per_eval_prompt: 2
      custom_rm_path: {HERE}.response_length_rm
    tagged:
      path: {prompts[1]}
      max_response_len: 5
      min_new_tokens: 5
      rm_type: answer_match
      metadata_overrides: {{tag: t1}}
      custom_generate_function_path: {HERE}.recording_generate
      apply_chat_template_kwargs: {{enable_thinking: false}}
"""
    )
    args = make_args(engine, tiny_kit, prompts, "--eval-config", str(config), rm_type=None, eval_prompt_data=None)
    args.hf_checkpoint = str(model)
    data = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args), evaluation=True)
    short, tagged = data["short"], data["tagged"]
    # 3 prompts x 2 greedy samples of at most 2 tokens, rewarded by their length (the dataset's custom RM)
    assert len(short["rewards"]) == 6 and all(r in (1.0, 2.0) for r in short["rewards"])
    assert short["rewards"][0::2] == short["rewards"][1::2] and short["truncated"] == [
        r == 2 for r in short["rewards"]
    ]
    # the dataset's generate saw its sampling params and metadata; answer_match (its rm_type) scored 5-token replies
    calls = RECORD["eval_calls"]
    assert len(calls) == 3 and all(p["max_new_tokens"] == 5 and p["min_new_tokens"] == 5 for p, _ in calls)
    assert all(p["temperature"] == 0.0 for p, _ in calls)
    assert all(m["rm_type"] == "answer_match" and m["tag"] == "t1" for _, m in calls)
    assert all(s.response_length == 5 for s in tagged["samples"])
    assert all(r in (0, 1) for r in tagged["rewards"]) and tagged["truncated"] == [True] * 3
    # the dataset's own chat-template arguments (as current slime's eval config), the other's the command line's
    assert all(s.prompt.endswith("assistant\n<think>\n\n</think>\n\n") for s in tagged["samples"])
    assert all(s.prompt.endswith("assistant\n") for s in short["samples"])


def test_default_generate_rejects_message_prompts(engine, tiny_kit, prompts):
    args = make_args(engine, tiny_kit, prompts)
    sample = Sample(index=3, prompt=[{"role": "user", "content": "hi"}])
    with pytest.raises(TypeError, match="sample 3: the prompt is a list, not text.*--apply-chat-template"):
        run(generate(args, sample, {"max_new_tokens": 4}))


def test_resume_with_no_budget_left_is_truncated_without_a_request(tiny_kit, prompts):
    args = make_args(real_args(sglang_router_ip="127.0.0.1", sglang_router_port=9), tiny_kit, prompts)
    sample = Sample(
        index=0, prompt="x", tokens=[5, 6, 7], response="ab", response_length=2, status=Sample.Status.ABORTED
    )
    out = run(generate(args, sample, {"max_new_tokens": 2}))  # port 9 would fail if a request were sent
    assert out.status == Sample.Status.TRUNCATED and out.tokens == [5, 6, 7]


def test_controller_runs_default_rollout_in_ray(engine, tiny_kit, prompts, ray_session, tmp_path):
    ray = ray_session
    from slime.ray.buffer import RolloutController

    args = make_args(
        engine,
        tiny_kit,
        prompts,
        rollout_function_path="slime.rollout.sglang_rollout.generate_rollout",
        eval_function_path=None,
        custom_reward_post_process_path=None,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        load_debug_rollout_data=None,
        save_debug_rollout_data=None,
        debug_train_only=False,
        use_wandb=False,
        global_batch_size=4,
        eval_prompt_data=["toy", prompts[1]],
        save=str(tmp_path),
        custom_rm_path=f"{HERE}.parity_rm",
    )
    controller = RolloutController.options(num_cpus=0, num_gpus=0).remote(args, None)
    try:
        assert ray.get(controller.get_num_rollout_per_epoch.remote(), timeout=120) == 4  # 8 prompts // 2
        data = ray.get(ray.get(controller.generate.remote(0), timeout=300).inner)
        metrics = ray.get(controller.pop_metrics.remote(0))
        eval_metrics = ray.get(controller.eval.remote(0), timeout=300)
        ray.get(controller.save.remote(0))
    finally:
        ray.kill(controller)
    assert data["sample_indices"] == [0, 1, 2, 3]
    assert data["raw_reward"] == [0.0, 1.0, 0.0, 1.0]
    assert all(len(t) == 15 + n for t, n in zip(data["tokens"], data["response_lengths"]))
    assert [len(lp) for lp in data["rollout_log_probs"]] == data["response_lengths"]
    assert metrics["rollout/raw_reward"] == 0.5 and metrics["rollout/weight_version"] == 0
    assert metrics["perf/rollout_time"] > 0
    assert eval_metrics["eval/toy"] == pytest.approx(1 / 3)  # parity of indices 0, 1, 2
    assert os.path.exists(os.path.join(str(tmp_path), "rollout", "global_dataset_state_dict_0.pt"))


def test_group_timeout_drops_a_straggler_and_serves_its_prompt_again(engine, tiny_kit, prompts):
    """--rollout-group-timeout: a group that does not finish in time is dropped from the rollout (counted in the
    metrics), a fresh prompt fills its place, and the dropped group, as it was handed out, is served first next time."""
    args = make_args(
        engine,
        tiny_kit,
        prompts,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        # every group that does not hang must finish within it (two 8-token samples, ~0.1 s on an idle machine):
        # wide, since on a loaded one a second group over it is dropped too
        rollout_group_timeout=10.0,
        custom_generate_function_path=f"{HERE}.group_1_hangs_once",
    )
    ds = RolloutDataSourceWithBuffer(args)
    groups = generate_rollout(args, 0, ds)
    # group 1's place went to one of the two prompts pulled next (the other is over-sampling surplus)
    assert groups[0][0].group_index == 0 and groups[1][0].group_index in (2, 3) and len(groups) == 2
    assert groups.metrics["rollout/timeouts/groups"] == 1
    (dropped,) = ds.buffer
    assert [s.index for s in dropped] == [2, 3] and {s.group_index for s in dropped} == {1}
    assert all(s.status == Sample.Status.PENDING and s.response_length == 0 and not s.response for s in dropped)
    SingletonMeta.clear_instances(GenerateState)
    groups = generate_rollout(args, 1, ds)
    assert [g[0].group_index for g in groups] == [1, 4]  # the straggler's prompt, now generated; then the next one
    assert [s.index for s in groups[0]] == [2, 3] and groups.metrics["rollout/timeouts/groups"] == 0


@pytest.mark.parametrize("group_rm", [False, True])
def test_a_sample_aborted_mid_rollout_is_resumed_and_one_that_keeps_aborting_stops_the_run(
    engine, tiny_kit, prompts, group_rm
):
    """Not slime's abort at the end of a rollout (samples then go back to the buffer): a sample an engine (or a custom
    generate) aborts mid-rollout goes on from its tokens under the same weights and is rewarded like the rest, with
    --group-rm too; one that keeps coming back aborted stops the run, named, instead of training without a reward.
    (The fully asynchronous rollout resumes them without a bound: a weight update pauses generation by aborting.)"""
    rm = dict(group_rm=True, custom_rm_path=f"{HERE}.group_rank_rm") if group_rm else {}
    args = make_args(engine, tiny_kit, prompts, custom_generate_function_path=f"{HERE}.sample_1_gives_up_once", **rm)
    groups = generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))
    resumed, partial = groups[0][1], RECORD["partial"]
    assert resumed.index == 1 and resumed.tokens[: len(partial)] == partial and len(resumed.tokens) > len(partial)
    assert 3 < resumed.response_length <= 8 and len(resumed.rollout_log_probs) == resumed.response_length
    assert all(s.status != Sample.Status.ABORTED and s.reward is not None for g in groups for s in g)
    assert groups.metrics["rollout/engine_abort_resumes"] == 1

    SingletonMeta.clear_instances(GenerateState)
    args = make_args(engine, tiny_kit, prompts, custom_generate_function_path=f"{HERE}.always_aborts", **rm)
    with pytest.raises(RuntimeError, match=r"samples \[\d+, \d+\] came back aborted 4 times in a row"):
        generate_rollout(args, 0, RolloutDataSourceWithBuffer(args))


def test_streaming_generate_gives_the_default_generates_tokens_and_log_probs(engine, tiny_kit, prompts):
    """Greedy, so both requests must give the same tokens; the streamed log-probs are the engine's final ones."""
    args = make_args(engine, tiny_kit, prompts, rollout_temperature=0.0)
    params = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}

    async def both():
        a = await generate(args, Sample(index=0, prompt="1+2="), dict(params))
        b = await generate_streaming(args, Sample(index=1, prompt="1+2="), dict(params))
        return a, b

    a, b = run(both(), timeout=120)
    assert b.status == a.status == Sample.Status.TRUNCATED and b.response_length == a.response_length == 8
    assert b.tokens == a.tokens and b.response == a.response and b.weight_versions == a.weight_versions
    assert b.weight_version_spans == a.weight_version_spans == [{"version": "0", "start": 0, "end": 8}]
    assert b.rollout_log_probs == pytest.approx(a.rollout_log_probs, abs=1e-6)
    # both record what the engine sampled with (its echo): greedy is temperature 1 at top_k 1
    recs = [s.metadata["sampling_params"] for s in (a, b)]
    assert [[(r["response_span"], r["origin"], r["temperature"], r["top_k"]) for r in x] for x in recs] == [
        [([0, 8], "engine echo", 1.0, 1)]
    ] * 2
    assert [x[0]["lora_path"] for x in recs] == [None, None]  # the adapter each request named (none: the base)


@pytest.mark.parametrize("truncation", [{"rollout_top_p": 0.9}, {"rollout_top_k": 20}])
def test_streaming_generate_refuses_truncated_sampling(tiny_kit, prompts, monkeypatch, truncation):
    """docs/usage.md: the streaming generate does not ask for the kept token sets top-p/top-k replay needs, so a
    training rollout with truncated sampling is refused before any request goes out."""
    from slime.rollout import sglang_streaming_rollout

    async def no_request(url, payload, **kw):
        raise AssertionError(f"a request went out: {payload}")
        yield  # an async generator, as post_stream is

    monkeypatch.setattr(sglang_streaming_rollout, "post_stream", no_request)
    args = make_args(real_args(sglang_router_ip="127.0.0.1", sglang_router_port=9), tiny_kit, prompts, **truncation)
    with pytest.raises(
        ValueError,
        match="generate_streaming does not ask the engine for the kept token sets.*"
        "use the default generate for truncated sampling",
    ):
        run(generate_streaming(args, Sample(index=0, prompt="1+2="), {"max_new_tokens": 4}), timeout=60)


def test_rollout_stop_flags_reach_the_generate_body_and_the_eval_datasets(tiny_kit, monkeypatch):
    """docs/qa.md: `--rollout-stop "</answer>"` and `--rollout-stop-token-ids 151645` are sent with every /generate,
    the rollout's and (unless the eval dataset sets its own) the eval's. No engine: `post` is a stand-in."""
    from tests._args import TINY_PROMPTS

    args = real_args(
        "--rollout-stop",
        "</answer>",
        "--rollout-stop-token-ids",
        "151645",
        "--eval-prompt-data",
        "tiny",
        TINY_PROMPTS,
        hf_checkpoint=tiny_kit[0],
        sglang_router_ip="127.0.0.1",
        sglang_router_port=9,
    )
    state = GenerateState(args)
    assert state.sampling_params["stop"] == ["</answer>"]
    assert state.sampling_params["stop_token_ids"] == [151645]
    (dataset,) = args.eval_datasets
    assert (dataset.stop, dataset.stop_token_ids) == (["</answer>"], [151645])  # resolved from the flags (ARG_CHAINS)
    eval_params = dataset.sampling_params(state.sampling_params)  # as eval_rollout_single_dataset builds them
    assert (eval_params["stop"], eval_params["stop_token_ids"]) == (["</answer>"], [151645])

    bodies = []

    async def fake_post(url, payload, **kw):
        bodies.append((url, copy.deepcopy(payload)))
        return {"text": "", "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "stop"}}}

    monkeypatch.setattr(sglang_rollout, "post", fake_post)
    for params, evaluation in ((dict(state.sampling_params), False), (eval_params, True)):
        run(generate(args, Sample(index=0, prompt="What is 1+2?"), params, evaluation=evaluation), timeout=60)
    assert [url for url, _ in bodies] == ["http://127.0.0.1:9/generate"] * 2
    for _, body in bodies:
        assert body["sampling_params"]["stop"] == ["</answer>"]
        assert body["sampling_params"]["stop_token_ids"] == [151645]
