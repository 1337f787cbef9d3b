"""Split a model's raw output into reasoning, visible text and tool calls, in the model family's own format.

Where SGLang is installed its parsers do the work (the same ones its OpenAI server uses, so the names are SGLang's
`--tool-call-parser` / `--reasoning-parser` names). Without SGLang, the formats below are parsed here:

- tool calls "qwen25" / "qwen3" / "hermes": ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  (the format Qwen2.5 / Qwen3 chat templates render and the models emit), any number of them;
- reasoning "qwen3" / "deepseek-r1": ``<think>...</think>``. As in SGLang, "qwen3" finds reasoning only when the
  output opens ``<think>``; "deepseek-r1" treats the output as reasoning up to ``</think>`` (its template opens the
  tag in the prompt); output cut off before ``</think>`` is all reasoning.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import re

logger = logging.getLogger(__name__)

JSON_TOOL_CALL_PARSERS = ("qwen25", "qwen3", "hermes")
THINK_REASONING_PARSERS = ("qwen3", "deepseek-r1")
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ParsedOutput:
    reasoning: str
    text: str
    tool_calls: list[dict]  # [{"name": str, "arguments": dict}]
    ill_formed: bool = False  # something looked like a tool call but was not a valid one


def have_sglang() -> bool:
    return importlib.util.find_spec("sglang") is not None


def check_parser_names(tool_parser: str | None, reasoning_parser: str | None) -> None:
    """Fail at construction on a parser this process cannot run."""
    if have_sglang():
        return
    if tool_parser and tool_parser not in JSON_TOOL_CALL_PARSERS:
        raise ValueError(
            f"tool_parser={tool_parser!r} needs SGLang installed; without it slime parses {JSON_TOOL_CALL_PARSERS}"
        )
    if reasoning_parser and reasoning_parser not in THINK_REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser={reasoning_parser!r} needs SGLang installed; without it slime parses "
            f"{THINK_REASONING_PARSERS}"
        )


def split_reasoning(text: str, parser: str | None) -> tuple[str, str]:
    """(reasoning, rest)."""
    if not parser:
        return "", text
    if have_sglang():
        from sglang.srt.parser.reasoning_parser import ReasoningParser  # lazy: optional dependency

        reasoning, rest = ReasoningParser(model_type=parser, stream_reasoning=False).parse_non_stream(text)
        return reasoning or "", rest or ""
    # as SGLang's one-shot detector: Qwen3 reasons only when it opened <think>; DeepSeek-R1 always starts reasoning
    if parser != "deepseek-r1" and "<think>" not in text:
        return "", text
    body = text.replace("<think>", "").strip()
    if "</think>" not in body:  # cut off while thinking
        return body, ""
    reasoning, rest = body.split("</think>", 1)
    return reasoning, rest.strip()


def split_tool_calls(text: str, tools: list[dict] | None, parser: str | None) -> tuple[str, list[dict], bool]:
    """(visible text, [{"name", "arguments"}], ill_formed). Only tools offered in the request are accepted."""
    if not parser or not tools:
        return text, [], False
    names = {t["function"]["name"] for t in tools}
    if have_sglang():
        return _split_tool_calls_sglang(text, tools, parser)
    calls, ill_formed = [], False
    for m in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            ill_formed = True
            continue
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(args, dict):
            ill_formed = True
            continue
        calls.append({"name": obj["name"], "arguments": args})
    if "<tool_call>" in text and not calls:
        ill_formed = True
    # the visible text is what precedes the first call, as SGLang; with no valid call the text stays whole (SGLang
    # 0.5.23 keeps only what precedes the call then too: docs/agent.md)
    return text[: text.index("<tool_call>")].strip() if calls else text, calls, ill_formed


def _split_tool_calls_sglang(text: str, tools: list[dict], parser: str) -> tuple[str, list[dict], bool]:
    # lazy: optional dependency
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    fc = FunctionCallParser(
        tools=[Tool(type="function", function=Function(**t["function"])) for t in tools], tool_call_parser=parser
    )
    if not fc.has_tool_call(text):
        return text, [], False
    try:
        rest, items = fc.parse_non_stream(text)
    except Exception as e:  # a malformed call must not fail the turn; the sample records it
        logger.warning("tool-call parsing failed (%s); the output stays text", e)
        return text, [], True
    calls, ill_formed = [], False
    for it in items:
        try:
            args = json.loads(it.parameters or "{}")
        except json.JSONDecodeError:
            ill_formed = True
            continue
        calls.append({"name": it.name, "arguments": args})
    return (rest or "").strip(), calls, ill_formed or not calls


def parse_output(
    text: str, *, tools: list[dict] | None, tool_parser: str | None, reasoning_parser: str | None
) -> ParsedOutput:
    reasoning, rest = split_reasoning(text, reasoning_parser)
    visible, calls, ill_formed = split_tool_calls(rest, tools, tool_parser)
    return ParsedOutput(reasoning=reasoning, text=visible.strip(), tool_calls=calls, ill_formed=ill_formed)
