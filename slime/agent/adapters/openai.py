"""OpenAI Chat Completions (`POST /v1/chat/completions`) and Responses (`POST /v1/responses`, in
`openai_responses.py`) over the policy's engine, on the same sessions.

The session id is the client's API key (`OpenAI(api_key=session_id, base_url=adapter_url + "/v1")`), or
`metadata.session_id` / `user` in the body.
"""

from __future__ import annotations

import json
import secrets
import time

from aiohttp import web

from slime.agent.adapters.common import (
    AdapterError,
    BaseAdapter,
    check_openai_tool_choice,
    function_tool,
    reject_unknown_fields,
)
from slime.agent.adapters.openai_responses import ResponsesAPI
from slime.agent.trajectory import TurnRecord
from slime.utils.output_parsing import ParsedOutput

KNOWN_FIELDS = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",  # every call the model emits is returned
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "user",
    "metadata",
    "store",  # nothing is stored either way
    "logprobs",
    "response_format",
}


def _text_of(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise AdapterError(400, f"{where}: content part type {kind!r} is not supported (text only)")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise AdapterError(400, f"{where}: content must be a string or a list of text parts")


def _arguments(raw, where: str):
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, json.JSONDecodeError):
        return raw  # templates render a string argument as it is
    return value if isinstance(value, dict) else raw


class OpenAIAdapter(BaseAdapter):
    protocol = "openai"

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._handle)
        self._responses = ResponsesAPI(self)
        app.router.add_post("/v1/responses", self._handle_responses)

    async def _handle_responses(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, api=self._responses)

    def _session_id(self, request: web.Request, body: dict) -> str | None:
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer ") and auth[7:].strip():
            return auth[7:].strip()
        md = body.get("metadata")
        if isinstance(md, dict) and md.get("session_id"):
            return str(md["session_id"])
        return str(body["user"]) if body.get("user") else None

    def _check_body(self, body: dict) -> None:
        reject_unknown_fields(body, KNOWN_FIELDS, "Chat Completions")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise AdapterError(400, "messages must be a non-empty list", param="messages")
        if body.get("n", 1) != 1:
            raise AdapterError(400, f"n={body['n']} is not supported: one choice per request", param="n")
        if body.get("logprobs"):
            raise AdapterError(400, "logprobs is not supported by slime's adapter", param="logprobs")
        rf = body.get("response_format")
        if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
            raise AdapterError(
                400,
                f"response_format {rf!r} is not supported (no constrained decoding)",
                param="response_format",
            )
        check_openai_tool_choice(body)

    def _to_chat(self, body: dict) -> tuple[list[dict], list[dict] | None, bool]:
        messages = []
        for i, m in enumerate(body["messages"]):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise AdapterError(400, f"{where} must be an object", param="messages")
            role = m.get("role")
            if role in ("system", "developer", "user"):
                messages.append(
                    {"role": "user" if role == "user" else "system", "content": _text_of(m.get("content"), where)}
                )
            elif role == "tool":
                messages.append({"role": "tool", "content": _text_of(m.get("content"), where)})
            elif role == "assistant":
                msg = {"role": "assistant", "content": _text_of(m.get("content"), where)}
                if m.get("reasoning_content"):
                    msg["reasoning_content"] = m["reasoning_content"]
                calls = []
                for c in m.get("tool_calls") or []:
                    fn = c.get("function") or {}
                    calls.append(
                        {
                            "type": "function",
                            "function": {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"), where)},
                        }
                    )
                if calls:
                    msg["tool_calls"] = calls
                messages.append(msg)
            else:
                raise AdapterError(400, f"{where}: role {role!r} is not supported", param="messages")
        tools = None
        if body.get("tools"):
            tools = []
            for t in body["tools"]:
                if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
                    raise AdapterError(400, f"only function tools are supported, got {str(t)[:100]}", param="tools")
                fn = t["function"]
                tools.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters")))
        return messages, tools, body.get("tool_choice") != "none"

    def _sampling_params(self, body: dict) -> dict:
        sp = {}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            sp["max_new_tokens"] = max_tokens
        for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
            if body.get(k) is not None:
                sp[k] = body[k]
        if body.get("stop"):
            sp["stop"] = body["stop"] if isinstance(body["stop"], list) else [body["stop"]]
        if body.get("seed") is not None:
            sp["sampling_seed"] = body["seed"]
        return sp

    def _error_response(self, err: AdapterError) -> web.Response:
        return web.json_response(
            {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": None}}, status=err.status
        )

    async def _respond(self, request, body, parsed: ParsedOutput, turn: TurnRecord) -> web.StreamResponse:
        calls = [
            {
                "id": f"call_{secrets.token_hex(12)}",
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for c in parsed.tool_calls
        ]
        finish = "tool_calls" if calls else ("length" if turn.finish_reason == "length" else "stop")
        usage = {
            "prompt_tokens": len(turn.prompt_ids),
            "completion_tokens": len(turn.output_ids),
            "total_tokens": len(turn.prompt_ids) + len(turn.output_ids),
        }
        cid, created, model = (
            f"chatcmpl-{secrets.token_hex(12)}",
            int(time.time()),
            body.get("model") or "slime-policy",
        )
        if not body.get("stream"):
            message = {"role": "assistant", "content": parsed.text or (None if calls else "")}
            if parsed.reasoning:
                message["reasoning_content"] = parsed.reasoning
            if calls:
                message["tool_calls"] = calls
            return web.json_response(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
                    "usage": usage,
                }
            )
        # The whole turn is sampled before it is parsed (a tool call is only known once complete), so the stream
        # carries it in a few deltas, in the shape the API streams.
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)

        async def chunk(delta, finish_reason=None):
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
            }
            await out.write(f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

        await chunk({"role": "assistant", "content": ""})
        if parsed.reasoning:
            await chunk({"reasoning_content": parsed.reasoning})
        if parsed.text:
            await chunk({"content": parsed.text})
        for i, c in enumerate(calls):
            await chunk({"tool_calls": [{"index": i, **c}]})
        await chunk({}, finish)
        if (body.get("stream_options") or {}).get("include_usage"):
            data = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await out.write(f"data: {json.dumps(data)}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out
