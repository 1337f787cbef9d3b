"""Sampling parameters: every sample records what each engine call sampled it with, and the train data
refuses a trained sample the trainer cannot score at what it was sampled with (`check_sampling_params`, called from
`convert_samples_to_train_data`), in one line naming the sample, the parameter, its value, the flag's and the source.
The CPU server's echo is covered in tests/test_cpu_server.py and the agent adapters' refusal in
tests/test_agent_adapters.py."""

import asyncio
import logging

import numpy as np
import pytest

from slime.backends.cpu_server.sampling import SamplingParams
from slime.rollout import sampling_provenance
from slime.rollout.train_data import convert_samples_to_train_data
from slime.utils.sampling_record import applied_sampling_params, record_segment
from slime.utils.types import Sample
from tests._args import make_args, one_line_refusal

GEN = "the default generate (slime.rollout.sglang_rollout.generate)"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    sampling_provenance._warned.clear()
    yield
    sampling_provenance._warned.clear()


def _sample(index, sent=None, echo=None, source=GEN):
    """A 2-token response sampled by one engine call with `sent` (the request's sampling_params) or `echo` (the
    engine's meta_info echo); neither: a sample without a record."""
    s = Sample(index=index, tokens=[1, 2, 3, 4], response_length=2, reward=1.0, rollout_log_probs=[-0.1, -0.2])
    s.status = Sample.Status.COMPLETED
    if sent is not None or echo is not None:
        meta = {"sampling_params": echo} if echo is not None else {}
        record_segment(s, meta, sent, start=0, end=2, source=source)
    return s


def test_slimes_normalisation_equals_what_the_cpu_server_applies():
    for sp in (
        {},
        {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05},
        {"temperature": 0, "top_k": 50},  # greedy: temperature 1, top_k 1
        {"temperature": 1e-7},
        {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "min_new_tokens": 3, "logit_bias": {"3": 1.0}},
    ):
        assert applied_sampling_params(sp) == SamplingParams.from_dict(sp, vocab_size=64).applied(), sp
    assert applied_sampling_params({"temperature": 0})["top_k"] == 1
    assert (
        applied_sampling_params({"regex": "a+"})["regex"]
        and applied_sampling_params({}, custom_logit_processor=1)["custom_logit_processor"]
    )


def test_a_matching_sample_trains_and_its_record_survives_to_dict():
    args = make_args("--rollout-temperature", "0.7")
    good = [_sample(0, sent={"temperature": 0.7, "top_p": 1.0, "top_k": -1}), _sample(1, echo=_echo(0.7))]
    data = convert_samples_to_train_data(args, good, fn_path="f")
    assert data["sample_indices"] == [0, 1] and "rollout_temperatures" not in data
    [rec] = Sample.from_dict(good[0].to_dict()).metadata["sampling_params"]
    assert rec["temperature"] == 0.7 and rec["origin"] == "request" and rec["response_span"] == [0, 2]
    assert good[1].metadata["sampling_params"][0]["origin"] == "engine echo"


def _echo(temperature, **kw):
    return {**SamplingParams.from_dict({"temperature": temperature, **kw}, vocab_size=64).applied()}


def test_other_temperatures_are_replayed_per_token_and_what_cannot_be_replayed_is_refused_in_one_line():
    """A segment sampled at a temperature other than the flag's trains at its own: the train data carries each
    response token's temperature (the flag's where nothing is recorded), which the log-prob forward divides by
    (tests/test_top_p_replay.py checks the trainer then equals the engine)."""
    args = make_args("--rollout-temperature", "1.0")
    two_turns = Sample(index=1, tokens=[1, 2, 3, 4, 5, 6], response_length=4, reward=1.0, rollout_log_probs=[-0.1] * 4)
    two_turns.status = Sample.Status.COMPLETED
    record_segment(two_turns, {"sampling_params": _echo(0.6)}, None, start=0, end=2, source="the openai agent adapter")
    record_segment(two_turns, {}, {"temperature": 1.3}, start=2, end=4, source=GEN)
    samples = [_sample(0, sent={"temperature": 1.0}), two_turns, _sample(2), _sample(3, sent={"temperature": 1.0})]
    data = convert_samples_to_train_data(args, samples, fn_path="my.rollout")
    temperatures = [t.tolist() for t in data["rollout_temperatures"]]  # float32
    assert temperatures == [[1.0, 1.0], [*[np.float32(0.6)] * 2, *[np.float32(1.3)] * 2], [1.0, 1.0], [1.0, 1.0]]
    # all at the flag's temperature: nothing to replay, the forward divides by the flag as before
    assert "rollout_temperatures" not in convert_samples_to_train_data(args, [samples[0], samples[2]], fn_path="f")

    # what cannot be replayed (a penalty) is refused in one line naming the sample, the source and the way out
    penalised = [_sample(0, sent={"presence_penalty": 0.5}), two_turns, _sample(2), _sample(3)]
    with pytest.raises(ValueError) as e:
        convert_samples_to_train_data(args, penalised, fn_path="my.rollout")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("sample 0 (position 0) from rollout function 'my.rollout': its response tokens 0..2")
    assert "--no-check-sampling-params" in msg
    # a loss-masked segment (e.g. an off-policy part of a partial rollout) is not trained, so not refused
    penalised[0].loss_mask = [0, 0]
    convert_samples_to_train_data(args, penalised, fn_path="my.rollout")
    # and the opt-out trains it, warning once
    penalised[0].loss_mask = None
    convert_samples_to_train_data(make_args("--no-check-sampling-params"), penalised, fn_path="my.rollout")


def test_a_greedy_rollout_temperature_is_refused_unless_only_generating(capsys):
    """The trainer divides its logits by --rollout-temperature: at 0 (or below SGLang's greedy threshold) its
    log-probs would be NaN or meaningless, so such a run is refused at start-up; generating only is fine."""
    for t in ("0", "1e-07"):
        assert f"--rollout-temperature {t}: the trainer divides the logits by it" in one_line_refusal(
            capsys, "--rollout-temperature", t
        )
    assert make_args("--rollout-temperature", "0", "--debug-rollout-only").rollout_temperature == 0


def test_penalties_and_processors_are_refused():
    args = make_args()
    for sent, what in (
        ({"presence_penalty": 0.5}, "presence_penalty=0.5, which the trainer cannot replay"),
        ({"repetition_penalty": 1.1}, "repetition_penalty=1.1"),
        ({"logit_bias": {"3": 2.0}}, "logit_bias set, which the trainer cannot replay"),
        ({"json_schema": "{}"}, "json_schema set"),
    ):
        with pytest.raises(ValueError, match=r"sample 0 \(position 0\) .* sampled by the default generate") as e:
            convert_samples_to_train_data(args, [_sample(0, sent=sent), _sample(1, sent={})], fn_path="f")
        assert what in str(e.value) and "(parameters from the request)" in str(e.value)


def test_truncation_needs_kept_sets():
    args = make_args()  # the trainer scores over the full vocabulary
    with pytest.raises(ValueError, match=r"top_p=0.9, top_k=20 \(a truncated distribution\) but no kept token sets"):
        convert_samples_to_train_data(args, [_sample(0, sent={"top_p": 0.9, "top_k": 20}), _sample(1)], fn_path="f")
    # under top-p replay, with kept sets for its tokens, the same sample trains
    replay = make_args("--rollout-top-p", "0.9", "--rollout-top-k", "20")
    pair = [_sample(0, sent={"top_p": 0.9, "top_k": 20}), _sample(1, sent={"top_p": 0.5, "top_k": 20})]
    for s in pair:
        s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets = [3, 0, 4], [0, 2, 3]
    convert_samples_to_train_data(replay, pair, fn_path="f")


def test_an_unrecorded_sample_trains_with_one_warning_naming_the_function(caplog):
    args = make_args("--custom-generate-function-path", "my_pkg.gen.generate")
    with caplog.at_level(logging.WARNING, logger="slime.rollout.sampling_provenance"):
        convert_samples_to_train_data(args, [_sample(0), _sample(1)], fn_path="f")
        convert_samples_to_train_data(args, [_sample(2), _sample(3)], fn_path="f")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "sample 0 (position 0) from --custom-generate-function-path my_pkg.gen.generate" in warnings[0]
    assert "records no sampling parameters" in warnings[0]


def test_the_default_generate_records_each_call(monkeypatch):
    """A resumed sample gets one record per engine call, from the engine's echo when there is one."""
    from slime.rollout import sglang_rollout

    args = make_args("--rollout-temperature", "0.7")
    replies = [
        {
            "text": "a",
            "meta_info": {"output_token_logprobs": [[-0.1, 5], [-0.2, 6]], "finish_reason": {"type": "abort"}},
        },
        {
            "text": "b",
            "meta_info": {
                "output_token_logprobs": [[-0.3, 7]],
                "finish_reason": {"type": "stop"},
                "sampling_params": _echo(0.7),
            },
        },
    ]

    async def fake_post(url, payload, **kw):
        return replies.pop(0)

    class _State:
        tokenizer = None
        workers = []
        request_timeouts = 0

    monkeypatch.setattr(sglang_rollout, "post", fake_post)
    monkeypatch.setattr(sglang_rollout, "GenerateState", lambda args: _State())
    s = Sample(index=0, tokens=[1, 2], prompt="q")
    sp = {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}
    s = asyncio.run(sglang_rollout.generate(args, s, dict(sp)))
    s.status = Sample.Status.ABORTED
    s = asyncio.run(sglang_rollout.generate(args, s, dict(sp)))
    recs = s.metadata["sampling_params"]
    assert [(r["response_span"], r["origin"]) for r in recs] == [([0, 2], "request"), ([2, 3], "engine echo")]
    assert all(r["temperature"] == 0.7 and r["source"] == GEN for r in recs)


def test_the_adapters_rule_compares_after_sglangs_normalisation(caplog):
    """A client's value equal to the session's (however spelled) passes; a different one is a 400 naming both; the
    opt-out accepts it with one warning."""
    from slime.agent.adapters import OpenAIAdapter
    from slime.agent.adapters.common import AdapterError, Session
    from slime.agent.trajectory import TrajectoryTree

    adapter = OpenAIAdapter(tokenizer=None, sglang_url="http://127.0.0.1:1")
    greedy = Session("g", TrajectoryTree("g"), {"temperature": 0.0, "top_p": 1.0}, 0)
    adapter._check_client_sampling(greedy, {"temperature": 1e-9, "top_p": 1, "top_k": 40, "max_new_tokens": 9})
    warm = Session("w", TrajectoryTree("w"), {"temperature": 0.8, "top_p": 0.95, "top_k": 20}, 0)
    adapter._check_client_sampling(warm, {"temperature": 0.8, "top_p": 0.95})
    for sp, start in (
        ({"top_p": 0.9}, "top_p=0.9 differs from this session's top_p=0.95 (--rollout-top-p)"),
        ({"frequency_penalty": 0.1}, "frequency_penalty=0.1 differs from this session's frequency_penalty=0.0:"),
        ({"temperature": 0}, "temperature=0 differs from this session's temperature=0.8 (--rollout-temperature)"),
    ):
        with pytest.raises(AdapterError) as e:
            adapter._check_client_sampling(warm, sp)
        assert (e.value.status, e.value.param) == (400, next(iter(sp))) and e.value.message.startswith(start)
    with caplog.at_level(logging.WARNING, logger="slime.agent.adapters.common"):
        lenient = OpenAIAdapter(tokenizer=None, sglang_url="http://127.0.0.1:1", allow_client_sampling_params=True)
    lenient._check_client_sampling(warm, {"temperature": 0.3})
    assert sum("allow_client_sampling_params" in r.getMessage() for r in caplog.records) == 1


def test_the_opt_out_warns_once(caplog):
    off = make_args("--rollout-temperature", "1.0", "--no-check-sampling-params")
    with caplog.at_level(logging.WARNING, logger="slime.rollout.sampling_provenance"):
        for _ in range(2):
            convert_samples_to_train_data(off, [_sample(0, sent={"temperature": 0.5}), _sample(1)], fn_path="f")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["--no-check-sampling-params"]


# ---------------------------------------------------------------- the adapter under --lora-sync adapter
def _adapter_sample(index, body):
    """A 2-token response whose one engine call sent `body` (None: a record made without the request body)."""
    s = Sample(index=index, tokens=[1, 2, 3, 4], response_length=2, reward=1.0, rollout_log_probs=[-0.1, -0.2])
    s.status = Sample.Status.COMPLETED
    record_segment(s, {}, {"temperature": 1.0}, start=0, end=2, source="my_pkg.gen.generate", body=body)
    return s


def test_under_adapter_sync_a_sample_not_sampled_with_the_policy_adapter_is_refused():
    """SGLang serves a request that names no lora_path from the frozen base and its response does not say which
    adapter served it: the record carries the request's lora_path, and a trained segment that named another adapter,
    none, or was recorded without the body, or a sample with no record at all, is refused in one line naming the
    sample and the opt-out."""
    args = make_args("--enable-lora", "--lora-sync", "adapter")
    good = [_adapter_sample(0, {"lora_path": "slime_policy"}), _adapter_sample(1, {"lora_path": ["slime_policy"]})]
    assert convert_samples_to_train_data(args, good, fn_path="f")["sample_indices"] == [0, 1]
    assert good[0].metadata["sampling_params"][0]["lora_path"] == "slime_policy"
    for bad, why in (
        (
            _adapter_sample(7, {}),
            "lora_path=None: under --lora-sync adapter the engine sampled it from the frozen base",
        ),
        (_adapter_sample(7, {"lora_path": "old"}), "lora_path='old': under --lora-sync adapter the engine sampled it"),
        (_adapter_sample(7, None), "no record of the adapter it was sampled with (lora_path)"),
        (_sample(7), "records no sampling parameters"),
    ):
        with pytest.raises(ValueError) as e:
            convert_samples_to_train_data(args, [good[0], bad], fn_path="f")
        msg = str(e.value)
        assert msg.startswith("sample 7 (position 1) from ") and why in msg and "\n" not in msg, msg
        assert "generate_fields(args)" in msg and "--no-check-sampling-params" in msg, msg
        lenient = make_args("--enable-lora", "--lora-sync", "adapter", "--no-check-sampling-params")
        convert_samples_to_train_data(lenient, [good[0], bad], fn_path="f")
    # the base is the policy under --lora-sync merged (the engine holds merged weights) and without LoRA
    for other in (make_args("--enable-lora", "--lora-sync", "merged"), make_args()):
        convert_samples_to_train_data(other, [_adapter_sample(0, {}), _adapter_sample(1, None)], fn_path="f")
    # an untrained segment (a tool's tokens, a masked resume) is not checked
    masked = _adapter_sample(3, {})
    masked.loss_mask = [0, 0]
    convert_samples_to_train_data(args, [good[0], masked], fn_path="f")


def test_the_default_and_streaming_generates_record_the_adapter_they_request(monkeypatch):
    from slime.rollout import sglang_rollout

    args = make_args("--enable-lora", "--lora-sync", "adapter")
    sent = []

    async def fake_post(url, payload, **kw):
        sent.append(payload)
        return {"text": "a", "meta_info": {"output_token_logprobs": [[-0.1, 5]], "finish_reason": {"type": "stop"}}}

    class _State:
        tokenizer = None
        workers = []
        request_timeouts = 0

    monkeypatch.setattr(sglang_rollout, "post", fake_post)
    monkeypatch.setattr(sglang_rollout, "GenerateState", lambda args: _State())
    sp = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}
    s = asyncio.run(sglang_rollout.generate(args, Sample(index=0, tokens=[1, 2], prompt="q"), dict(sp)))
    assert sent[0]["lora_path"] == "slime_policy"
    assert [r["lora_path"] for r in s.metadata["sampling_params"]] == ["slime_policy"]
    plain = asyncio.run(sglang_rollout.generate(make_args(), Sample(index=1, tokens=[1, 2], prompt="q"), dict(sp)))
    assert "lora_path" not in sent[1] and plain.metadata["sampling_params"][0]["lora_path"] is None
    # the streaming generate's record: tests/test_sglang_rollout.py::test_streaming_generate_gives_the_default_...
