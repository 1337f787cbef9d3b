"""Tool calls of a streamed chat, parsed as the text arrives, by the rules of SGLang 0.5.23's streaming detectors
(function_call/base_format_detector.py, qwen25_detector.py, hermes_detector.py, qwen3_coder_detector.py) and its
serving layer: each update's new text goes in, visible text and call pieces come out.

A call's pieces, as SGLang streams them: first its name (with empty arguments), then its arguments as JSON text in
one or more pieces that concatenate to the whole. The JSON formats (qwen25, qwen, hermes) send the arguments parsed
so far, as far as they cannot change any more (partial JSON), and drop a call naming a tool the request did not
offer; qwen3_coder sends `{`, each parameter as it closes (its value typed by the tool's schema) and `}`.
tests/test_sglang_contract.py feeds the same chunks to these and to SGLang's own parsers and compares.
"""

import json
import logging
from json import JSONDecodeError, JSONDecoder

import partial_json_parser
from partial_json_parser.core.exceptions import MalformedJSON
from partial_json_parser.core.options import Allow

from slime.utils.output_parsing import _UNDECLARED, _parameter_schemas, _typed
from slime.utils.reasoning_parser import partial_tag

logger = logging.getLogger(__name__)


def _partial_json_loads(text: str, flags):
    """(object, characters consumed) of JSON that may be cut off: SGLang's `_partial_json_loads`."""
    try:
        return partial_json_parser.loads(text, flags), len(text)
    except (JSONDecodeError, IndexError) as e:
        message = getattr(e, "msg", str(e))
        if "Extra data" in message or "pop from empty list" in message:
            start = len(text) - len(text.lstrip(" \t\n\r"))
            return JSONDecoder().raw_decode(text, start)
        raise
    except AssertionError as e:  # partial_json_parser asserts on some inputs: not complete yet
        raise JSONDecodeError("partial_json_parser assertion (treat as incomplete)", text, 0) from e


def _refuse(constant):
    raise ValueError(constant)


def _is_complete_json(text: str) -> bool:
    """SGLang asks orjson, which takes no NaN or Infinity."""
    try:
        json.loads(text, parse_constant=_refuse)
        return True
    except ValueError:  # JSONDecodeError too
        return False


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _call(index, parameters, name=None) -> dict:
    return {"tool_index": index, "name": name, "parameters": parameters}


class _JsonCalls:
    """SGLang's `BaseFormatDetector.parse_streaming_increment`: calls as JSON objects after `bot`."""

    bot = eot = ""
    separator = ", "

    def __init__(self, tools):
        self.tools = {t["function"]["name"]: i for i, t in enumerate(tools) if t["function"].get("name")}
        self.buffer = ""
        self.prev_calls: list = []  # per call, the object parsed so far ({"name", "arguments"})
        self.current = -1  # the call being streamed
        self.name_sent = False
        self.streamed_args: list = []  # per call, the argument text sent so far

    def feed(self, new_text: str) -> tuple[str, list]:
        self.buffer += new_text
        text = self.buffer
        if not (self.bot in text or (self.current > 0 and text.startswith(self.separator))):
            if partial_tag(self.buffer, self.bot):
                return "", []  # maybe the start of a call: wait
            self.buffer = ""
            return text.replace(self.eot, "") if self.eot in text else text, []
        flags = Allow.ALL if self.name_sent else Allow.ALL & ~Allow.STR
        try:
            try:
                after_separator = self.current > 0 and text.startswith(self.separator)
                if after_separator:
                    start = len(self.separator)
                else:
                    pos = text.find(self.bot)
                    start = pos + len(self.bot) if pos != -1 else 0
                if start >= len(text):
                    return "", []
                try:
                    obj, end = _partial_json_loads(text[start:], flags)
                except (MalformedJSON, JSONDecodeError):
                    if after_separator and self.bot in text:  # markup between calls: skip to the next start
                        start = text.find(self.bot) + len(self.bot)
                        if start >= len(text):
                            return "", []
                        obj, end = _partial_json_loads(text[start:], flags)
                    else:
                        raise
                complete = _is_complete_json(text[start : start + end])
                if "name" in obj and obj["name"] not in self.tools:  # an undeclared tool: forget the call
                    self.buffer, self.current, self.name_sent = "", -1, False
                    if self.streamed_args:
                        self.streamed_args.pop()
                    return "", []
                if "parameters" in obj:
                    assert "arguments" not in obj, "model generated both parameters and arguments"
                    obj["arguments"] = obj["parameters"]
            except (MalformedJSON, JSONDecodeError):
                return "", []
            if not obj:
                return "", []
            return "", self._advance(obj, text, start, end, complete)
        except Exception as e:  # noqa: BLE001  (SGLang logs any failure and sends nothing for this chunk)
            logger.error("Error in parse_streaming_increment: %s", e)
            return "", []

    def _advance(self, obj, text, start, end, complete) -> list:
        if not self.name_sent:  # the call's name first, with empty arguments
            name = obj.get("name")
            if not (name and name in self.tools):
                return []
            if self.current == -1:
                self.current = 0
                self.streamed_args.append("")
            while len(self.streamed_args) <= self.current:
                self.streamed_args.append("")
            self.name_sent = True
            return [_call(self.current, "", name)]
        args = obj.get("arguments")
        if args is None:
            return []
        sent = len(self.streamed_args[self.current])
        args_json = json.dumps(args, ensure_ascii=False)
        prev = self.prev_calls[self.current].get("arguments") if self.current < len(self.prev_calls) else None
        diff, index = None, self.current
        if complete:  # the rest of the arguments, and the buffer keeps what follows the call
            diff = args_json[sent:]
            self.buffer = text[start + end :]
        elif prev:  # what cannot change any more
            prev_json = json.dumps(prev, ensure_ascii=False)
            if args_json != prev_json:
                diff = _common_prefix(prev_json, args_json)[sent:]
        while len(self.prev_calls) <= self.current:
            self.prev_calls.append({})
        self.prev_calls[self.current] = obj
        if complete:
            self.name_sent = False
            self.current += 1
        if diff is None:
            return []
        self.streamed_args[index] += diff
        return [_call(index, diff)]

    def unstreamed(self) -> dict | None:
        """SGLang's `_check_for_unstreamed_tool_args`: the last call's arguments not yet sent when the stream ends."""
        if not self.prev_calls or not self.streamed_args:
            return None
        index = len(self.prev_calls) - 1
        if index >= len(self.streamed_args):
            return None
        expected = self.prev_calls[index].get("arguments", {})
        expected = expected if isinstance(expected, str) else json.dumps(expected, ensure_ascii=False)
        actual = self.streamed_args[index]
        rest = expected[len(actual) :] if expected.startswith(actual) else ""
        return _call(index, rest) if rest else None


class _Qwen25Calls(_JsonCalls):
    """SGLang's `Qwen25Detector`: `<tool_call>\\n{...}\\n</tool_call>`, a `</tool_call>` never shown as text."""

    bot, eot, separator = "<tool_call>\n", "\n</tool_call>", "\n"

    def __init__(self, tools):
        super().__init__(tools)
        self.text_buffer = ""

    def feed(self, new_text):
        text, calls = super().feed(new_text)
        if text:
            self.text_buffer += text
            end = self.eot[1:]
            if end in self.text_buffer:
                text, self.text_buffer = self.text_buffer.replace(end, ""), ""
            elif n := partial_tag(self.text_buffer, end):
                text, self.text_buffer = self.text_buffer[:-n], self.text_buffer[-n:]
            else:
                text, self.text_buffer = self.text_buffer, ""
        return text, calls


class _HermesCalls(_JsonCalls):
    """SGLang's `HermesDetector`: `<tool_call>{...}</tool_call>`."""

    bot, eot = "<tool_call>", "</tool_call>"

    def __init__(self, tools):
        super().__init__(tools)
        self.text_buffer = ""

    def _clean(self, text):
        if not text:
            return text
        self.text_buffer += text
        if self.eot in self.text_buffer:
            text, self.text_buffer = self.text_buffer.replace(self.eot, ""), ""
        elif n := partial_tag(self.text_buffer, self.eot):
            text, self.text_buffer = self.text_buffer[:-n], self.text_buffer[-n:]
        else:
            text, self.text_buffer = self.text_buffer, ""
        return text

    def feed(self, new_text):
        self.buffer += new_text
        text = self.buffer
        if self.bot not in text:
            n = partial_tag(text, self.bot)
            safe, self.buffer = (text[:-n], text[-n:]) if n else (text, "")
            return self._clean(safe), []
        at = text.find(self.bot)
        if at > 0:
            self.buffer = text[at:]
            return text[:at], []
        text, calls = super().feed("")
        return self._clean(text) if text else text, calls


class _Qwen3CoderCalls:
    """SGLang's `Qwen3CoderDetector.parse_streaming_increment`: a cursor over the XML, a call's name when its
    `<function=...>` closes, `{`, each `"key": value` when its parameter closes (typed by the tool's schema), `}`."""

    _tags = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")

    def __init__(self, tools):
        self.tools = tools
        self.buffer, self.pos = "", 0
        self.current, self.params, self.json_started, self.inside, self.function = -1, 0, False, False, None

    def feed(self, new_text: str) -> tuple[str, list]:
        self.buffer += new_text
        if not self.buffer:
            return "", []
        calls, text = [], []
        while rest := self.buffer[self.pos :]:
            if rest.startswith("<tool_call>"):
                self.pos += len("<tool_call>")
                self.inside = True
            elif rest.startswith("<function="):
                close = rest.find(">")
                if close == -1:
                    break
                self.current += 1
                self.params, self.json_started, self.function = 0, False, rest[len("<function=") : close]
                calls.append(_call(self.current, "", self.function))
                self.pos += close + 1
            elif rest.startswith("<parameter="):
                close = rest.find(">")
                if close == -1:
                    break
                value = rest[close + 1 :]
                # a value ends at </parameter>, or (cut off) at the next <parameter= or at </function>
                ends = [(value.find("</parameter>"), len("</parameter>"))]
                ends += [(value.find("<parameter="), 0), (value.find("</function>"), 0)]
                ends = [e for e in ends if e[0] != -1]
                if not ends:
                    break
                end, tag = min(ends, key=lambda e: e[0])
                raw = value[:end]
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                if not self.json_started:
                    calls.append(_call(self.current, "{"))
                    self.json_started = True
                key = rest[len("<parameter=") : close]
                typed = _typed(raw, _parameter_schemas(self.function, self.tools).get(key, _UNDECLARED))
                pair = f"{json.dumps(key)}: {json.dumps(typed, ensure_ascii=False)}"
                calls.append(_call(self.current, f", {pair}" if self.params else pair))
                self.params += 1
                self.pos += close + 1 + end + tag
            elif rest.startswith("</function>"):
                if not self.json_started:
                    calls.append(_call(self.current, "{"))
                    self.json_started = True
                calls.append(_call(self.current, "}"))
                self.pos += len("</function>")
                self.function = None
            elif rest.startswith("</tool_call>"):
                self.pos += len("</tool_call>")
                self.inside = False
            else:
                angle = rest.find("<")
                if angle == 0 and any(tag.startswith(rest) for tag in self._tags):
                    break  # a tag, maybe: wait for more
                piece = rest if angle == -1 else rest[: max(angle, 1)]
                if not self.inside:  # between the tags of a call, text is dropped
                    text.append(piece)
                self.pos += len(piece)
        if self.pos:
            self.buffer, self.pos = self.buffer[self.pos :], 0
        return "".join(text), calls

    def unstreamed(self):
        return None  # every piece is sent as it closes


FORMATS = {"qwen25": _Qwen25Calls, "qwen": _Qwen25Calls, "hermes": _HermesCalls, "qwen3_coder": _Qwen3CoderCalls}


def tool_call_stream(parser: str, tools: list[dict]):
    """A choice's parser: `.feed(new_text)` -> (visible text, [{"tool_index", "name", "parameters"}]) per update;
    `.unstreamed()` -> the last call's arguments not yet sent, or None, when the choice ends."""
    return FORMATS[parser](tools)
