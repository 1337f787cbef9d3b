"""The official OpenAI and Anthropic SDKs drive slime's agent adapters over a real CPU engine serving a tiny
tool-calling policy; the samples' tokens, loss masks and log-probs are checked against what the engine returned
(captured by a recording proxy in the router's place) and against a transformers forward pass."""

import json
import logging
import threading
import time

import anthropic
import openai
import pytest
import requests
import torch
from aiohttp import ClientSession, web

from slime.agent.adapters import AnthropicAdapter, OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils.types import Sample
from tests._agent_kit import CALCULATOR, build_agent_model
from tests.test_cpu_server import _events, start_cpu_server, stop_cpu_server
from tests.test_sglang_contract import needs_side_venv, run_side

pytestmark = pytest.mark.timeout(600)


class Recorder:
    """Forwards /generate to the engine and keeps every (headers, request, response)."""

    def __init__(self, engine_url):
        self.engine_url, self.calls, self.lock = engine_url, [], threading.Lock()
        self.app = web.Application()
        self.app.router.add_post("/generate", self.generate)

    async def generate(self, request):
        body = await request.json()
        async with ClientSession() as s, s.post(self.engine_url + "/generate", json=body) as r:
            status, text = r.status, await r.text()
        with self.lock:
            self.calls.append((dict(request.headers), body, json.loads(text) if status == 200 else None))
        return web.Response(status=status, text=text, content_type="application/json")

    def take(self):
        with self.lock:
            calls, self.calls = self.calls, []
        return calls


@pytest.fixture(scope="module")
def kit(tiny_kit, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = build_agent_model(tiny_kit[0], str(tmp_path_factory.mktemp("agent") / "model"))
    return model_dir, AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def stack(kit):
    proc, engine_url = start_cpu_server(kit[0], "--random-seed", "1")
    recorder = Recorder(engine_url)
    rec = run_app_in_thread(recorder.app)
    kw = dict(tokenizer=kit[1], sglang_url=rec.url, tool_parser="qwen25", reasoning_parser="qwen3")
    oa, an = OpenAIAdapter(**kw), AnthropicAdapter(**kw)
    oa_h, an_h = run_app_in_thread(oa.app), run_app_in_thread(an.app)
    recorder.take()
    yield {"openai": (oa, oa_h.url), "anthropic": (an, an_h.url), "recorder": recorder, "engine": engine_url}
    for h in (oa_h, an_h, rec):
        h.stop()
    stop_cpu_server(proc)


def test_the_cpu_server_answers_tool_calls_with_sglangs_tool_call_parser(stack, kit):
    """The OpenAI SDK straight at a CPU server started with --tool-call-parser qwen25 (as SGLang with it): the
    model's call comes back as message.tool_calls (finish_reason "tool_calls"), the call sent back with the tool's
    result gets the answer; streamed, the call comes in SGLang's pieces; without the parser (the `stack` engine) the
    call stays text, as on SGLang."""
    import openai

    proc, url = start_cpu_server(kit[0], "--random-seed", "1", "--tool-call-parser", "qwen25")
    try:
        assert requests.get(url + "/model_info", timeout=30).json()["tool_call_parser"] == "qwen25"  # as SGLang
        client = openai.OpenAI(api_key="x", base_url=url + "/v1", max_retries=0)
        ask = dict(model="m", tools=[CALCULATOR], temperature=0, max_tokens=200)
        messages = [{"role": "user", "content": "What is 12*5?"}]
        r = client.chat.completions.create(messages=messages, **ask)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        [call] = choice.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "calculator"
        assert json.loads(call.function.arguments) == {"expression": "12*5"}
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "60"},
        ]
        r = client.chat.completions.create(messages=messages, **ask)
        assert (r.choices[0].message.content, r.choices[0].finish_reason, r.choices[0].message.tool_calls) == (
            "60",
            "stop",
            None,
        )
        # streamed, as SGLang streams it: the call's id and name, then its arguments in pieces; "tool_calls" at the end
        pieces, finish, text = [], None, ""
        for c in client.chat.completions.create(messages=messages[:1], stream=True, logprobs=True, **ask):
            for choice in c.choices:
                pieces += choice.delta.tool_calls or []
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert finish == "tool_calls" and text == "" and len(pieces) > 2 and {p.index for p in pieces} == {0}
        assert pieces[0].id.startswith("call_") and pieces[0].function.name == "calculator"
        assert all(p.id is None and p.function.name is None for p in pieces[1:])
        assert json.loads("".join(p.function.arguments for p in pieces)) == {"expression": "12*5"}
    finally:
        stop_cpu_server(proc)
    plain = openai.OpenAI(api_key="x", base_url=stack["engine"] + "/v1", max_retries=0)
    r = plain.chat.completions.create(messages=messages[:1], **ask)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


@pytest.mark.slow  # development tier: 10-18 s of importing SGLang in the side venv
@needs_side_venv
def test_a_streamed_chat_with_tools_is_what_sglangs_own_classes_serialise(kit, tmp_path):
    """Every chunk of a streamed chat with tools (log-probs, usage in each chunk and at the end), parsed by the class
    SGLang builds it with and serialised again, is unchanged: the parser's text and call pieces (pydantic
    ChatCompletionStreamResponse), the role, log-prob and finish chunks (sse_utils' msgspec StreamChunk)."""
    proc, url = start_cpu_server(kit[0], "--random-seed", "1", "--tool-call-parser", "qwen25")
    try:
        body = {"model": "m", "tools": [CALCULATOR], "temperature": 0, "max_tokens": 200, "logprobs": True}
        body.update(messages=[{"role": "user", "content": "What is 12*5?"}], top_logprobs=1)
        chunks = _events(url, "/v1/chat/completions", {**body, "stream_options": {"continuous_usage_stats": True}})
    finally:
        stop_cpu_server(proc)
    assert sum("tool_calls" in c["choices"][0]["delta"] for c in chunks) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    (tmp_path / "chunks.json").write_text(json.dumps(chunks))
    code = """
import json, sys
import msgspec
from sglang.srt.entrypoints.openai.protocol import ChatCompletionStreamResponse, ChoiceLogprobs
from sglang.srt.entrypoints.openai.sse_utils import StreamChunk

for c in json.load(open(sys.argv[1])):
    delta = c["choices"][0]["delta"]
    if "tool_calls" in delta or delta.get("role", "") is None:  # _process_tool_call_stream's pydantic chunks
        again = json.loads(ChatCompletionStreamResponse.model_validate(c).model_dump_json())
    else:
        again = json.loads(msgspec.json.encode(msgspec.convert(c, StreamChunk)))
        lp = c["choices"][0]["logprobs"]
        assert lp is None or ChoiceLogprobs.model_validate(lp).model_dump() == lp, lp
    assert again == c, (c, again)
print("unchanged")
"""
    run = run_side(code, str(tmp_path / "chunks.json"))
    assert run.returncode == 0 and "unchanged" in run.stdout, run.stderr[-3000:]


def finish_all(adapter, sid, **kw):
    import asyncio

    return asyncio.run(adapter.finish_session(sid, base_sample=Sample(index=11, group_index=4, prompt="q"), **kw))


def check_against_engine(sample, calls, model):
    """The sample is the last call's prompt + output; each call's sampled span is trained with its log-probs."""
    first, last = calls[0][1], calls[-1]
    out_ids = [p[1] for p in last[2]["meta_info"]["output_token_logprobs"]]
    assert sample.tokens == last[1]["input_ids"] + out_ids
    prompt_len = len(first["input_ids"])
    assert sample.response_length == len(sample.tokens) - prompt_len
    expect_mask = [0] * sample.response_length
    expect_lp = [0.0] * sample.response_length
    for _, req, resp in calls:
        pairs = resp["meta_info"]["output_token_logprobs"]
        start = len(req["input_ids"]) - prompt_len
        assert sample.tokens[len(req["input_ids"]) : len(req["input_ids"]) + len(pairs)] == [p[1] for p in pairs]
        for k, (lp, _tid, _txt) in enumerate(pairs):
            expect_mask[start + k], expect_lp[start + k] = 1, lp
    assert sample.loss_mask == expect_mask
    assert sample.rollout_log_probs == expect_lp
    # each trained token carries the weight version the engine decoded it under (its per-token spans)
    versions = [None] * sample.response_length
    for span in sample.weight_version_spans:
        versions[span["start"] : span["end"]] = [span["version"]] * (span["end"] - span["start"])
    assert versions == [last[2]["meta_info"]["weight_version"] if m else None for m in expect_mask]
    # independent: the trained log-probs are the policy's own (a transformers forward on the sample's tokens)
    with torch.no_grad():
        logits = model(torch.tensor([sample.tokens])).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
    ref = ref[prompt_len - 1 :]
    trained = torch.tensor(sample.loss_mask, dtype=torch.bool)
    assert torch.allclose(torch.tensor(sample.rollout_log_probs)[trained], ref[trained], atol=1e-4)


def test_openai_sdk_tools_multi_turn_streaming_and_branches(stack, kit):
    adapter, url = stack["openai"]
    recorder = stack["recorder"]
    adapter.open_session("oa-1", sampling_defaults={"temperature": 0})
    client = openai.OpenAI(api_key="oa-1", base_url=url + "/v1", max_retries=0)

    messages = [{"role": "user", "content": "What is 3+4?"}]
    r = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=128)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert (
        msg.model_extra["reasoning_content"] == "\nadd them\n"
    )  # as SGLang parses it: the newlines inside <think> stay
    [call] = msg.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "3+4"})
    messages += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "7"}]

    r = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=64)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("The answer is 7.", "stop")
    messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And times 2?"}]

    # streamed: the SDK reassembles the tool call from the deltas
    stream = client.chat.completions.create(
        model="policy",
        messages=messages,
        tools=[CALCULATOR],
        max_tokens=128,
        stream=True,
        stream_options={"include_usage": True},
    )
    name, args, call_id, finish, usage = "", "", None, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for tc in ch.delta.tool_calls or []:
                call_id = tc.id or call_id
                name += tc.function.name or ""
                args += tc.function.arguments or ""
    assert (name, json.loads(args), finish) == ("calculator", {"expression": "7*2"}, "tool_calls")
    assert usage.completion_tokens > 0
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "14"},
    ]
    r = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=32)
    assert r.choices[0].message.content == "14"
    main_calls = recorder.take()

    # a sub-agent with its own system prompt, then the main history compacted: each its own branch
    sub = [{"role": "system", "content": "You check sums."}, {"role": "user", "content": "Is 3+4=7?"}]
    assert client.chat.completions.create(model="p", messages=sub, max_tokens=16).choices[0].message.content == "yes"
    sub_calls = recorder.take()
    compact = [{"role": "user", "content": "Summary: 3+4=7, checked. Finish."}]
    r = client.chat.completions.create(model="p", messages=compact, tools=[CALCULATOR], max_tokens=16)
    assert r.choices[0].message.content == "Done: 7."
    compact_calls = recorder.take()

    samples = finish_all(adapter, "oa-1", reward=1.0)
    assert len(samples) == 3 and {s.rollout_id for s in samples} == {11}
    assert all(s.reward == 1.0 and s.status == Sample.Status.COMPLETED for s in samples)
    for sample, calls in zip(samples, (main_calls, sub_calls, compact_calls)):
        check_against_engine(sample, calls, kit[2])
    assert len(main_calls) == 4 and samples[0].metadata["agent"]["num_tool_calls"] == 2
    # every engine call carried the session id as the router's routing key
    assert {h["X-SMG-Routing-Key"] for h, _, _ in main_calls + sub_calls + compact_calls} == {"oa-1"}
    assert "<tool_response>\n7\n</tool_response>" in samples[0].response
    assert adapter.open_sessions() == []


def test_openai_sdk_responses_api_tool_loop(stack, kit):
    """`client.responses.create` / `.stream` through the adapter: reasoning and function_call items out, the items
    sent back (with the tool's output) continue the same branch; requests it cannot honour are refused."""
    adapter, url = stack["openai"]
    recorder = stack["recorder"]
    recorder.take()
    adapter.open_session("resp-1", sampling_defaults={"temperature": 0})
    client = openai.OpenAI(api_key="resp-1", base_url=url + "/v1", max_retries=0)
    fn = CALCULATOR["function"]
    tool = {"type": "function", "name": fn["name"], "description": fn["description"], "parameters": fn["parameters"]}

    items = [{"role": "user", "content": "What is 3+4?"}]
    r = client.responses.create(model="policy", input=items, tools=[tool], max_output_tokens=128, store=False)
    assert r.status == "completed" and [o.type for o in r.output] == ["reasoning", "function_call"]
    reasoning, call = r.output
    assert reasoning.content[0].text == "\nadd them\n"  # as the chat API's reasoning_content
    assert (call.name, json.loads(call.arguments)) == ("calculator", {"expression": "3+4"})
    items += [o.model_dump(exclude_none=True) for o in r.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "7"})
    r = client.responses.create(model="policy", input=items, tools=[tool], max_output_tokens=64)
    assert (r.output_text, r.status, [o.type for o in r.output]) == ("The answer is 7.", "completed", ["message"])
    calls = recorder.take()
    assert r.usage.input_tokens == len(calls[1][1]["input_ids"])
    assert r.usage.output_tokens == len(calls[1][2]["meta_info"]["output_token_logprobs"])
    items += [o.model_dump(exclude_none=True) for o in r.output] + [{"role": "user", "content": "And times 2?"}]

    # streamed: the SDK's stream helper rebuilds the response from the events
    with client.responses.stream(model="policy", input=items, tools=[tool], max_output_tokens=128) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    [call] = final.output
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "calculator", {"expression": "7*2"})
    items += [
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "14"},
    ]
    with client.responses.stream(model="policy", input=items, tools=[tool], max_output_tokens=32) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == text == "14"
    calls += recorder.take()

    [sample] = finish_all(adapter, "resp-1", reward=1.0)  # one branch: each turn extends the one before
    check_against_engine(sample, calls, kit[2])
    assert len(calls) == 4 and sample.metadata["agent"]["num_tool_calls"] == 2

    adapter.open_session("resp-2")
    refused = openai.OpenAI(api_key="resp-2", base_url=url + "/v1", max_retries=0)
    for kw, param in [
        ({"previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"extra_body": {"bogus": 1}}, "bogus"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            refused.responses.create(model="p", input="hi", **kw)
        assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert finish_all(adapter, "resp-2") == [] and recorder.take() == []


def test_anthropic_sdk_tools_thinking_and_streaming(stack, kit):
    adapter, url = stack["anthropic"]
    recorder = stack["recorder"]
    adapter.open_session("an-1", sampling_defaults={"temperature": 0})
    client = anthropic.Anthropic(api_key="an-1", base_url=url, max_retries=0)
    tool = {
        "name": "calculator",
        "description": CALCULATOR["function"]["description"],
        "input_schema": CALCULATOR["function"]["parameters"],
    }
    messages = [{"role": "user", "content": "What is 3+4?"}]
    r = client.messages.create(model="policy", max_tokens=128, tools=[tool], messages=messages)
    assert r.stop_reason == "tool_use"
    thinking, use = r.content
    assert (thinking.type, thinking.thinking) == ("thinking", "\nadd them\n")
    assert (use.type, use.name, use.input) == ("tool_use", "calculator", {"expression": "3+4"})
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "7"}]},
    ]
    r = client.messages.create(model="policy", max_tokens=64, tools=[tool], messages=messages)
    assert (r.content[0].text, r.stop_reason) == ("The answer is 7.", "end_turn")
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": "And times 2?"},
    ]
    with client.messages.stream(model="policy", max_tokens=128, tools=[tool], messages=messages) as s:
        final = s.get_final_message()
    [use] = final.content
    assert (use.name, use.input, final.stop_reason) == ("calculator", {"expression": "7*2"}, "tool_use")
    assert final.usage.output_tokens > 0
    calls = recorder.take()
    n = client.messages.count_tokens(model="policy", messages=messages, tools=[tool]).input_tokens
    assert n == len(calls[-1][1]["input_ids"])

    [sample] = finish_all(adapter, "an-1")
    check_against_engine(sample, calls, kit[2])
    assert {h["X-SMG-Routing-Key"] for h, _, _ in calls} == {"an-1"}


def test_requests_the_adapters_cannot_honour_get_the_apis_error_shape(stack, caplog):
    oa, oa_url = stack["openai"]
    an, an_url = stack["anthropic"]
    recorder = stack["recorder"]
    oa.open_session("bad-oa", sampling_defaults={"temperature": 0})
    an.open_session("bad-an", sampling_defaults={"temperature": 0}, max_context_tokens=40)
    oc = openai.OpenAI(api_key="bad-oa", base_url=oa_url + "/v1", max_retries=0)
    ac = anthropic.Anthropic(api_key="bad-an", base_url=an_url, max_retries=0)
    user = [{"role": "user", "content": "What is 3+4?"}]

    def openai_error(**kw):
        with pytest.raises(openai.APIStatusError) as e:
            oc.chat.completions.create(model="p", **{"messages": user, **kw})
        return e.value.status_code, e.value.body

    status, body = openai_error(extra_body={"guided_regex": "x"})
    assert status == 400 and body["type"] == "invalid_request_error" and "'guided_regex'" in body["message"]
    status, body = openai_error(tools=[CALCULATOR], tool_choice="required")
    assert status == 400 and body["param"] == "tool_choice" and "'auto' or 'none'" in body["message"]
    status, body = openai_error(n=2)
    assert status == 400 and body["param"] == "n"
    # context too long: the engine (512-token context) refuses; its reason comes back in the API's shape
    status, body = openai_error(messages=[{"role": "user", "content": "3+4 " * 400}])
    assert status == 400 and "context length" in body["message"]
    with pytest.raises(openai.NotFoundError, match="unknown session 'nope'"):
        openai.OpenAI(api_key="nope", base_url=oa_url + "/v1", max_retries=0).chat.completions.create(
            model="p", messages=user
        )

    def anthropic_error(**kw):
        with pytest.raises(anthropic.APIStatusError) as e:
            ac.messages.create(model="p", **{"max_tokens": 8, "messages": user, **kw})
        assert e.value.body["type"] == "error"
        return e.value.status_code, e.value.body["error"]

    status, err = anthropic_error(extra_body={"container": "x"})
    assert (status, err["type"]) == (400, "invalid_request_error") and "'container'" in err["message"]
    status, err = anthropic_error(tool_choice={"type": "any"})
    assert status == 400 and "tool_choice type 'any'" in err["message"]
    status, err = anthropic_error(messages=[{"role": "user", "content": "3+4 " * 30}])
    assert status == 400 and err["message"].startswith("context too long")

    # none of the refused requests reached the engine but the one it refused itself; the sessions still work
    assert len(recorder.take()) == 1
    assert oc.chat.completions.create(model="p", messages=user, max_tokens=4).choices[0].message is not None
    assert finish_all(oa, "bad-oa")[0].response_length > 0
    assert finish_all(an, "bad-an") == []
    # a request after its session ended hears so (409), not "open it first"; the id may be opened again
    recorder.take()
    with pytest.raises(openai.ConflictError, match="session 'bad-oa' is already finished"):
        oc.chat.completions.create(model="p", messages=user, max_tokens=4)
    status, err = anthropic_error()
    assert status == 409 and "session 'bad-an' is already finished" in err["message"]
    assert recorder.take() == []
    an.open_session("bad-an", sampling_defaults={"temperature": 0})
    assert ac.messages.create(model="p", max_tokens=2, messages=user).content is not None
    assert len(finish_all(an, "bad-an")) == 1

    # a session never finished is dropped with its reason logged when the adapter closes
    oa.open_session("abandoned")
    with caplog.at_level(logging.WARNING, logger="slime.agent.adapters.common"):
        oa.close()
    assert "agent session abandoned dropped after 0 turn(s)" in caplog.text
    assert "the adapter closed before finish_session" in caplog.text
    assert oa.open_sessions() == []
    with pytest.raises(
        openai.ConflictError, match=r"'abandoned' was dropped \(the adapter closed before finish_session"
    ):
        openai.OpenAI(api_key="abandoned", base_url=oa_url + "/v1", max_retries=0).chat.completions.create(
            model="p", messages=user
        )


def test_openai_agents_sdk_runs_a_tool_loop_through_the_adapter(stack, kit):
    """An agent framework users pick (the OpenAI Agents SDK) runs its own tool loop against the adapter."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    adapter, url = stack["openai"]
    recorder = stack["recorder"]
    recorder.take()
    seen = []

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        seen.append(expression)
        return str(eval(expression, {"__builtins__": {}}))  # the test's own fixed expressions only

    async def go():
        adapter.open_session("agents-1", sampling_defaults={"temperature": 0})
        client = openai.AsyncOpenAI(api_key="agents-1", base_url=url + "/v1", max_retries=0)
        model = OpenAIChatCompletionsModel(model="policy", openai_client=client)
        agent = Agent(
            name="math", model=model, tools=[calculator], model_settings=ModelSettings(temperature=0, max_tokens=128)
        )
        result = await Runner.run(agent, "What is 3+4?")
        samples = await adapter.finish_session("agents-1", base_sample=Sample(index=2), reward=1.0)
        return result, samples

    result, samples = asyncio.run(go())
    assert seen == ["3+4"] and result.final_output == "The answer is 7."
    calls = recorder.take()
    assert len(calls) == 2 and {h["X-SMG-Routing-Key"] for h, _, _ in calls} == {"agents-1"}
    # the framework drops reasoning from the history it sends back, so turn 2's prompt does not extend turn 1's
    # sampled tokens: two branches, each response trained once with the engine's log-probs
    by_branch = [[c] for c in calls] if len(samples) == 2 else [calls]
    for sample, branch_calls in zip(samples, by_branch):
        check_against_engine(sample, branch_calls, kit[2])
    assert sum(sum(s.loss_mask) for s in samples) == sum(
        len(c[2]["meta_info"]["output_token_logprobs"]) for c in calls
    )


def test_calculator_agent_example_generates_trained_samples(stack, kit, monkeypatch):
    """examples/calculator_agent: its generate function runs the agent loop on the engine and scores the episode."""
    import asyncio
    import os

    from tests._args import make_args

    monkeypatch.syspath_prepend(
        os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "calculator_agent")
    )
    import calculator_agent

    recorder = stack["recorder"]
    recorder.take()
    host, port = stack["openai"][0].sglang_url.removeprefix("http://").split(":")  # the recorder, as the router
    args = make_args(hf_checkpoint=kit[0], sglang_router_ip=host, sglang_router_port=int(port))
    sp = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 128, "stop": None, "no_stop_trim": True}
    try:
        samples = asyncio.run(
            calculator_agent.generate(
                args, Sample(index=3, prompt=[{"role": "user", "content": "What is 3+4?"}], label="7"), sp
            )
        )
    finally:
        calculator_agent._state.pop("handle").stop()
        calculator_agent._state.clear()
    calls = recorder.take()
    [sample] = samples
    assert (
        sample.reward == 1.0 and sample.metadata["tool_calls"] == 1 and sample.metadata["answer"] == "The answer is 7."
    )
    check_against_engine(sample, calls, kit[2])


def test_an_engine_abort_ends_the_turn_with_an_error_and_records_nothing(stack):
    """The rollout stopping aborts generations: the client gets a 503 in the API's shape, the session no turn."""
    adapter, url = stack["openai"]
    stack["recorder"].take()
    adapter.open_session("abort-1", sampling_defaults={"temperature": 1.0, "ignore_eos": True})
    client = openai.OpenAI(api_key="abort-1", base_url=url + "/v1", max_retries=0)
    errors = []

    def call():
        try:
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Count."}], max_tokens=450)
        except openai.APIStatusError as e:
            errors.append(e)

    t = threading.Thread(target=call)
    t.start()
    # abort only once the engine runs the request: an abort that comes first finds nothing to abort
    deadline = time.monotonic() + 30
    while requests.get(stack["engine"] + "/get_load", timeout=10).json()[0]["num_reqs"] == 0:
        assert time.monotonic() < deadline and t.is_alive(), "the generation never reached the engine"
        time.sleep(0.02)
    requests.post(stack["engine"] + "/abort_request", json={"abort_all": True}, timeout=10)
    t.join(60)
    assert not t.is_alive(), "the client call did not return within 60 s of the abort"
    [err] = errors
    assert err.status_code == 503 and "aborted" in err.body["message"] and err.body["type"] == "overloaded_error"
    assert finish_all(adapter, "abort-1") == []


def test_a_client_sampling_parameter_that_differs_from_the_sessions_is_refused(stack):
    """The trainer scores at the rollout's sampling parameters: a client's own temperature / top-k is refused in the
    API's error shape, naming the parameter, its value and the rollout flag's; an equal one is accepted. Each trained
    turn records what it was sampled with (the engine's echo)."""
    oa, oa_url = stack["openai"]
    an, an_url = stack["anthropic"]
    recorder = stack["recorder"]
    recorder.take()
    oa.open_session("sp-oa", sampling_defaults={"temperature": 0})
    an.open_session("sp-an", sampling_defaults={"temperature": 1.0})  # not greedy: top-k would change it
    oc = openai.OpenAI(api_key="sp-oa", base_url=oa_url + "/v1", max_retries=0)
    ac = anthropic.Anthropic(api_key="sp-an", base_url=an_url, max_retries=0)
    user = [{"role": "user", "content": "What is 3+4?"}]
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model="p", messages=user, max_tokens=4, temperature=0.6)
    body = e.value.body
    assert body["param"] == "temperature" and body["message"].startswith(
        "temperature=0.6 differs from this session's temperature=0 (--rollout-temperature)"
    )
    with pytest.raises(openai.BadRequestError, match="presence_penalty=0.5 differs"):
        oc.chat.completions.create(model="p", messages=user, max_tokens=4, presence_penalty=0.5)
    with pytest.raises(
        anthropic.BadRequestError, match=r"top_k=5 differs from this session's top_k=-1 \(--rollout-top-k"
    ):
        ac.messages.create(model="p", max_tokens=4, messages=user, extra_body={"top_k": 5})
    assert recorder.take() == []  # refused before the engine
    # the session's own values (greedy, however spelled) are accepted
    oc.chat.completions.create(model="p", messages=user, max_tokens=4, temperature=0.0, top_p=1.0)
    [(_, req, resp)] = recorder.take()
    [sample] = finish_all(oa, "sp-oa")
    n = len(resp["meta_info"]["output_token_logprobs"])
    [rec] = sample.metadata["sampling_params"]
    assert (rec["temperature"], rec["top_k"], rec["presence_penalty"]) == (1.0, 1, 0.0)  # greedy, normalised
    assert rec["lora_path"] is None  # the adapter its request named (no generate_fields here: the base)
    assert (
        rec["response_span"] == [0, n] and rec["origin"] == "engine echo" and "openai agent adapter" in rec["source"]
    )
    assert Sample.from_dict(sample.to_dict()).metadata["sampling_params"] == [rec]
    assert finish_all(an, "sp-an") == []


def test_top_p_replay_a_two_turn_session_carries_the_engines_kept_sets(stack, kit):
    """Under --rollout-top-p < 1 (temperature 0.7) the adapter asks for each step's kept set straight from a worker
    (the router drops return_sampling_mask): a router whose first listing holds only dead workers is re-read, and
    its /generate is never used. Every trained token is in its step's kept set, the sets are what the engine
    returned for the turn's request and what a transformers forward keeps at those parameters, the log-probs are
    renormalised over them, and the train data accepts the samples."""
    import asyncio

    from slime.rollout.sampling_provenance import check_sampling_params
    from slime.rollout.train_data import kept_sets_train_data
    from slime.utils.top_p_replay import kept_sets_error, sampling_is_truncated
    from tests._args import make_args

    recorder = stack["recorder"]
    recorder.take()
    rec_url = stack["openai"][0].sglang_url  # the recorder, in front of the engine
    listings = [["http://127.0.0.1:1", "http://127.0.0.1:2"], [rec_url]]  # dead workers, then the engine
    routed = []

    async def workers(request):
        urls = listings.pop(0) if len(listings) > 1 else listings[0]
        return web.json_response({"urls": urls, "workers": [{"url": u, "id": u} for u in urls]})

    async def generate(request):
        routed.append(await request.json())
        return web.json_response({"error": "the router drops return_sampling_mask"}, status=500)

    router = web.Application()
    router.router.add_get("/workers", workers)
    router.router.add_get("/list_workers", workers)
    router.router.add_post("/generate", generate)
    router_h = run_app_in_thread(router)
    args = make_args("--rollout-top-p", "0.9", "--rollout-temperature", "0.7", hf_checkpoint=kit[0])
    assert sampling_is_truncated(args) and args.rollout_top_k > 0  # top-p alone runs with the mask cap as top-k
    adapter = OpenAIAdapter(
        tokenizer=kit[1], sglang_url=router_h.url, tool_parser="qwen25", return_kept_sets=sampling_is_truncated(args)
    )
    handle = run_app_in_thread(adapter.app)
    try:
        sp = {"temperature": args.rollout_temperature, "top_p": args.rollout_top_p, "top_k": args.rollout_top_k}
        adapter.open_session("tp-1", sampling_defaults=sp)
        client = openai.OpenAI(api_key="tp-1", base_url=handle.url + "/v1", max_retries=0)
        messages = [{"role": "user", "content": "What is 3+4?"}]
        r = client.chat.completions.create(model="p", messages=messages, tools=[CALCULATOR], max_tokens=48)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And times 2?"}]
        client.chat.completions.create(model="p", messages=messages, tools=[CALCULATOR], max_tokens=24)
        samples = finish_all(adapter, "tp-1")
        # one engine is its own only worker (it lists none)
        single = OpenAIAdapter(tokenizer=kit[1], sglang_url=rec_url, return_kept_sets=True)
        assert asyncio.run(single._list_workers()) == [rec_url]
    finally:
        handle.stop()
        router_h.stop()
    calls = recorder.take()
    assert routed == [] and listings == [[rec_url]] and len(calls) == 2
    assert all(req["return_sampling_mask"] and "X-SMG-Routing-Key" not in h for h, req, _ in calls)
    for s in samples:
        expect_sets, expect_lp = [[] for _ in range(s.response_length)], [0.0] * s.response_length
        prompt_len = len(s.tokens) - s.response_length
        for _, req, resp in calls:  # the turns on this sample's path: their prompt + output prefix its tokens
            meta, n_in = resp["meta_info"], len(req["input_ids"])
            out = [p[1] for p in meta["output_token_logprobs"]]
            if s.tokens[: n_in + len(out)] == req["input_ids"] + out:
                expect_sets[n_in - prompt_len : n_in - prompt_len + len(out)] = meta["output_token_sampling_mask"]
                expect_lp[n_in - prompt_len : n_in - prompt_len + len(out)] = meta["output_token_sampling_logprobs"]
        offsets = [0]
        for kept in expect_sets:
            offsets.append(offsets[-1] + len(kept))
        assert s.rollout_top_p_token_ids == [t for kept in expect_sets for t in kept]
        assert s.rollout_top_p_token_offsets == offsets
        assert kept_sets_error(s) is None
        trained = [k for k, m in enumerate(s.loss_mask) if m]
        assert trained and all(s.tokens[prompt_len + k] in expect_sets[k] for k in trained)
        assert [s.rollout_log_probs[k] for k in trained] == pytest.approx([expect_lp[k] for k in trained], abs=1e-6)
        # independent: the top-k / top-p set of a transformers forward at the session's temperature
        with torch.no_grad():
            logits = kit[2](torch.tensor([s.tokens])).logits[0, prompt_len - 1 : -1].float()
        for k in trained:
            probs, order = torch.softmax(logits[k] / sp["temperature"], -1).sort(descending=True)
            before = probs.cumsum(0) - probs  # SGLang keeps a token while the mass before it is within top_p
            keep = order[(before <= sp["top_p"]) & (torch.arange(len(probs)) < sp["top_k"])]
            assert set(expect_sets[k]) == set(keep.tolist()), k
            ref = torch.log_softmax(logits[k][keep] / sp["temperature"], -1)[
                keep.tolist().index(s.tokens[prompt_len + k])
            ]
            assert s.rollout_log_probs[k] == pytest.approx(float(ref), abs=1e-4)
    assert {s.metadata["sampling_params"][0]["top_p"] for s in samples} == {0.9}
    check_sampling_params(args, samples, "test")  # truncated, with kept sets for every trained token
    data = kept_sets_train_data(args, samples, "test")
    assert [list(o) for o in data["rollout_top_p_token_offsets"]] == [s.rollout_top_p_token_offsets for s in samples]


def test_a_clients_own_top_p_is_replayed_when_allowed(stack, kit):
    """A run without truncating flags, an adapter that accepts clients' sampling parameters: a turn at the client's
    top-p 0.8 and temperature 0.7 asks its worker for the kept sets (top-p alone gets the engine's mask cap as its
    top-k), a turn at the session's parameters does not. The sample carries the first turn's sets (what a
    transformers forward keeps at the client's parameters) with its log-probs renormalised over them, the second
    turn's tokens empty spans and full-vocabulary log-probs; the train-data check accepts it, the per-token
    temperatures hold the client's 0.7 on the first turn."""
    from slime.rollout.sampling_provenance import check_sampling_params, rollout_temperatures
    from slime.rollout.train_data import kept_sets_train_data
    from tests._args import make_args

    recorder = stack["recorder"]
    recorder.take()
    args = make_args("--rollout-temperature", "1.0", hf_checkpoint=kit[0])
    cap = 64
    adapter = OpenAIAdapter(
        tokenizer=kit[1],
        sglang_url=stack["openai"][0].sglang_url,  # the recorder, in front of the one engine
        allow_client_sampling_params=True,
        sampling_mask_max_tokens=cap,
    )
    handle = run_app_in_thread(adapter.app)
    try:
        adapter.open_session("own-p", sampling_defaults={"temperature": 1.0, "top_p": 1.0, "top_k": -1})
        client = openai.OpenAI(api_key="own-p", base_url=handle.url + "/v1", max_retries=0)
        messages = [{"role": "user", "content": "What is 3+4?"}]
        r = client.chat.completions.create(model="p", messages=messages, max_tokens=24, top_p=0.8, temperature=0.7)
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And 5+6?"}]
        client.chat.completions.create(model="p", messages=messages, max_tokens=16)
        [s] = finish_all(adapter, "own-p")
    finally:
        handle.stop()
    (_, first, first_resp), (_, second, _) = recorder.take()
    assert first["return_sampling_mask"] and "return_sampling_mask" not in second
    assert {k: first["sampling_params"][k] for k in ("temperature", "top_p", "top_k")} == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": cap,
    }
    prompt_len = len(s.tokens) - s.response_length
    n_first = len(first_resp["meta_info"]["output_token_logprobs"])
    start = len(first["input_ids"]) - prompt_len
    assert start == 0 and s.tokens[: prompt_len + n_first] == first["input_ids"] + [
        p[1] for p in first_resp["meta_info"]["output_token_logprobs"]
    ]
    offsets = s.rollout_top_p_token_offsets
    spans = [s.rollout_top_p_token_ids[offsets[k] : offsets[k + 1]] for k in range(s.response_length)]
    assert all(spans[k] for k in range(n_first)) and not any(spans[n_first:])
    with torch.no_grad():
        logits = kit[2](torch.tensor([s.tokens])).logits[0, prompt_len - 1 : -1].float()
    trained = [k for k, m in enumerate(s.loss_mask) if m]
    assert trained[0] == 0 and trained[-1] >= n_first  # both turns are trained
    for k in trained:
        token = s.tokens[prompt_len + k]
        if k < n_first:  # independent: the top-k / top-p set of a transformers forward at the client's parameters
            probs, order = torch.softmax(logits[k] / 0.7, -1).sort(descending=True)
            before = probs.cumsum(0) - probs  # SGLang keeps a token while the mass before it is within top_p
            keep = order[(before <= 0.8) & (torch.arange(len(probs)) < cap)].tolist()
            assert set(spans[k]) == set(keep), k
            ref = torch.log_softmax(logits[k][keep] / 0.7, -1)[keep.index(token)]
        else:
            ref = torch.log_softmax(logits[k], -1)[token]
        assert s.rollout_log_probs[k] == pytest.approx(float(ref), abs=1e-4), k
    check_sampling_params(args, [s], "test")  # before: refused (top-p 0.8 without kept sets)
    assert list(kept_sets_train_data(args, [s], "test")["rollout_top_p_token_offsets"][0]) == offsets
    temps = rollout_temperatures(args, [s])[0]
    assert list(temps[:n_first]) == pytest.approx([0.7] * n_first) and set(temps[n_first:].tolist()) == {1.0}


def test_a_streamed_turn_the_client_has_read_is_recorded_when_it_finishes_the_session_at_once(stack, kit, monkeypatch):
    """A streamed answer reaches the client before the adapter records its turn; an agent that calls finish_session
    at once (a loaded machine widens the gap: here one second) still gets that turn in its sample, since
    finish_session waits for the requests in flight."""
    import asyncio

    from slime.agent.adapters.openai import OpenAIAdapter

    adapter, url = stack["openai"]
    stack["recorder"].take()
    respond = OpenAIAdapter._respond

    async def slow_after_answering(self, *a, **kw):
        response = await respond(self, *a, **kw)
        await asyncio.sleep(1.0)
        return response

    monkeypatch.setattr(OpenAIAdapter, "_respond", slow_after_answering)
    adapter.open_session("late-1", sampling_defaults={"temperature": 0})
    client = openai.OpenAI(api_key="late-1", base_url=url + "/v1", max_retries=0)
    messages = [{"role": "user", "content": "What is 3+4?"}]
    stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=16, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    [sample] = finish_all(adapter, "late-1", reward=1.0)
    calls = stack["recorder"].take()
    assert len(calls) == 1 and text
    check_against_engine(sample, calls, kit[2])


def test_session_id_fallbacks_and_refused_responses_settings():
    """Which header or body field names the session, per adapter and in order; and the Responses API refuses a
    non-empty `reasoning` setting and `truncation: "auto"` with a 400 naming the field. No engine: the hooks are
    called on adapters that never start."""
    from aiohttp.test_utils import make_mocked_request

    from slime.agent.adapters.common import AdapterError

    def req(**headers):
        return make_mocked_request("POST", "/v1/x", headers=headers)

    oa = OpenAIAdapter(tokenizer=None, sglang_url="http://127.0.0.1:1")
    an = AnthropicAdapter(tokenizer=None, sglang_url="http://127.0.0.1:1")
    body = {"metadata": {"session_id": "md", "user_id": "uid"}, "user": "u"}
    for sid in (oa._session_id, oa._responses._session_id):  # Chat Completions and Responses alike
        assert sid(req(Authorization="Bearer key"), body) == "key"
        assert sid(req(Authorization="Bearer  "), body) == "md"  # an empty token names nothing
        assert sid(req(), body) == "md"
        assert sid(req(), {"metadata": {}, "user": "u"}) == "u"
        assert sid(req(), {}) is None
    assert an._session_id(req(**{"x-api-key": "key", "Authorization": "Bearer tok"}), body) == "key"
    assert an._session_id(req(Authorization="Bearer tok"), body) == "tok"
    assert an._session_id(req(), body) == "uid"
    assert an._session_id(req(), {"metadata": {"session_id": "md"}}) is None

    ok = {"model": "p", "input": "hi"}
    oa._responses._check_body(dict(ok, reasoning={"effort": None, "summary": None}, truncation="disabled"))
    for field, value in (("reasoning", {"effort": "high"}), ("truncation", "auto")):
        with pytest.raises(AdapterError) as e:
            oa._responses._check_body(dict(ok, **{field: value}))
        assert e.value.status == 400 and e.value.param == field and field in e.value.message
