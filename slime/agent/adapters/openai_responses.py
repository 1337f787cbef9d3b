"""OpenAI Responses (`POST /v1/responses`, JSON or an event stream) on `OpenAIAdapter`'s sessions.

The adapter keeps no response state: the client sends the whole conversation as `input` each turn (as with
`store=False`), its earlier output items included, and `previous_response_id` is refused. Input items map to
chat-template messages: `message` items by role, a `reasoning` item onto the next assistant turn's
`reasoning_content`, `function_call` items onto the current assistant turn's tool calls, and
`function_call_output` items to `tool` messages. `instructions` is the system message. The output is the turn's
`reasoning` item (when the model reasoned), a `message` item (when it wrote text) and one `function_call` item per
tool call, the order a client sends them back in.
"""

from __future__ import annotations

import json
import secrets
import time

from aiohttp import web

from slime.agent.adapters.common import AdapterError, check_openai_tool_choice, function_tool, reject_unknown_fields
from slime.agent.trajectory import TurnRecord
from slime.utils.output_parsing import ParsedOutput

KNOWN_FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",  # every call the model emits is returned
    "stream",
    "max_output_tokens",
    "temperature",
    "top_p",
    "user",
    "metadata",
    "store",  # nothing is stored either way
    "text",
    "reasoning",
    "include",
    "previous_response_id",
    "truncation",
}


def _parts_text(content, where: str, kinds=("input_text", "output_text", "text")) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in kinds:
                raise AdapterError(
                    400, f"{where}: content part type {kind!r} is not supported (text only)", param="input"
                )
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise AdapterError(400, f"{where}: content must be a string or a list of text parts", param="input")


def _arguments(raw):
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, json.JSONDecodeError):
        return raw  # templates render a string argument as it is
    return value if isinstance(value, dict) else raw


class ResponsesAPI:
    """The protocol hooks of `BaseAdapter._handle` for the Responses API; sessions are the adapter's."""

    def __init__(self, adapter):
        self.adapter = adapter

    def _session_id(self, request: web.Request, body: dict) -> str | None:
        return self.adapter._session_id(request, body)

    def _error_response(self, err: AdapterError) -> web.Response:
        return self.adapter._error_response(err)  # the same error shape as Chat Completions

    def _check_body(self, body: dict) -> None:
        reject_unknown_fields(body, KNOWN_FIELDS, "Responses")
        if not isinstance(body.get("input"), (str, list)) or not body["input"]:
            raise AdapterError(400, "input must be a non-empty string or list of items", param="input")
        if body.get("previous_response_id"):
            raise AdapterError(
                400,
                "previous_response_id is not supported: slime's adapter keeps no response state; send the whole "
                "conversation as input",
                param="previous_response_id",
            )
        check_openai_tool_choice(body)
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else body.get("text")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise AdapterError(400, f"text.format {fmt!r} is not supported (no constrained decoding)", param="text")
        reasoning = body.get("reasoning")
        if reasoning is not None and (
            not isinstance(reasoning, dict) or any(v is not None for v in reasoning.values())
        ):
            raise AdapterError(
                400,
                f"reasoning {reasoning!r} is not supported: whether the model reasons is the chat template's "
                "(the adapter's chat_template_kwargs)",
                param="reasoning",
            )
        if body.get("include"):
            raise AdapterError(400, f"include {body['include']!r} is not supported", param="include")
        if body.get("truncation") not in (None, "disabled"):
            raise AdapterError(400, f"truncation={body['truncation']!r} is not supported", param="truncation")

    def _to_chat(self, body: dict) -> tuple[list[dict], list[dict] | None, bool]:
        messages: list[dict] = []
        if body.get("instructions"):
            messages.append({"role": "system", "content": _parts_text(body["instructions"], "instructions")})
        items = [{"role": "user", "content": body["input"]}] if isinstance(body["input"], str) else body["input"]
        reasoning = None  # a reasoning item belongs to the assistant turn that follows it

        def assistant_turn(text=""):
            nonlocal reasoning
            msg = {"role": "assistant", "content": text}
            if reasoning:
                msg["reasoning_content"], reasoning = reasoning, None
            messages.append(msg)
            return msg

        for i, item in enumerate(items):
            where = f"input[{i}]"
            if not isinstance(item, dict):
                raise AdapterError(400, f"{where} must be an object", param="input")
            kind = item.get("type") or ("message" if "role" in item else None)
            if kind == "message":
                role, text = item.get("role"), _parts_text(item.get("content"), where)
                if role in ("system", "developer"):
                    messages.append({"role": "system", "content": text})
                elif role == "user":
                    messages.append({"role": "user", "content": text})
                elif role == "assistant":
                    assistant_turn(text)
                else:
                    raise AdapterError(400, f"{where}: role {role!r} is not supported", param="input")
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                reasoning = _parts_text(parts, where, kinds=("reasoning_text", "summary_text"))
            elif kind == "function_call":
                last = messages[-1] if messages else None
                # the turn's text and its calls are one assistant message; a reasoning item starts a new turn
                if last is None or last["role"] != "assistant" or reasoning is not None:
                    last = assistant_turn()
                call = {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}
                last.setdefault("tool_calls", []).append({"type": "function", "function": call})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "content": _parts_text(item.get("output"), where)})
            else:
                raise AdapterError(400, f"{where}: item type {kind!r} is not supported", param="input")
        tools = None
        if body.get("tools"):
            tools = []
            for t in body["tools"]:
                if not isinstance(t, dict) or t.get("type") != "function":
                    raise AdapterError(400, f"only function tools are supported, got {str(t)[:100]}", param="tools")
                tools.append(function_tool(t.get("name"), t.get("description"), t.get("parameters")))
        return messages, tools, body.get("tool_choice") != "none"

    def _sampling_params(self, body: dict) -> dict:
        sp = {}
        if body.get("max_output_tokens") is not None:
            sp["max_new_tokens"] = body["max_output_tokens"]
        for k in ("temperature", "top_p"):
            if body.get(k) is not None:
                sp[k] = body[k]
        return sp

    async def _respond(self, request, body, parsed: ParsedOutput, turn: TurnRecord) -> web.StreamResponse:
        output = []
        if parsed.reasoning:
            output.append(
                {
                    "type": "reasoning",
                    "id": f"rs_{secrets.token_hex(12)}",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": parsed.reasoning}],
                    "status": "completed",
                }
            )
        if parsed.text:
            output.append(
                {
                    "type": "message",
                    "id": f"msg_{secrets.token_hex(12)}",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": parsed.text, "annotations": []}],
                }
            )
        for c in parsed.tool_calls:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{secrets.token_hex(12)}",
                    "call_id": f"call_{secrets.token_hex(12)}",
                    "name": c["name"],
                    "arguments": json.dumps(c["arguments"], ensure_ascii=False),
                    "status": "completed",
                }
            )
        truncated = turn.finish_reason == "length" and not parsed.tool_calls
        tools = [
            {
                "type": "function",
                "name": t.get("name"),
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": bool(t.get("strict")),
            }
            for t in body.get("tools") or []
        ]
        response = {
            "id": f"resp_{secrets.token_hex(12)}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "incomplete" if truncated else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
            "error": None,
            "model": body.get("model") or "slime-policy",
            "instructions": body.get("instructions"),
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": tools,
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {},
            "store": False,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": {
                "input_tokens": len(turn.prompt_ids),
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": len(turn.output_ids),
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(turn.prompt_ids) + len(turn.output_ids),
            },
        }
        if not body.get("stream"):
            return web.json_response(response)
        return await _stream(request, response)


async def _stream(request: web.Request, response: dict) -> web.StreamResponse:
    """The finished response as the API's event stream. The whole turn is sampled before it is parsed (a tool call
    is only known once complete), so each output item arrives in one delta."""
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await out.prepare(request)
    seq = 0

    async def event(kind, **data):
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        await out.write(f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode())

    await event("response.created", response={**response, "status": "in_progress", "output": [], "usage": None})
    await event("response.in_progress", response={**response, "status": "in_progress", "output": [], "usage": None})
    for index, item in enumerate(response["output"]):
        ids = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            await event(
                "response.output_item.added", output_index=index, item={**item, "content": [], "status": "in_progress"}
            )
            part = item["content"][0]
            await event("response.content_part.added", **ids, content_index=0, part={**part, "text": ""})
            await event("response.output_text.delta", **ids, content_index=0, delta=part["text"], logprobs=[])
            await event("response.output_text.done", **ids, content_index=0, text=part["text"], logprobs=[])
            await event("response.content_part.done", **ids, content_index=0, part=part)
        elif item["type"] == "reasoning":
            await event(
                "response.output_item.added", output_index=index, item={**item, "content": [], "status": "in_progress"}
            )
            text = item["content"][0]["text"]
            await event("response.reasoning_text.delta", **ids, content_index=0, delta=text)
            await event("response.reasoning_text.done", **ids, content_index=0, text=text)
        else:  # function_call
            await event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            await event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            await event("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        await event("response.output_item.done", output_index=index, item=item)
    done = "response.completed" if response["status"] == "completed" else "response.incomplete"
    await event(done, response=response)
    await out.write_eof()
    return out
