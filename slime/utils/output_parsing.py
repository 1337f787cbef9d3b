"""Split a model's raw output into reasoning, visible text and tool calls, in the model family's own format.

Where SGLang is installed its parsers do the work (the same ones its OpenAI server uses, so the names are SGLang's
`--tool-call-parser` / `--reasoning-parser` names). Without SGLang, the formats below are parsed here by the rules of
SGLang 0.5.23's one-shot parsers (tests/test_sglang_contract.py runs both on one table and compares):

- tool calls "qwen25" / "qwen" (``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number) and
  "hermes" (the same without the newlines; a call left unclosed counts, and one that is not JSON leaves the whole
  output as text): the visible text is what precedes the first call, stripped; calls naming a tool the request did
  not offer are dropped;
- tool calls "qwen3_coder" (Qwen3-Coder's and Qwen3.5's XML: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
  \\n</parameter>...</function>\\n</tool_call>``): each value converted by the type its tool's JSON schema gives the
  parameter (integers, numbers, booleans, JSON objects and arrays, Python literals, else the text), a function or
  parameter cut off still counted; the visible text is what precedes the first call, unstripped; calls naming an
  undeclared tool are kept, as SGLang keeps them;
- reasoning "qwen3" (only when the output contains ``<think>``; an opened ``<tool_call>`` ends unclosed reasoning),
  "qwen3-thinking" and "deepseek-r1" (reasoning up to ``</think>``: their templates open the tag in the prompt), by
  slime.utils.reasoning_parser. Output cut off before ``</think>`` is reasoning.

On both paths a call's arguments must be a JSON object (or a string holding one); a call that is dropped or does not
parse marks the output `ill_formed`.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import logging
import re
import warnings

from slime.utils.reasoning_parser import PARSERS as REASONING_PARSERS
from slime.utils.reasoning_parser import detector

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ToolCallFormat:
    """A format whose calls are JSON objects ``{"name", "arguments"}`` between tags."""

    start: str  # SGLang's bot_token: a call begins here, and the visible text ends here
    call: re.Pattern  # one call's JSON in group 1 (or 2)
    any_error_keeps_text: bool  # a call that is not JSON leaves the whole output as text, no calls

    def parse(self, text: str, tools: list[dict]) -> tuple[int, str, list[tuple[str, str]]]:
        """(calls begun: 0 when none, visible text, [(name, arguments JSON)]), as `_tool_calls_sglang`."""
        if self.start not in text:
            return 0, text, []
        names = {t["function"]["name"] for t in tools}
        calls = []
        for m in self.call.finditer(text):
            raw = "".join(g or "" for g in m.groups())  # hermes: a closed call, or one cut off
            if not raw:
                continue
            try:
                obj = json.loads(raw.strip())
            except json.JSONDecodeError:
                if self.any_error_keeps_text:
                    return text.count(self.start), text, []
                continue
            for act in obj if isinstance(obj, list) else [obj]:
                name = act.get("name")  # not an object: raises, as in SGLang
                if name and name in names:
                    args = act.get("parameters") or act.get("arguments", {})
                    calls.append((name, json.dumps(args, ensure_ascii=False)))
        return text.count(self.start), text[: text.index(self.start)].strip(), calls


class Qwen3CoderFormat:
    """Qwen3-Coder's XML calls, by the rules of SGLang 0.5.23's `Qwen3CoderDetector.detect_and_parse`."""

    start = "<tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _function = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
    _parameter = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)

    def parse(self, text: str, tools: list[dict]) -> tuple[int, str, list[tuple[str, str]]]:
        if self.start not in text:
            return 0, text, []
        try:
            calls = []
            # no closed block: the whole output is one, if a function begins in it
            for block in self._block.findall(text) or ([text] if "<function=" in text else []):
                for closed, cut_off in self._function.findall(block):
                    body = closed or cut_off
                    if ">" not in body:
                        continue
                    name, params = body.split(">", 1)
                    schema = _parameter_schemas(name, tools)
                    args = {}
                    for found in self._parameter.findall(params):
                        if ">" not in found:
                            continue
                        key, value = found.split(">", 1)
                        value = value[1:] if value.startswith("\n") else value
                        value = value[:-1] if value.endswith("\n") else value
                        args[key] = _typed(value, schema.get(key, _UNDECLARED))
                    calls.append((name, json.dumps(args, ensure_ascii=False)))
        except Exception:  # noqa: BLE001  (SGLang's: any failure leaves the output as text, no calls)
            return 1, text, []
        return 1, text[: text.index(self.start)], calls  # one begun: SGLang's count for a format without a bot_token


_UNDECLARED = object()  # a parameter the tool's schema does not name: its value stays text


def _parameter_schemas(name: str, tools: list[dict]):
    """SGLang's `_get_arguments_config`: the first tool of that name's parameter schemas (`properties`, also from
    anyOf/oneOf/allOf branches; a schema without any is itself the table), {} when the tool is unknown."""
    for t in tools:
        if t["function"].get("name") == name:
            params = t["function"].get("parameters")
            if not isinstance(params, dict):
                return {}
            props = _properties(params)
            return props if props or "properties" in params else params
    return {}


def _properties(schema) -> dict:
    if not isinstance(schema, dict):
        return {}
    if isinstance(schema.get("properties"), dict):
        return schema["properties"]
    merged = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(keyword) if isinstance(schema.get(keyword), list) else []:
            for key, value in _properties(branch).items():
                merged.setdefault(key, value)
    return merged


def _schema_type(schema):
    """SGLang's `infer_type_from_json_schema`: a parameter's primary JSON type, or None."""
    if not isinstance(schema, dict):
        return None
    if "type" in schema:
        kind = schema["type"]
        if isinstance(kind, str):
            return kind
        if isinstance(kind, list) and kind:
            return next((k for k in kind if k != "null"), "string")
    if "anyOf" in schema or "oneOf" in schema:
        branches = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(branches, list):
            kinds = [k for k in map(_schema_type, branches) if k]
            if kinds:
                if len(set(kinds)) == 1:
                    return kinds[0]
                if len(set(kinds)) == 2 and "null" in kinds:
                    return next(k for k in kinds if k != "null")
                return "string" if "string" in kinds else kinds[0]
    if isinstance(schema.get("enum"), list):
        names = {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string"}
        names.update({list: "array", dict: "object"})
        kinds = {names[type(v)] for v in schema["enum"] if type(v) in names}
        return kinds.pop() if len(kinds) == 1 else "string"
    if isinstance(schema.get("allOf"), list):
        return next((k for k in map(_schema_type, schema["allOf"]) if k and k != "string"), "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


def _typed(value: str, schema):
    """SGLang's `_convert_param_value`: a parameter's text as the type its schema gives it (failing that, text)."""
    if value.lower() == "null":
        return None
    if schema is _UNDECLARED:
        return value
    kind = _schema_type(schema)
    kind = "string" if kind is None else str(kind).strip().lower()
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return value
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(value)
        except Exception:  # noqa: BLE001
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except Exception:  # noqa: BLE001
            return value
        integral = "." not in value and "e" not in value.lower()
        return int(number) if integral and number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except Exception:  # noqa: BLE001  (then as a Python literal, as in SGLang)
            pass
    try:
        with warnings.catch_warnings():  # invalid escapes parse with the backslash kept, as in SGLang
            warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
            return ast.literal_eval(value)
    except Exception:  # noqa: BLE001  (any literal_eval failure: the text, as in SGLang)
        return value


_QWEN25 = ToolCallFormat("<tool_call>\n", re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL), False)
TOOL_CALL_FORMATS = {
    "qwen25": _QWEN25,
    "qwen": _QWEN25,
    "hermes": ToolCallFormat(
        "<tool_call>", re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL), True
    ),
    "qwen3_coder": Qwen3CoderFormat(),
}


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
        from sglang.srt.function_call.function_call_parser import FunctionCallParser  # lazy: optional dependency
        from sglang.srt.parser.reasoning_parser import ReasoningParser

        tool_names, reasoning_names, where = (
            FunctionCallParser.ToolCallParserEnum,
            ReasoningParser.DetectorMap,
            "SGLang",
        )
    else:
        tool_names, reasoning_names, where = TOOL_CALL_FORMATS, REASONING_PARSERS, "slime without SGLang"
    if tool_parser and tool_parser not in tool_names:
        raise ValueError(f"tool_parser={tool_parser!r} is not a tool-call parser {where} has: {sorted(tool_names)}")
    if reasoning_parser and reasoning_parser not in reasoning_names:
        raise ValueError(
            f"reasoning_parser={reasoning_parser!r} is not a reasoning parser {where} has: {sorted(reasoning_names)}"
        )


def split_reasoning(text: str, parser: str | None) -> tuple[str, str]:
    """(reasoning, rest), neither stripped (as SGLang)."""
    if not parser:
        return "", text
    if have_sglang():
        from sglang.srt.parser.reasoning_parser import ReasoningParser  # lazy: optional dependency

        reasoning, rest = ReasoningParser(model_type=parser, stream_reasoning=False).parse_non_stream(text)
        return reasoning or "", rest or ""
    return detector(parser, force=False, stream_reasoning=False).parse(text)  # the parser's own default


def split_tool_calls(text: str, tools: list[dict] | None, parser: str | None) -> tuple[str, list[dict], bool]:
    """(visible text, [{"name", "arguments"}], ill_formed), by the format's rules (module docstring)."""
    if not parser or not tools:
        return text, [], False
    try:
        if have_sglang():
            found, rest, raw_calls = _tool_calls_sglang(text, tools, parser)
        else:
            found, rest, raw_calls = TOOL_CALL_FORMATS[parser].parse(text, tools)
    except Exception as e:  # a malformed call must not fail the turn; the sample records it
        logger.warning("tool-call parsing failed (%s); the output stays text", e)
        return text, [], True
    if not found:
        return text, [], False
    objects = [(name, _object(arguments)) for name, arguments in raw_calls]
    calls = [{"name": name, "arguments": args} for name, args in objects if args is not None]
    return rest, calls, not calls or len(calls) < found


def _object(arguments: str) -> dict | None:
    """A call's arguments as SGLang hands them on (JSON text), if they are an object or a string holding one."""
    try:
        value = json.loads(arguments)
        if isinstance(value, str):  # models sometimes encode the arguments twice
            value = json.loads(value)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _tool_calls_sglang(text: str, tools: list[dict], parser: str) -> tuple[int, str, list[tuple[str, str]]]:
    """(calls begun: 0 when none, visible text, [(name, arguments JSON)])."""
    from sglang.srt.entrypoints.openai.protocol import Function, Tool  # lazy: optional dependency
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    fc = FunctionCallParser(
        tools=[Tool(type="function", function=Function(**t["function"])) for t in tools], tool_call_parser=parser
    )
    if not fc.has_tool_call(text):
        return 0, text, []
    rest, items = fc.parse_non_stream(text)
    start = getattr(fc.detector, "bot_token", None)  # formats that wrap several calls in one start count as one
    begun = max(1, text.count(start)) if start else 1
    return begun, rest or "", [(it.name, it.parameters or "{}") for it in items]


def parse_output(
    text: str, *, tools: list[dict] | None, tool_parser: str | None, reasoning_parser: str | None
) -> ParsedOutput:
    reasoning, rest = split_reasoning(text, reasoning_parser)
    visible, calls, ill_formed = split_tool_calls(rest, tools, tool_parser)
    return ParsedOutput(reasoning=reasoning, text=visible.strip(), tool_calls=calls, ill_formed=ill_formed)
