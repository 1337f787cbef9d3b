"""A chat request's prompt, built as SGLang 0.5.23's OpenAI server builds it for a Jinja chat template (its tool-call
and reasoning parsers change no prompt: serving_chat.py, jinja_template_utils.py): the same messages, tools and
template arguments reach the template, so the CPU server samples from the prompt SGLang would have.

- messages: as SGLang's message models dump them (a user message keeps only its role and content; an assistant's
  tool calls gain `id`, `index` and `type`), then without their null fields; tool-call `arguments` given as JSON text
  become the object; a null `content` is ""; content parts as the template reads them -- a template that loops over
  `message.content` gets `{"type": "text"}` / `{"type": "image"}` parts (the images' urls collected in order), any
  other gets the text parts joined with spaces; a tool message's text parts are joined with spaces either way; a
  trailing assistant message becomes a user message, or with `continue_final_message` is left out and its text
  appended to the prompt's ids;
- tools: as SGLang's `Tool` / `Function` models dump them (the client's keys in its order, `description` and
  `parameters` null where left out, `defer_loading` on the tool); none with `tool_choice: "none"`. `tool_choice`
  defaults to "auto" when the request or a system message declares tools; "required" or a named tool make SGLang
  constrain the output to the tools' JSON schema, a grammar this server does not run: refused, after SGLang's own
  checks of them. With tools in play SGLang keeps special tokens in the output's text;
- template arguments: `reasoning_effort` (or a `reasoning` object's effort), then `chat_template_kwargs`, where an
  effort other than "none" (or `reasoning.enabled`) sets `thinking` and `enable_thinking` unless given (a
  `chat_template` among them refused, as by SGLang without --trust-request-chat-template).
"""

import copy
import dataclasses
import functools
import json

import jinja2

from .sampling import RequestError

_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_GENERIC_FIELDS = (
    "role",
    "content",
    "tool_call_id",
    "name",
    "phase",
    "reasoning_content",
    "tool_calls",
    "tools",
    "prefix",
)


@dataclasses.dataclass
class TemplateInputs:
    messages: list
    tools: list | None
    kwargs: dict  # the template's other arguments
    prefix: str | None  # continue_final_message: text appended to the rendered prompt's ids
    images: list  # image urls, in the order of their parts
    videos: list  # video urls, in the order of their parts
    tools_active: bool  # tools declared and tool_choice not "none": special tokens stay in the output's text
    declared_tools: list  # the request's and the system messages' tools
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the rendered text encoded with the tokenizer's own special tokens


@functools.lru_cache(maxsize=8)
def content_format(template: str) -> str:
    """SGLang's detection (after vLLM's): "openai" for a template that loops over a message's content (or names a
    modality), else "string"."""
    if any(word in template for word in ("image", "audio", "video", "vision")):
        return "openai"
    from transformers.utils import chat_template_utils  # lazy: heavy, and the tokenizer has loaded it by now

    try:
        ast = chat_template_utils._compile_jinja_template(template).environment.parse(template)
    except Exception:  # noqa: BLE001  (SGLang falls back the same way)
        return "string"

    def reads_content(node, var):
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) or (
            isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)
        ):
            node = node.node
            if node is None:
                return False
        if isinstance(node, jinja2.nodes.Getitem):
            key = node.arg.value if isinstance(node.arg, jinja2.nodes.Const) else None
        elif isinstance(node, jinja2.nodes.Getattr):
            key = node.attr
        else:
            return False
        name = node.node
        return key == "content" and isinstance(name, jinja2.nodes.Name) and name.ctx == "load" and name.name == var

    loops = ast.find_all(jinja2.nodes.For)
    return (
        "openai" if any(reads_content(loop.iter, v) for loop in loops for v in ("message", "msg", "m")) else "string"
    )


def _tool(tool: dict) -> dict:
    """SGLang's `Tool.model_dump()` of one tool."""
    f, defer = tool.get("function") or {}, tool.get("defer_loading")
    fields = {"description": f.get("description"), "name": f.get("name"), "parameters": f.get("parameters")}
    for key, value in (("strict", f.get("strict")), ("defer_loading", f.get("defer_loading", defer))):
        if value is not None:
            fields[key] = value
    order = [k for k in f if k in fields]
    function = {k: fields[k] for k in order + [k for k in fields if k not in order]}
    return {"type": tool.get("type", "function"), "function": function, "defer_loading": defer}


def _tool_call(call) -> dict:
    """SGLang's `ToolCall.model_dump()`, its JSON-text arguments parsed as SGLang parses them for the template."""
    f = (call.get("function") if isinstance(call, dict) else None) or {}
    arguments = f.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise RequestError("Assistant tool call function.arguments must be valid JSON.") from None
        if not isinstance(arguments, dict):
            raise RequestError("Assistant tool call function.arguments must be a JSON object.")
    return {
        "id": call.get("id"),
        "index": call.get("index"),
        "type": call.get("type", "function"),
        "function": {"name": f.get("name"), "arguments": arguments},
    }


def _content(content: list, fmt: str, media: tuple, where: str):
    if fmt == "string":
        text = [p["text"] for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text")]
        return " ".join(text)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image_url", "input_image"):
            ref = part.get("image_url") or {}
            url = ref if isinstance(ref, str) else ref.get("url")
            if not isinstance(url, str):
                raise RequestError(f"{where}.content[{j}]: an image part needs image_url.url")
            media[0].append(url)
            parts.append({"type": "image"})
        elif kind == "video_url":  # SGLang: the url joins video_data, the template sees {"type": "video"}
            ref = part.get("video_url")
            url = ref.get("url") if isinstance(ref, dict) else None
            if not isinstance(url, str):
                raise RequestError(f"{where}.content[{j}]: a video part needs video_url.url")
            own = next((k for k, v in ref.items() if k != "url" and v is not None), None)
            if own is not None:  # SGLang hands these to GLM's video processing only
                raise RequestError(f"{where}.content[{j}]: video_url.{own} is not supported by slime's CPU server")
            media[1].append(url)
            parts.append({"type": "video"})
        elif kind == "audio_url":
            raise RequestError(f"{where}.content[{j}]: audio_url is not supported by slime's CPU server")
        elif kind in ("text", "input_text"):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "tool_reference":
            parts.append(part)
    return parts


def _message(m: dict, fmt: str, media: tuple, where: str) -> dict:
    d = (
        {"role": "user", "content": m.get("content")}
        if m["role"] == "user"
        else {k: m.get(k) for k in _GENERIC_FIELDS}
    )
    if isinstance(d.get("tool_calls"), list):
        d["tool_calls"] = [_tool_call(c) for c in d["tool_calls"]]
    if isinstance(d.get("tools"), list):
        d["tools"] = [_tool(t) for t in d["tools"]]
    d = copy.deepcopy(d)
    if d["content"] is None:
        d["content"] = ""
    if isinstance(d["content"], list):
        d["content"] = _content(d["content"], fmt, media, where)
    if d["role"] == "tool" and isinstance(d["content"], list):
        parts = d["content"]
        if all(isinstance(p, str) or (isinstance(p, dict) and p.get("type") == "text") for p in parts):
            d["content"] = " ".join(p if isinstance(p, str) else p.get("text", "") for p in parts)
    return {k: v for k, v in d.items() if v is not None}


def _tools(b: dict, msgs: list) -> tuple[list | None, bool, list]:
    """(the tools the template gets, or None; whether tools are in play; every tool declared), after SGLang's
    checks of `tool_choice`."""
    declared = [t for m in msgs if m["role"] in ("root", "system", "developer") for t in (m.get("tools") or [])]
    tools = (b.get("tools") or []) + declared
    choice = b.get("tool_choice")
    if choice is None:
        choice = "none" if b.get("tools") is None and not declared else "auto"
    if not (choice in ("auto", "required", "none") or isinstance(choice, dict)):  # SGLang's request model
        raise RequestError(f"tool_choice must be 'auto', 'required', 'none' or a named function, got {choice!r}")
    if choice == "required" and not tools:
        raise RequestError("Tools cannot be empty if tool choice is set to required.")
    if not isinstance(choice, str):
        if not tools:
            raise RequestError("Tools cannot be empty if tool choice is set to a specific tool.")
        name = ((choice or {}).get("function") or {}).get("name")
        if not any((t.get("function") or {}).get("name") == name for t in tools):
            raise RequestError(f"Tool '{name}' not found in tools list.")
    if choice == "required" or not isinstance(choice, str):
        raise RequestError(
            "tool_choice 'required' or a named tool: SGLang constrains the output to the tools' JSON schema, a grammar "
            "slime's CPU server does not run"
        )
    active = bool(tools) and choice != "none"
    return ([_tool(t) for t in b["tools"]] if active and b.get("tools") else None), active, tools


def _reasoning(b: dict):
    """(reasoning effort, thinking on or off or None) as SGLang's ChatCompletionRequest reads `reasoning_effort` and
    a `reasoning` object ({effort | reasoning_effort, enabled | enable})."""
    effort, thinking, r = b.get("reasoning_effort"), None, b.get("reasoning")
    if isinstance(r, dict):
        value = r.get("effort") if r.get("effort") is not None else r.get("reasoning_effort")
        if isinstance(value, str) and value in _EFFORTS:
            effort = value
        elif value is not None:
            try:  # a number, or a string holding one
                if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                    raise ValueError
                effort = float(value)
            except ValueError:
                raise RequestError(f"invalid reasoning effort: {value!r}") from None
        enabled = r.get("enabled") if r.get("enabled") is not None else r.get("enable", False)
        if isinstance(enabled, str):
            enabled = enabled.strip().lower() in ("1", "true", "yes", "y", "on")
        if enabled:
            thinking = True
    if isinstance(effort, bool):
        raise RequestError("reasoning_effort must not be a boolean")
    if effort is not None:
        thinking = effort != "none"
    return effort, thinking


def template_inputs(b: dict, msgs: list, fmt: str, add_generation_prompt=None, add_special_tokens=False):
    """What the chat template gets for the request body `b` (its messages `msgs`, roles checked) under a template of
    content format `fmt` (a TemplateInputs). `add_generation_prompt` (SGLang's /tokenize): None renders as for a
    chat completion; True or False renders the messages as given, with or without the assistant's opening."""
    tools, active, declared = _tools(b, msgs)
    effort, thinking = _reasoning(b)
    template_kwargs = dict(b.get("chat_template_kwargs") or {})
    if "chat_template" in template_kwargs:
        raise RequestError(
            "Request-supplied chat_template is not allowed. Start the server with --trust-request-chat-template to "
            "permit it."
        )
    if thinking is not None:  # models read one key or the other
        template_kwargs.setdefault("thinking", thinking)
        template_kwargs.setdefault("enable_thinking", thinking)
    kwargs = {} if effort is None else {"reasoning_effort": effort}
    kwargs.update(template_kwargs)
    images, videos = [], []
    messages = [_message(m, fmt, (images, videos), f"messages[{i}]") for i, m in enumerate(msgs)]
    prefix = None
    if add_generation_prompt is False and b.get("continue_final_message"):
        raise RequestError("continue_final_message needs add_generation_prompt to open the assistant turn.")
    last_assistant = messages[-1]["role"] == "assistant" and isinstance(messages[-1]["content"], str)
    if last_assistant and (add_generation_prompt is None or b.get("continue_final_message")):
        if b.get("continue_final_message"):
            prefix, messages = messages[-1]["content"], messages[:-1]
        else:
            messages[-1] = {"role": "user", "content": messages[-1]["content"]}
    opening = True if add_generation_prompt is None else add_generation_prompt
    return TemplateInputs(
        messages, tools, kwargs, prefix, images, videos, active, declared, opening, add_special_tokens
    )


def render(tokenizer, inputs: TemplateInputs) -> list:
    """The prompt's token ids (before images are expanded)."""
    try:
        text = tokenizer.apply_chat_template(
            inputs.messages,
            add_generation_prompt=inputs.add_generation_prompt,
            tokenize=False,
            tools=inputs.tools,
            **inputs.kwargs,
        )
    except Exception as e:  # noqa: BLE001  (a template error is the client's message list)
        raise RequestError(f"the chat template could not render these messages: {e}") from None
    ids = tokenizer.encode(text, add_special_tokens=inputs.add_special_tokens)
    if inputs.prefix:
        encoded = tokenizer.encode(inputs.prefix)
        if encoded and encoded[0] == tokenizer.bos_token_id:
            encoded = encoded[1:]
        ids += encoded
    return ids
