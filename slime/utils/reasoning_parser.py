"""SGLang's reasoning parsers without SGLang: the rules of SGLang 0.5.23 (parser/reasoning_parser.py,
parser/template_detection.py, entrypoints/openai/serving_chat.py, the scheduler's reasoning-token count) for the
parsers `qwen3`, `qwen3-thinking` and `deepseek-r1`, as the CPU server's `--reasoning-parser` and the agent adapters'
output parsing (slime.utils.output_parsing) apply them:

- whether a chat is in thinking mode: the chat template's reasoning toggle, detected from its source (an always-on
  template; a toggle `enable_thinking` / `thinking` defaulting on or off), else the parser's default (`qwen3`: on
  unless `chat_template_kwargs.enable_thinking` is false; `deepseek-r1`: always);
- the split of an output into `reasoning_content` and content (whole, or update by update when streamed): in thinking
  mode, or once the output opens `<think>`, everything up to `</think>` is reasoning (a leading `<think>` dropped);
  `qwen3` also ends it at an opened `<tool_call>`; an output cut off before `</think>` is all reasoning;
- `usage.reasoning_tokens`: in thinking mode, the output tokens up to and including the encoded `</think>`
  (whether or not the split runs: `separate_reasoning: false` leaves the text whole).
tests/test_sglang_contract.py runs the split against SGLang's own parser on the same texts and chunks.
"""

import functools
import re

PARSERS = ("qwen3", "qwen3-thinking", "deepseek-r1")
THINK_START, THINK_END = "<think>", "</think>"


class _Detector:
    """SGLang's `BaseReasoningFormatDetector` with `<think>` / `</think>` (no self label, a tool start anywhere)."""

    def __init__(self, force, stream_reasoning=True, tool_start=None, previous_content="", force_nonempty=False):
        self.tool_start, self.stream_reasoning, self.force_nonempty = tool_start, stream_reasoning, force_nonempty
        self.in_reasoning = force
        self.buffer, self.stripped_start, self.accumulated = "", False, ""
        self.previous = previous_content
        if THINK_START in previous_content:
            self.in_reasoning = True
        if THINK_END in previous_content:
            self.in_reasoning = False

    def _nonempty(self, reasoning, normal):
        return (reasoning, normal) if not self.force_nonempty or normal else (normal, reasoning)

    def parse(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole output: SGLang's `detect_and_parse`."""
        if not (self.in_reasoning or THINK_START in text):
            return self._nonempty("", text)
        while text.startswith(THINK_START):
            text = text[len(THINK_START) :]
        if THINK_END not in text and THINK_END not in self.previous:
            at = text.find(self.tool_start) if self.tool_start else -1
            if at != -1:  # an opened tool call ends unclosed reasoning; the call stays in the content
                return self._nonempty(text[:at], text[at:])
            return self._nonempty(text, "")  # cut off before its end: all reasoning
        if THINK_END in text:
            reasoning, normal = text.split(THINK_END, 1)
            return self._nonempty(reasoning, normal)
        return self._nonempty("", text)  # the reasoning closed in the continued message

    def feed(self, new_text: str) -> tuple[str, str]:
        """(reasoning, content) of one update's new text: SGLang's `parse_streaming_increment`."""
        reasoning, normal = self._feed(new_text)
        if self.force_nonempty:
            self.accumulated = self.accumulated + reasoning if self.in_reasoning else ""
        return reasoning, normal

    def _feed(self, new_text):
        self.buffer += new_text
        text = self.buffer
        tokens = [THINK_START, THINK_END] + ([self.tool_start] if self.tool_start else [])
        if any(t.startswith(text) and t != text for t in tokens):
            return "", ""  # maybe the start of a tag: wait
        if not self.stripped_start and THINK_START in text:
            text = self.buffer = text.replace(THINK_START, "", 1)
            self.stripped_start, self.in_reasoning = True, True
        if self.in_reasoning and THINK_END in text:
            end = text.find(THINK_END)
            self.buffer, self.in_reasoning = "", False
            return text[:end], text[end + len(THINK_END) :]
        if self.in_reasoning:
            at = text.find(self.tool_start) if self.tool_start else -1
            if at != -1:
                self.buffer, self.in_reasoning = "", False
                return text[:at], text[at:]
            if not self.stream_reasoning:
                return "", ""
            # all but a trailing piece that may begin a tag split across updates
            held = [THINK_END] + ([self.tool_start] if self.tool_start else [])
            held += [] if self.stripped_start else [THINK_START]
            keep = max(partial_tag(text, t) for t in held)
            self.buffer = text[len(text) - keep :]
            return text[: len(text) - keep], ""
        self.buffer = ""
        return "", text

    def finish(self) -> tuple[str, str]:
        """What an ended stream still holds: SGLang's `finish`."""
        buffer, self.buffer = self.buffer, ""
        if not self.in_reasoning:
            return "", buffer
        if buffer.startswith(THINK_START):
            buffer = buffer[len(THINK_START) :]
        if self.force_nonempty:
            normal, self.accumulated = self.accumulated + buffer, ""
            return "", normal
        return buffer, ""


def partial_tag(text: str, token: str) -> int:
    """The longest end of text that begins token (not all of it): a tag maybe split across updates. (SGLang's tool
    detectors take the shortest such end, its reasoning detectors the longest: the same for tags that do not begin
    with a piece of their own end, as every tag here.)"""
    for i in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-i:]):
            return i
    return 0


def detector(parser, force, stream_reasoning=True, previous_content="", force_nonempty=False) -> _Detector:
    """SGLang's `ReasoningParser(parser, stream_reasoning, force, request)` for this server's parsers."""
    force = True if parser in ("qwen3-thinking", "deepseek-r1") else force  # R1 reasons until </think>, always
    tool_start = "<tool_call>" if parser.startswith("qwen3") else None
    return _Detector(force, stream_reasoning, tool_start, previous_content, force_nonempty)


# ---- the chat template's reasoning toggle (SGLang's REASONING_MODE_RULES, in order) --------------------------------
def _default_assignment(template: str, param: str, default: bool) -> bool:
    """`param | default(<default>)` (or `d(...)`) as a working toggle, read from the template's syntax tree."""
    import jinja2.nodes  # lazy: only a server with a reasoning parser reads templates

    try:
        tree = _jinja_env().parse(template)
    except Exception:  # noqa: BLE001  (an unparsable template has no toggle; start-up goes on)
        return False
    for node in tree.find_all(jinja2.nodes.Filter):
        if node.name not in ("default", "d") or node.dyn_args or node.dyn_kwargs:
            continue
        if not isinstance(node.node, jinja2.nodes.Name) or node.node.name != param:
            continue
        args, kwargs = list(node.args), {kw.key: kw.value for kw in node.kwargs}
        if not args or not isinstance(args[0], jinja2.nodes.Const) or not isinstance(args[0].value, bool):
            continue
        boolean = args[1] if len(args) > 1 else kwargs.get("boolean")
        if boolean is not None and not isinstance(boolean, jinja2.nodes.Const):
            continue
        if boolean is not None and bool(boolean.value) and args[0].value:
            continue  # default(true, true): false becomes true, no toggle
        if args[0].value is default:
            return True
    return False


@functools.cache
def _jinja_env():
    import jinja2.ext

    class GenerationTag(jinja2.ext.Extension):
        """Parses transformers' `{% generation %}` blocks (assistant masks), so such templates build a tree."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return jinja2.Environment(extensions=[jinja2.ext.loopcontrols, GenerationTag])


def _toggle_on(t, p):
    return (
        re.search(rf"{{%\s*if\s+not\s+{p}\s+is\s+defined\s*%}}.*?{{%\s*set\s+{p}\s*=\s*(?:true|True)\s*%}}", t, re.S)
        or re.search(rf"set\s+{p}\s*=\s*{p}\s+if\s+{p}\s+is\s+defined\s+else\s+(?:true|True)", t)
        or re.search(rf"{p}\s+is\s+defined\s+and\s+(?:{p}\s+is\s+false|not\s+{p})", t)
        or re.search(rf"{p}\s+is\s+not\s+defined\s+or\s+{p}", t)
        or re.search(rf"namespace\([^)]*{p}\s*=\s*true", t)
        or _default_assignment(t, p, True)
    )


def _toggle_off(t, p):
    return re.search(
        rf"{{%\s*if\s+not\s+{p}\s+is\s+defined\s*%}}.*?{{%\s*set\s+{p}\s*=\s*(?:false|False)\s*%}}", t, re.S
    ) or _default_assignment(t, p, False)


# (always on, the toggle's template argument, its default, the special case) of the first rule that matches
_RULES = (
    (
        lambda t: "<ifm|think>" in t and "<ifm|think_fast>" in t and "reasoning_effort" in t,
        (True, None, None, "always"),
    ),
    (lambda t: "<|channel|>" in t, (True, None, None, "always")),
    (
        lambda t: (
            re.search(r"<\|im_start\|>assistant\\n<think>\\n", t)
            and "enable_thinking" not in t
            and "thinking" not in t
        ),
        (True, None, None, "always"),
    ),
    (
        lambda t: (
            all(s in t for s in ("[gMASK]<sop>", "Reasoning Effort:", "<tool_call>", "<arg_key>", "<arg_value>"))
            and "enable_thinking" not in t
        ),
        (True, None, None, "always"),
    ),
    (lambda t: "reasoning_effort" in t and "[THINK]" in t, (False, None, None, "mistral")),
    (
        lambda t: "reasoning_effort" in t and "reasoning_mode_token" in t and "no_think" in t,
        (False, None, None, "hunyuan_effort"),
    ),
    (lambda t: _toggle_off(t, "enable_thinking"), (False, "enable_thinking", False, None)),
    (lambda t: "low_effort" in t and "truncate_history_thinking" in t, (False, "enable_thinking", True, None)),
    (lambda t: _toggle_on(t, "enable_thinking"), (False, "enable_thinking", True, None)),
    (lambda t: _toggle_off(t, "thinking"), (False, "thinking", False, None)),
    (lambda t: _toggle_on(t, "thinking"), (False, "thinking", True, None)),
)


def template_toggle(template: str | None):
    """(template forces reasoning, (toggle argument, its default, special case) or None): SGLang's
    `detect_reasoning_pattern`."""
    for matches, (always, param, default, special) in _RULES if isinstance(template, str) else ():
        if matches(template):
            return always, (param, default, special)
    return False, None


def thinking(parser: str, toggle, template_kwargs: dict, reasoning_effort=None) -> bool:
    """Whether a chat runs in thinking mode (SGLang's `_get_reasoning_from_request`): the template's toggle, else the
    parser's default (`qwen3`: `enable_thinking` unless false; `deepseek-r1`: always)."""
    kwargs = template_kwargs or {}
    if toggle is None:
        if parser == "deepseek-r1":
            return True
        return kwargs.get("enable_thinking") is not False
    param, default, special = toggle
    if special == "always":
        return True
    if special == "mistral":
        return reasoning_effort is not None and reasoning_effort != "none"
    if param is None or default is None:
        return False
    if default:
        return kwargs.get(param) is not False
    return kwargs.get(param) is True


def reasoning_tokens(output_ids: list, end_ids: list) -> int:
    """A thinking-mode output's reasoning tokens: those up to and including the first `</think>` ids, all while it
    is not closed (SGLang's scheduler counts them token by token, `Req.update_reasoning_tokens`)."""
    n = len(end_ids)
    for i in range(len(output_ids) - n + 1) if n else ():
        if output_ids[i : i + n] == end_ids:
            return i + n
    return len(output_ids)
