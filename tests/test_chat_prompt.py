"""The CPU server's chat prompt (slime/backends/cpu_server/chat_prompt.py) against SGLang's own request models and
template helpers: the messages, tools and template arguments a chat template gets are SGLang's, for tool calls,
tool results, content parts under both content formats, a trailing assistant message, continue_final_message,
message-level tools, chat_template_kwargs and reasoning_effort; SGLang's tool_choice checks."""

import json

import pytest

from slime.backends.cpu_server.chat_prompt import content_format, template_inputs
from slime.backends.cpu_server.sampling import RequestError
from tests.test_sglang_contract import needs_side_venv, run_side

STRING_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
OPENAI_TEMPLATE = "{% for m in messages %}{% for p in m['content'] %}{{ p.type }}{% endfor %}{% endfor %}"
CALC = {"function": {"name": "calc", "parameters": {"type": "object"}, "description": "Evaluate."}, "type": "function"}
ADD = {"type": "function", "function": {"strict": True, "name": "add"}}
CALL = {"type": "function", "function": {"name": "calc", "arguments": '{"expression": "6*7"}'}}
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 6*7?", "name": "ada"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}, {"type": "text", "text": "!"}]},
]
PARTS = [
    {"type": "text", "text": "Look"},
    {"type": "image_url", "image_url": {"url": "data:,x"}},
    {"type": "text", "text": "here"},
]
CASES = {
    "tools_calls_and_kwargs": (
        {"tools": [CALC, ADD], "chat_template_kwargs": {"flag": "on"}, "reasoning_effort": "low"},
        TURNS + [{"role": "user", "content": "And 6*8?"}],
        STRING_TEMPLATE,
    ),
    "reasoning_off": (
        {"reasoning": {"effort": "none"}, "chat_template_kwargs": {"thinking": True}},
        TURNS[:2],
        STRING_TEMPLATE,
    ),
    "reasoning_enabled": ({"reasoning": {"enabled": "yes"}}, TURNS[:2], STRING_TEMPLATE),
    "tool_choice_none": ({"tools": [CALC], "tool_choice": "none"}, TURNS, STRING_TEMPLATE),
    "trailing_assistant": ({}, TURNS[:2] + [{"role": "assistant", "content": "It is"}], STRING_TEMPLATE),
    "continue_final_message": (
        {"continue_final_message": True},
        TURNS[:2] + [{"role": "assistant", "content": "It is"}],
        STRING_TEMPLATE,
    ),
    "parts_as_string": ({}, [{"role": "user", "content": PARTS}], STRING_TEMPLATE),
    "parts_as_openai": ({}, [{"role": "user", "content": PARTS}] + TURNS[2:], OPENAI_TEMPLATE),
    "message_level_tools": (
        {},
        [{"role": "system", "content": "Tools below.", "tools": [ADD]}, {"role": "user", "content": "1+2?"}],
        STRING_TEMPLATE,
    ),
}


def ours(body, messages, template):
    inputs = template_inputs({**body, "messages": messages}, messages, content_format(template))
    return {
        "format": content_format(template),
        "messages": inputs.messages,
        "tools": inputs.tools,
        "kwargs": inputs.kwargs,
        "prefix": inputs.prefix,
        "images": inputs.images,
    }


@pytest.mark.slow  # development tier: 10-18 s of importing SGLang in the side venv
@needs_side_venv
def test_the_template_gets_what_sglang_gives_it(tmp_path):
    (tmp_path / "cases.json").write_text(json.dumps(CASES))
    code = """
import ast, copy, json, sys, typing
import orjson
import sglang.srt.entrypoints.openai.protocol as protocol
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.parser.jinja_template_utils import detect_jinja_template_content_format, process_content_for_template_format

# serving_chat's own functions, taken from its source (importing the module needs SGLang's multimodal stack)
source = open(protocol.__file__.replace("protocol.py", "serving_chat.py")).read()
wanted = {"normalize_tool_content", "parse_tool_call_arguments", "normalize_assistant_tool_call_arguments",
          "_handle_last_assistant_message", "_effective_tools"}
nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name in wanted]
assert {n.name for n in nodes} == wanted
space = {**vars(protocol), **vars(typing), "orjson": orjson}
exec(compile(ast.Module(body=nodes, type_ignores=[]), "serving_chat.py", "exec"), space)

out = {}
for name, (body, messages, template) in json.load(open(sys.argv[1])).items():
    req = ChatCompletionRequest.model_validate({**body, "messages": messages, "model": "m"})
    fmt = detect_jinja_template_content_format(template)
    msgs = [m.model_dump() for m in req.messages]  # serving_chat._apply_jinja_template, step by step
    for m in msgs:
        space["normalize_assistant_tool_call_arguments"](m)
    images, processed = [], []
    for m in copy.deepcopy(msgs):
        if m.get("content") is None:
            m["content"] = ""
        p = process_content_for_template_format(m, fmt, images, [], [], [])
        p["content"] = space["normalize_tool_content"](p["role"], p.get("content"))
        processed.append(p)
    processed, prefix = space["_handle_last_assistant_message"](None, processed, req)
    effective = space["_effective_tools"](None, req)
    tools = [t.model_dump() for t in req.tools] if effective and req.tool_choice != "none" and req.tools else None
    kwargs = {} if req.reasoning_effort is None else {"reasoning_effort": req.reasoning_effort}
    kwargs.update(req.chat_template_kwargs or {})
    out[name] = {"format": fmt, "messages": processed, "tools": tools, "kwargs": kwargs, "prefix": prefix,
                 "images": [i.url for i in images]}
print(json.dumps(out))
"""
    run = run_side(code, str(tmp_path / "cases.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    mine = {name: ours(*case) for name, case in CASES.items()}
    assert {k: {"ours": mine[k], "sglang": theirs[k]} for k in CASES if mine[k] != theirs[k]} == {}
    # the table exercises what it claims to
    assert mine["tool_choice_none"]["tools"] is None and mine["message_level_tools"]["tools"] is None
    assert mine["tools_calls_and_kwargs"]["messages"][2]["tool_calls"][0]["function"]["arguments"] == {
        "expression": "6*7"
    }
    assert mine["continue_final_message"]["prefix"] == "It is" and mine["parts_as_openai"]["images"] == ["data:,x"]


def test_tool_choice_is_checked_as_sglang_checks_it_and_a_grammar_it_needs_is_refused():
    user = [{"role": "user", "content": "hi"}]
    named = {"type": "function", "function": {"name": "nope"}}
    for body, message in [
        ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
        ({"tool_choice": named}, "Tools cannot be empty if tool choice is set to a specific tool."),
        ({"tools": [CALC], "tool_choice": named}, "Tool 'nope' not found in tools list."),
        ({"tools": [CALC], "tool_choice": "required"}, "a grammar slime's CPU server does not run"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "Request-supplied chat_template is not allowed"),
        (
            {"tools": [CALC], "tool_choice": "any"},
            "tool_choice must be 'auto', 'required', 'none' or a named function",
        ),
    ]:
        with pytest.raises(RequestError, match=message):
            template_inputs(body, user, "string")
    bad = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "calc", "arguments": "{"}}]}
    with pytest.raises(RequestError, match="must be valid JSON"):
        template_inputs({}, [*user, bad, *user], "string")
    assert template_inputs({"tools": [CALC]}, user, "string").tools_active
    assert not template_inputs({"tools": [CALC], "tool_choice": "none"}, user, "string").tools_active
