"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) over the policy's engine.

The session id is the client's API key (`Anthropic(api_key=session_id, base_url=adapter_url)` sends it as
`x-api-key`), a bearer token, or `metadata.user_id` in the body.
"""

from __future__ import annotations

import json
import secrets

from aiohttp import web

from slime.agent.adapters.common import AdapterError, BaseAdapter, function_tool, reject_unknown_fields
from slime.agent.trajectory import TurnRecord
from slime.utils.output_parsing import ParsedOutput

KNOWN_FIELDS = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "tools",
    "tool_choice",
    "metadata",
    "thinking",  # the policy reasons (or not) as it was trained to; its reasoning comes back as thinking blocks
}


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise AdapterError(400, f"{where}: content must be a string or a list of content blocks", param="messages")
    return content


def _flat_text(content, where: str) -> str:
    if content is None:
        return ""
    parts = []
    for b in _blocks(content, where):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise AdapterError(400, f"{where}: content block type {kind!r} is not supported here (text only)")
        parts.append(b.get("text", ""))
    return "".join(parts)


class AnthropicAdapter(BaseAdapter):
    protocol = "anthropic"

    def _register_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages", self._handle)
        app.router.add_post("/v1/messages/count_tokens", self._count_tokens)

    def _session_id(self, request: web.Request, body: dict) -> str | None:
        if request.headers.get("x-api-key"):
            return request.headers["x-api-key"]
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer ") and auth[7:].strip():
            return auth[7:].strip()
        md = body.get("metadata")
        return str(md["user_id"]) if isinstance(md, dict) and md.get("user_id") else None

    def _check_body(self, body: dict) -> None:
        reject_unknown_fields(body, KNOWN_FIELDS, "Messages")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise AdapterError(400, "messages: must be a non-empty list")
        if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
            raise AdapterError(400, "max_tokens: a positive integer is required")
        tc = body.get("tool_choice")
        kind = tc.get("type") if isinstance(tc, dict) else tc
        if tc is not None and kind not in ("auto", "none"):
            raise AdapterError(
                400,
                f"tool_choice type {kind!r} is not supported: the adapter does not constrain decoding; "
                "use 'auto' or 'none'",
            )

    def _to_chat(self, body: dict) -> tuple[list[dict], list[dict] | None, bool]:
        messages = []
        if body.get("system"):
            messages.append({"role": "system", "content": _flat_text(body["system"], "system")})
        for i, m in enumerate(body["messages"]):
            where = f"messages.{i}"
            role = m.get("role") if isinstance(m, dict) else None
            if role == "user":
                text = []
                for b in _blocks(m.get("content"), where):
                    kind = b.get("type") if isinstance(b, dict) else None
                    if kind == "text":
                        text.append(b.get("text", ""))
                    elif kind == "tool_result":
                        if text:
                            messages.append({"role": "user", "content": "".join(text)})
                            text = []
                        result = b.get("content")
                        messages.append({"role": "tool", "content": _flat_text(result, where) if result else ""})
                    else:
                        raise AdapterError(400, f"{where}: content block type {kind!r} is not supported")
                if text:
                    messages.append({"role": "user", "content": "".join(text)})
            elif role == "assistant":
                msg, calls = {"role": "assistant", "content": ""}, []
                for b in _blocks(m.get("content"), where):
                    kind = b.get("type") if isinstance(b, dict) else None
                    if kind == "text":
                        msg["content"] += b.get("text", "")
                    elif kind == "thinking":
                        msg["reasoning_content"] = b.get("thinking", "")
                    elif kind == "tool_use":
                        calls.append(
                            {
                                "type": "function",
                                "function": {"name": b.get("name"), "arguments": b.get("input") or {}},
                            }
                        )
                    elif kind != "redacted_thinking":
                        raise AdapterError(400, f"{where}: content block type {kind!r} is not supported")
                if calls:
                    msg["tool_calls"] = calls
                messages.append(msg)
            else:
                raise AdapterError(400, f"{where}: role {role!r} is not supported (user or assistant)")
        tools = None
        if body.get("tools"):
            tools = []
            for t in body["tools"]:
                if not isinstance(t, dict) or "input_schema" not in t or t.get("type") not in (None, "custom"):
                    raise AdapterError(
                        400, f"tools: only client tools with an input_schema are supported, got {str(t)[:100]}"
                    )
                tools.append(function_tool(t.get("name"), t.get("description"), t["input_schema"]))
        return messages, tools, (body.get("tool_choice") or {"type": "auto"})["type"] != "none"

    def _sampling_params(self, body: dict) -> dict:
        sp = {"max_new_tokens": body["max_tokens"]}
        for k in ("temperature", "top_p", "top_k"):
            if body.get(k) is not None:
                sp[k] = body[k]
        if body.get("stop_sequences"):
            sp["stop"] = list(body["stop_sequences"])
        return sp

    def _error_response(self, err: AdapterError) -> web.Response:
        return web.json_response(
            {"type": "error", "error": {"type": err.kind, "message": err.message}}, status=err.status
        )

    async def _count_tokens(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            body = {**body, "max_tokens": 1}
            reject_unknown_fields(body, KNOWN_FIELDS, "Messages")
            messages, tools, _ = self._to_chat(body)
        except AdapterError as err:
            return self._error_response(err)
        except ValueError as e:
            return self._error_response(AdapterError(400, f"the request body is not valid JSON: {e}"))
        return web.json_response({"input_tokens": len(self.render(messages, tools))})

    async def _respond(self, request, body, parsed: ParsedOutput, turn: TurnRecord) -> web.StreamResponse:
        content = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.text:
            content.append({"type": "text", "text": parsed.text})
        for c in parsed.tool_calls:
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{secrets.token_hex(12)}",
                    "name": c["name"],
                    "input": c["arguments"],
                }
            )
        stop = "tool_use" if parsed.tool_calls else ("max_tokens" if turn.finish_reason == "length" else "end_turn")
        usage = {"input_tokens": len(turn.prompt_ids), "output_tokens": len(turn.output_ids)}
        message = {
            "id": f"msg_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": body.get("model") or "slime-policy",
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": usage,
        }
        if not body.get("stream"):
            return web.json_response(message)
        # Sampled in full before parsing (a tool call is only known once complete); streamed as the API's events.
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)

        async def event(name, data):
            await out.write(
                f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False)}\n\n".encode()
            )

        start = {**message, "content": [], "stop_reason": None, "usage": {**usage, "output_tokens": 0}}
        await event("message_start", {"message": start})
        for i, block in enumerate(content):
            if block["type"] == "thinking":
                await event(
                    "content_block_start",
                    {"index": i, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
                )
                await event(
                    "content_block_delta",
                    {"index": i, "delta": {"type": "thinking_delta", "thinking": block["thinking"]}},
                )
            elif block["type"] == "text":
                await event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}})
                await event(
                    "content_block_delta", {"index": i, "delta": {"type": "text_delta", "text": block["text"]}}
                )
            else:
                await event("content_block_start", {"index": i, "content_block": {**block, "input": {}}})
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
                await event("content_block_delta", {"index": i, "delta": delta})
            await event("content_block_stop", {"index": i})
        await event(
            "message_delta",
            {
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
        )
        await event("message_stop", {})
        await out.write_eof()
        return out
