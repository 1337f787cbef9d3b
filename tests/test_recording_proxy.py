"""The recording proxy at the router address: every `/generate` a user's generate function sends through it is
forwarded unchanged and recorded, and samples that record nothing themselves get what their tokens were sampled with
-- so the trainer scores them at their own temperature, or refuses them. The run-level wiring (the controller puts
the proxy on the address user code reads) is checked in tests/test_e2e.py::test_debug_rollout_only_needs_no_megatron_training."""

import json
import logging

import pytest
import requests

from slime.backends.sglang_utils.router import router_url
from slime.rollout import sampling_provenance
from slime.rollout.recording_proxy import (
    SOURCE,
    RecordingProxy,
    RequestLedger,
    record_generate,
    record_openai,
    start_recording_proxy,
)
from slime.rollout.train_data import convert_samples_to_train_data
from slime.utils.sampling_record import openai_requested_adapter
from slime.utils.types import Sample
from tests._args import make_args
from tests.test_cpu_server import start_cpu_server, stop_cpu_server

pytestmark = pytest.mark.timeout(300)
HTTP = requests.Session()
HTTP.trust_env = False
PROMPT = [5, 9, 11, 3]
ONE = ("--n-samples-per-prompt", "1", "--global-batch-size", "4")  # single samples convert on their own


@pytest.fixture(autouse=True)
def _fresh_warnings():
    sampling_provenance._warned.clear()
    yield
    sampling_provenance._warned.clear()


def _record(temperature, **kw):
    return {"temperature": temperature, "source": SOURCE, "origin": "request, recorded at the router", **kw}


def _sample(prompt, response, mask=None, index=0):
    s = Sample(index=index, tokens=list(prompt) + list(response), response_length=len(response), reward=1.0)
    s.rollout_log_probs, s.loss_mask, s.status = [-0.5] * len(response), mask, Sample.Status.COMPLETED
    return s


# ---------------------------------------------------------------- the ledger: which outputs a sample is made of
def test_a_multi_turn_sample_takes_each_turns_output_and_skips_tool_tokens():
    ledger = RequestLedger(max_tokens=1000)
    ledger.add([7, 8, 9], _record(0.6), [{"version": "1", "start": 0, "end": 3}], PROMPT)
    ledger.add([4, 2], _record(1.3), [{"version": "2", "start": 0, "end": 2}], PROMPT + [7, 8, 9, 50, 51])
    s = _sample(PROMPT, [7, 8, 9, 50, 51, 4, 2], mask=[1, 1, 1, 0, 0, 1, 1])
    assert ledger.attach([s]) == 1 and len(ledger) == 0
    recs = s.metadata["sampling_params"]
    assert [(r["temperature"], r["response_span"]) for r in recs] == [(0.6, [0, 3]), (1.3, [5, 7])]
    assert s.weight_version_spans == [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 5, "end": 7}]


def test_a_resumed_turn_is_split_into_the_outputs_it_was_made_of():
    """A partial rollout's turn: an aborted output, then the continuation (no masked token between them)."""
    ledger = RequestLedger(max_tokens=1000)
    ledger.add([7, 8], _record(0.6), [], PROMPT)
    ledger.add([9, 10, 11], _record(0.9), [], PROMPT + [7, 8])
    s = _sample(PROMPT, [7, 8, 9, 10, 11])
    ledger.attach([s])
    assert [r["response_span"] for r in s.metadata["sampling_params"]] == [[0, 2], [2, 5]]


def test_identical_outputs_go_to_the_samples_of_their_own_prompts_once_each():
    ledger = RequestLedger(max_tokens=1000)
    other = [6, 6, 6]
    ledger.add([7, 8], _record(0.6), [], PROMPT)
    ledger.add([7, 8], _record(1.4), [], other)
    ledger.add([7, 8], _record(0.7), [], None)  # a text request: no input ids to tell it apart
    a, b, c, d = _sample(other, [7, 8]), _sample(PROMPT, [7, 8]), _sample([1], [7, 8]), _sample([1], [7, 8])
    ledger.attach([a, b, c, d])
    assert [x.metadata["sampling_params"][0]["temperature"] for x in (a, b, c)] == [1.4, 0.6, 0.7]
    assert not d.metadata  # three outputs recorded, three taken


def test_unmatched_and_self_recorded_samples_are_left_alone_and_old_outputs_are_dropped():
    ledger = RequestLedger(max_tokens=5)
    ledger.add([1, 2, 3], _record(0.5), [])
    ledger.add([7, 8, 9], _record(0.6), [])  # 6 tokens > 5: the oldest output goes
    own = _sample(PROMPT, [7, 8, 9])
    own.metadata = {"sampling_params": [{"temperature": 1.0, "response_span": [0, 3]}]}
    gone, fabricated = _sample(PROMPT, [1, 2, 3]), _sample(PROMPT, [40, 41])
    assert ledger.attach([own, gone, fabricated]) == 0
    assert own.metadata["sampling_params"][0]["temperature"] == 1.0 and not gone.metadata and not fabricated.metadata
    assert len(ledger) == 1
    # outputs taken behind one nobody takes are not kept: the arrival queue stays near the live count
    big = RequestLedger(max_tokens=1 << 20)
    big.add([1, 2], _record(0.5), [])
    for k in range(3000):
        big.add([5, k], _record(0.5), [])
        big.attach([_sample(PROMPT, [5, k])])
    assert len(big) == 1 and len(big._fifo) <= 1024 + 3


def test_trained_tokens_no_record_covers_are_named_and_refused_under_adapter_sync(caplog):
    """A record that covers only part of a sample's trained tokens: the rest is trained at the flags with one warning
    naming the span (refused under --lora-sync adapter, where nothing shows the adapter served them)."""
    s = _sample(PROMPT, [7, 8, 9, 10])
    s.metadata = {"sampling_params": [{**_record(1.0), "response_span": [0, 2]}]}
    with caplog.at_level(logging.WARNING):
        convert_samples_to_train_data(make_args(*ONE), [s], fn_path="f")
    assert "records no sampling parameters for response tokens 2..4" in caplog.text
    s.metadata["sampling_params"][0]["lora_path"] = "slime_policy"
    with pytest.raises(
        ValueError, match=r"for response tokens 2\.\.4 .*not the frozen base under --lora-sync adapter"
    ):
        convert_samples_to_train_data(make_args(*ONE, "--enable-lora", "--lora-sync", "adapter"), [s], fn_path="f")


# ---------------------------------------------------------------- the proxy in front of a real server
@pytest.fixture(scope="module")
def proxied(tiny_kit):
    proc, url = start_cpu_server(tiny_kit[0], "--random-seed", "3")
    ledger = RequestLedger(max_tokens=1 << 16)
    proxy = RecordingProxy(url, ledger, timeout=120).start("127.0.0.1")
    try:
        yield url, proxy.url, ledger
    finally:
        proxy.stop()
        stop_cpu_server(proc)


def _generate(url, **body):
    r = HTTP.post(f"{url}/generate", json=body, timeout=120)
    return r.status_code, r.json()


def test_answers_pass_through_unchanged_errors_included(proxied):
    server, proxy, ledger = proxied
    body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
    _generate(server, **body)  # both answers below then reuse the prompt's cache alike
    direct, through = _generate(server, **body), _generate(proxy, **body)
    for d in (direct[1], through[1]):
        for key in ("e2e_latency", "id"):
            d["meta_info"].pop(key)
    assert through == direct and direct[0] == 200
    bad = {"input_ids": PROMPT, "sampling_params": {"temperature": -1}}
    assert _generate(proxy, **bad) == _generate(server, **bad) and _generate(proxy, **bad)[0] == 400
    assert HTTP.get(f"{proxy}/model_info", timeout=30).json() == HTTP.get(f"{server}/model_info", timeout=30).json()


def test_a_user_generate_that_changes_the_temperature_is_scored_at_it(proxied):
    """What a naive generate function does: its own temperature (0.6 against the flag's 1.0), no record. Through the
    proxy the sample is trained at 0.6 per token; without it, at 1.0 (a biased importance ratio, no error)."""
    _, proxy, ledger = proxied
    status, out = _generate(
        proxy, input_ids=PROMPT, sampling_params={"temperature": 0.6, "max_new_tokens": 5}, return_logprob=True
    )
    assert status == 200
    s = _sample(PROMPT, out["output_ids"])
    assert ledger.attach([s]) == 1
    [rec] = s.metadata["sampling_params"]
    assert rec["temperature"] == 0.6 and rec["origin"] == "engine echo, recorded at the router"
    assert s.weight_version_spans == [{"version": out["meta_info"]["weight_version"], "start": 0, "end": 5}]
    data = convert_samples_to_train_data(make_args(*ONE, "--rollout-temperature", "1.0"), [s], fn_path="f")
    assert data["rollout_temperatures"][0].tolist() == pytest.approx([0.6] * 5)


def test_a_streamed_penalised_generate_is_refused_naming_the_router(proxied):
    _, proxy, ledger = proxied
    body = {"input_ids": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 4, "frequency_penalty": 0.5}}
    with HTTP.post(f"{proxy}/generate", json=body, stream=True, timeout=120) as r:
        events = [
            json.loads(line[5:]) for line in r.iter_lines() if line.startswith(b"data:") and b"[DONE]" not in line
        ]
    s = _sample(PROMPT, events[-1]["output_ids"])
    ledger.attach([s])
    with pytest.raises(ValueError, match=r"sampled by a request through slime's router .*frequency_penalty=0.5"):
        convert_samples_to_train_data(make_args(*ONE), [s], fn_path="f")


def test_a_batch_with_n_samples_per_prompt_gives_each_output_its_prompts_parameters(proxied):
    _, proxy, ledger = proxied
    other = [6, 7, 8]
    sps = [{"temperature": 0.5, "max_new_tokens": 3, "n": 2}, {"temperature": 1.5, "max_new_tokens": 3, "n": 2}]
    status, outs = _generate(proxy, input_ids=[PROMPT, other], sampling_params=sps)
    assert status == 200 and len(outs) == 4
    samples = [
        _sample(p, o["output_ids"], index=k) for k, (p, o) in enumerate(zip([PROMPT, PROMPT, other, other], outs))
    ]
    assert ledger.attach(samples) == 4
    assert [x.metadata["sampling_params"][0]["temperature"] for x in samples] == [0.5, 0.5, 1.5, 1.5]


def test_start_up_points_the_runs_router_address_at_the_proxy(proxied):
    """What the rollout controller does first: user code reading args.sglang_router_ip/port (or the policy's entry
    of args.sglang_model_routers) reaches the proxy; nothing starts under --no-check-sampling-params."""
    server, _, _ = proxied
    port = int(server.rsplit(":", 1)[1])
    args = make_args("--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(port))
    args.sglang_model_routers = {"policy": ("127.0.0.1", port), "judge": ("127.0.0.1", 1)}
    proxy, ledger = start_recording_proxy(args)
    try:
        assert args.sglang_router_port == proxy.handle.port != port
        assert args.sglang_router_behind_proxy == ("127.0.0.1", port)
        assert router_url(args) == server  # slime's own generate records itself: no extra hop
        assert args.sglang_model_routers == {"policy": ("127.0.0.1", proxy.handle.port), "judge": ("127.0.0.1", 1)}
        status, out = _generate(
            f"http://127.0.0.1:{args.sglang_router_port}", input_ids=PROMPT, sampling_params={"max_new_tokens": 2}
        )
        assert status == 200 and len(ledger) == 1
    finally:
        proxy.stop()
    off = make_args("--sglang-router-ip", "127.0.0.1", "--sglang-router-port", str(port), "--no-check-sampling-params")
    assert start_recording_proxy(off) == (None, None) and off.sglang_router_port == port


def test_record_generate_maps_outputs_to_their_prompts_adapters():
    ledger = RequestLedger(max_tokens=100)
    body = {"input_ids": [PROMPT, [6]], "lora_path": ["slime_policy", None], "sampling_params": {"temperature": 0.9}}
    meta = {"finish_reason": {"type": "length"}, "weight_version": "3"}
    assert (
        record_generate(
            ledger, body, [{"output_ids": [1, 2], "meta_info": meta}, {"output_ids": [3], "meta_info": meta}]
        )
        == 2
    )
    a, b = _sample(PROMPT, [1, 2]), _sample([6], [3])
    ledger.attach([a, b])
    assert a.metadata["sampling_params"][0]["lora_path"] == "slime_policy"
    assert b.metadata["sampling_params"][0]["lora_path"] is None
    assert b.weight_version_spans == [{"version": "3", "start": 0, "end": 1}]


def test_an_openai_request_records_the_adapter_its_model_or_lora_path_names():
    """As SGLang resolves it: `model: "<base>:<adapter>"` wins over `lora_path`; a plain model name is no adapter."""
    answer = {"choices": [{"response_token_ids": [1, 2], "prompt_token_ids": PROMPT, "finish_reason": "stop"}]}
    for body, adapter in [
        ({"model": "m:slime_policy", "lora_path": "other"}, "slime_policy"),
        ({"model": "m", "lora_path": "slime_policy"}, "slime_policy"),
        ({"model": "m"}, None),
    ]:
        ledger = RequestLedger(max_tokens=100)
        assert record_openai(ledger, "/v1/chat/completions", {"messages": MESSAGES, **body}, answer, {}) == 1
        ledger.attach([sample := _sample(PROMPT, [1, 2])])
        assert sample.metadata["sampling_params"][0]["lora_path"] == adapter, body
    # a served name with a colon in it names no adapter when the engine knows it (the CPU server passes its own)
    assert openai_requested_adapter({"model": "s3://b/m"}, "s3://b/m") is None
    assert openai_requested_adapter({"model": "s3://b/m:a"}, "s3://b/m") == "a"


def test_a_text_batch_gives_each_prompts_n_outputs_its_own_parameters():
    """A batch of text prompts (no input ids to match on), n = 2 each: SGLang answers prompt after prompt, so outputs
    0-1 were sampled with the first prompt's parameters and 2-3 with the second's; an unfinished output is skipped."""
    ledger = RequestLedger(max_tokens=100)
    sps = [{"temperature": 0.5, "n": 2}, {"temperature": 1.5, "n": 2}]
    done, running = {"finish_reason": {"type": "stop"}}, {"finish_reason": None}
    outputs = [{"output_ids": [10 + k], "meta_info": done} for k in range(4)]
    outputs[3]["meta_info"] = running
    assert record_generate(ledger, {"text": ["a", "b"], "sampling_params": sps}, outputs) == 3
    samples = [_sample([1], [10 + k], index=k) for k in range(4)]
    assert ledger.attach(samples) == 3
    assert [x.metadata["sampling_params"][0]["temperature"] for x in samples[:3]] == [0.5, 0.5, 1.5]
    assert not samples[3].metadata


# ---------------------------------------------------------------- OpenAI requests: SGLang's defaults, recorded
@pytest.fixture(scope="module")
def chat_kit(tiny_kit, tmp_path_factory):
    """The tiny model with a generation_config.json that recommends sampling parameters, as published checkpoints do
    (Qwen3: temperature 0.6, top_p 0.95, top_k 20)."""
    import shutil

    kit = tmp_path_factory.mktemp("chat_kit") / "model"
    shutil.copytree(tiny_kit[0], kit)
    config = json.loads((kit / "generation_config.json").read_text())
    (kit / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.6, "top_k": 20}))
    return str(kit)


@pytest.fixture(scope="module")
def chat_proxied(chat_kit):
    proc, url = start_cpu_server(chat_kit, "--random-seed", "3")
    ledger = RequestLedger(max_tokens=1 << 16)
    proxy = RecordingProxy(url, ledger, timeout=120, chat_defaults={"temperature": 0.6, "top_k": 20}).start(
        "127.0.0.1"
    )
    try:
        yield url, proxy.url, ledger
    finally:
        proxy.stop()
        stop_cpu_server(proc)


MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def _v1(url, path, **body):
    r = HTTP.post(f"{url}{path}", json={"model": "m", "max_tokens": 6, "seed": 11, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_chat_requests_take_the_generation_configs_sampling_defaults_as_sglang_does(chat_proxied):
    """SGLang's /v1/chat/completions fills what a request leaves out from generation_config.json (temperature 0.6,
    top_k 20 here); /v1/completions never does. Seen from outside: with the same seed each OpenAI answer equals the
    /generate of the same ids at the parameters SGLang would apply, and `return_token_ids` returns those ids."""
    server, _, _ = chat_proxied
    chat = _v1(server, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True)
    ids = chat["prompt_token_ids"]

    def generate(**sp):
        _, out = _generate(server, input_ids=ids, sampling_params={"max_new_tokens": 6, "sampling_seed": 11, **sp})
        return out["output_ids"]

    assert chat["response_token_ids"] == generate(temperature=0.6, top_k=20) != generate()
    explicit = _v1(server, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True, temperature=1.3)
    assert explicit["response_token_ids"] == generate(temperature=1.3, top_k=20)
    completion = _v1(server, "/v1/completions", prompt=ids, return_token_ids=True)
    assert completion["prompt_token_ids"] == ids and completion["token_ids"] == generate()
    assert "response_token_ids" not in _v1(server, "/v1/chat/completions", messages=MESSAGES)


def test_a_chat_request_through_the_router_is_recorded_with_what_sglang_applied(chat_proxied):
    """A user's generate function that calls /v1/chat/completions (with return_token_ids, to train on the ids) and sets
    no temperature samples at the checkpoint's recommended 0.6 and top-k 20, not --rollout-temperature: recorded at
    the router, the sample is refused (top-k needs kept sets the OpenAI endpoint cannot return) instead of being
    trained as if sampled at 1.0; its explicit parameters are recorded as sent."""
    _, proxy, ledger = chat_proxied
    chat = _v1(proxy, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True)
    s = _sample(chat["prompt_token_ids"], chat["response_token_ids"])
    assert ledger.attach([s]) == 1
    [rec] = s.metadata["sampling_params"]
    assert (rec["temperature"], rec["top_k"], rec["top_p"]) == (0.6, 20, 1.0)
    assert rec["origin"].startswith("/v1/chat/completions request")
    with pytest.raises(ValueError, match=r"sampled by a request through slime's router .*top_k=20"):
        convert_samples_to_train_data(make_args(*ONE), [s], fn_path="f")
    # its own temperature and top_k: scored at 0.8 per token
    chat = _v1(proxy, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True, temperature=0.8, top_k=-1)
    s = _sample(chat["prompt_token_ids"], chat["response_token_ids"])
    assert ledger.attach([s]) == 1
    data = convert_samples_to_train_data(make_args(*ONE, "--rollout-temperature", "1.0"), [s], fn_path="f")
    assert data["rollout_temperatures"][0].tolist() == pytest.approx([0.8] * len(chat["response_token_ids"]))
    # a client's logit_bias shapes what the engine samples (as SGLang applies it): recorded, so the sample is refused
    biased = dict(temperature=0.8, top_k=-1, logit_bias={"5": 3.0}, max_tokens=4)
    chat = _v1(proxy, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True, **biased)
    s = _sample(chat["prompt_token_ids"], chat["response_token_ids"])
    assert ledger.attach([s]) == 1 and s.metadata["sampling_params"][0]["logit_bias"] is True
    with pytest.raises(ValueError, match="logit_bias"):
        convert_samples_to_train_data(make_args(*ONE, "--rollout-temperature", "0.8"), [s], fn_path="f")


def test_a_streamed_completion_through_the_router_is_recorded(chat_proxied):
    """A streamed /v1/completions with return_token_ids: its chunks' token ids, joined, are recorded with the
    request's temperature (a streamed chat carries no ids: SGLang refuses return_token_ids there)."""
    _, proxy, ledger = chat_proxied
    body = {"model": "m", "prompt": [5, 9, 11], "max_tokens": 6, "temperature": 0.7, "seed": 2, "stream": True}
    with HTTP.post(f"{proxy}/v1/completions", json={**body, "return_token_ids": True}, stream=True, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    ids = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert len(ids) == 6 and events[0]["choices"][0]["prompt_token_ids"] == [5, 9, 11]
    s = _sample([5, 9, 11], ids)
    assert ledger.attach([s]) == 1
    [rec] = s.metadata["sampling_params"]
    assert rec["temperature"] == 0.7 and rec["origin"].startswith("/v1/completions request")


def test_the_engines_chat_defaults_follow_sglangs_sampling_defaults_flag(chat_kit):
    """What the proxy assumes the engines apply: --hf-checkpoint's recommendations under SGLang's default
    `--sampling-defaults model`, OpenAI's under `--sglang-sampling-defaults openai` (which the CPU server takes too)."""
    from slime.backends.sglang_utils.server_launch import server_command
    from slime.rollout.recording_proxy import chat_sampling_defaults

    args = make_args()
    args.hf_checkpoint = chat_kit
    assert chat_sampling_defaults(args) == {"temperature": 0.6, "top_k": 20}
    openai = make_args("--sglang-sampling-defaults", "openai")
    openai.hf_checkpoint = chat_kit
    assert chat_sampling_defaults(openai) == {}
    kind, argv = server_command(openai, 0, "127.0.0.1", 1, 2, "127.0.0.1:3")
    assert kind == "cpu" and argv[argv.index("--sampling-defaults") + 1] == "openai"
    proc, url = start_cpu_server(chat_kit, "--random-seed", "3", "--sampling-defaults", "openai")
    try:
        chat = _v1(url, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True)
        sp = {"max_new_tokens": 6, "sampling_seed": 11}
        _, out = _generate(url, input_ids=chat["prompt_token_ids"], sampling_params=sp)
        assert chat["response_token_ids"] == out["output_ids"]  # OpenAI's temperature 1.0, no top-k
    finally:
        stop_cpu_server(proc)
