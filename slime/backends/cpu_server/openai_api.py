"""OpenAI-compatible API of slime's CPU server: `/v1/completions` and `/v1/chat/completions` (plain and streamed),
`/tokenize` and `/detokenize`, as SGLang 0.5.23's OpenAI serving answers them."""

import asyncio
import functools
import json
import time
import uuid
from http import HTTPStatus

from aiohttp import web

from slime.utils.output_parsing import split_tool_calls
from slime.utils.reasoning_parser import detector, reasoning_tokens, thinking
from slime.utils.sampling_record import openai_requested_adapter, openai_sampling_params

from . import chat_prompt
from .generate_api import EndOfStream, prompt_rid
from .media import expand, expand_with_videos, fetch_remote_media, images_per_prompt, videos_per_prompt
from .sampling import ContractError, RequestError, SamplingParams
from .scheduler import Req
from .tool_stream import tool_call_stream

# Fields of SGLang's OpenAI requests that change what is sampled or what the answer carries, which this server does
# not serve: refused by name when set (SGLang's own no-ops here -- user, priority, cache keys, thinking/task and the
# parsers' switches, which need a model family's encoder or a parser this server has not -- are accepted)
_NOT_SERVED = (
    "return_hidden_states",
    "return_routed_experts",
    "return_cached_tokens_details",
    "return_spec_tokens_details",
    "return_input_ids_in_sglext",
    "return_output_ids_in_sglext",
    "return_meta_info",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_flat_raw_output_top_logprobs",
    "session_id",
    "session_params",
    "input_ids",
    "stop_regex",
    "custom_logit_processor",
    "watermark",
    "images_config",
    "video_config",
    "mm_processor_kwargs",
    "min_dynamic_patch",
    "max_dynamic_patch",
    "use_audio_in_video",
)

# SGLang's ChatCompletionMessageParam: "user", or one of these (case-insensitive, lowered)
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")


def _with_checked_role(message):
    role = message["role"]
    if role == "user":
        return message
    if not isinstance(role, str) or role.lower() not in _GENERIC_ROLES:
        allowed = ", ".join(repr(r) for r in _GENERIC_ROLES)
        raise RequestError(f"'role' must be one of {allowed} (case-insensitive), or 'user'; got {role!r}.")
    return {**message, "role": role.lower()}


@functools.cache
def _byte_decoder() -> dict:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves, the others for
    characters from U+0100 on."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """A token's text and bytes in OpenAI log-probs, as SGLang renders them: a byte-level BPE token's bytes come from
    its id, as its decoded text loses a fragment of a character to U+FFFD (legacy completions then show the fragment
    as latin-1, one character per byte)."""

    def __init__(self, tokenizer):
        self.tok, dec = tokenizer, _byte_decoder()
        n = len(tokenizer.get_vocab())  # SGLang's probe: a few pieces, all in the byte alphabet
        pieces = [tokenizer.convert_ids_to_tokens(i) for i in (0, 1, 2, 3, n // 2, n - 2) if 0 <= i < n]
        self.byte_level = all(ch in dec for piece in pieces if piece for ch in piece)

    def text(self, t) -> str:
        return self.tok.decode([t])

    def raw(self, t):
        """The token's bytes, or None where its piece is not byte-level (special tokens, SentencePiece)."""
        dec = _byte_decoder()
        piece = self.tok.convert_ids_to_tokens(t) if self.byte_level else None
        if not piece or any(ch not in dec for ch in piece):
            return None
        return [dec[ch] for ch in piece]

    def item(self, t, logprob) -> dict:
        """Chat's {token, bytes, logprob} of one token."""
        text, raw = self.text(t), self.raw(t)
        return {"token": text, "bytes": list(text.encode()) if raw is None else raw, "logprob": logprob}

    def lossless(self, t) -> str:
        """Legacy completions' text of one token."""
        text = self.text(t)
        raw = self.raw(t) if "\ufffd" in text else None
        if raw is None:
            return text
        try:
            bytes(raw).decode("utf-8")  # a whole character that is U+FFFD itself
            return text
        except UnicodeDecodeError:
            return bytes(raw).decode("latin-1")


def _usage(prompt_tokens, completion_tokens, cached=None, reasoning=0) -> dict:
    """SGLang's UsageInfo; cached: the prompt tokens taken from the prefix cache, reported as SGLang's
    --enable-cache-report does, or None (no details); reasoning: the thinking tokens (a reasoning parser's count)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "reasoning_tokens": reasoning,
        "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None,
    }


def _event(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _StreamState:
    """What SGLang's OpenAI stream has sent of each choice (its index): text, log-probs, tokens; the rest of the
    stream reads it."""

    def __init__(self, b, reqs, n, cache_report, count_reasoning=None):
        self.created, self.model = int(time.time()), b.get("model", "default")
        opts = b.get("stream_options") or {}  # SGLang's server default: no usage
        self.include_usage, self.continuous = bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats"))
        self.reqs, self.prompt_lens, self.n = reqs, [len(r.input_ids) for r in reqs], n
        self.cache_report, self.count_reasoning = cache_report, count_reasoning  # output ids -> thinking tokens
        self.text, self.tokens, self.reasoning, self.finished, self.rid = {}, {}, {}, {}, None

    def take(self, r, text, ids, finished):
        """(is it the choice's first update, its new text, [start, end) of its new tokens) from a cumulative update."""
        i, self.rid = r.index, r.rid
        first, sent = i not in self.text, self.text.get(i, "")
        start = self.tokens.get(i, 0)
        self.text[i], self.tokens[i] = text, len(ids)
        self.reasoning[i] = self.count_reasoning(ids) if self.count_reasoning else 0
        if finished:
            self.finished[i] = r.finish_reason
        return first, text[len(sent) :], (start, len(ids))

    def usage(self, i, cached=False) -> dict:
        """Choice i's usage so far; cached: with its cached tokens when reported (SGLang's chat chunks have them, its
        completion chunks not)."""
        cached = self.reqs[i].cached_tokens if cached and self.cache_report else None
        return _usage(self.prompt_lens[i], self.tokens.get(i, 0), cached, self.reasoning.get(i, 0))

    def total_usage(self) -> dict:
        """SGLang's: each prompt counted once (its first choice's), every choice's tokens."""
        cached = sum(r.cached_tokens for r in self.reqs[:: self.n]) if self.cache_report else None
        return _usage(
            sum(self.prompt_lens[:: self.n]), sum(self.tokens.values()), cached, sum(self.reasoning.values())
        )

    def chunk(self, kind, choices, **extra) -> dict:
        return {
            "id": self.rid,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def _finish(r) -> str:
    return {"stop": "stop", "length": "length", "abort": "abort"}[r.finish_reason["type"]]


def _tool_calls(r, parser, tools, text, reasoning=None):
    """(the chat message, its finish reason) of a finished choice whose text after its reasoning (if split off) is
    `text`: with a tool-call parser (and tools in play), SGLang's calls parsed out of it by the format's rules
    (`slime.utils.output_parsing`), the text before them left as the content, and a stop that made calls reported as
    "tool_calls"."""
    finish = _finish(r)
    content, calls, _ = split_tool_calls(text, tools, parser) if parser else (text, [], False)
    message = {"role": "assistant", "content": content or "", "reasoning_content": reasoning or None}  # no null calls
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "index": k,
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
            }
            for k, c in enumerate(calls)
        ]
        finish = "tool_calls" if finish == "stop" else finish
    return message, finish


def _stream_finish(reason, made_calls) -> str:
    """A streamed choice's finish reason: a stop after calls is "tool_calls", as SGLang's stream reports it."""
    return "tool_calls" if made_calls and reason["type"] == "stop" else reason["type"]


def _end_on_error(r, finished):
    """SGLang ends an OpenAI stream with one error event when a choice is aborted with an error code."""
    code = r.finish_reason.get("status_code") if finished else None
    if not code:
        return
    code = HTTPStatus(code)
    message = r.finish_reason.get("message") or "Generation aborted."
    error = {"object": "error", "message": message, "type": code.name, "param": None, "code": code.value}
    raise EndOfStream([_event({"error": error})])


class OpenAIAPI:
    """`/v1/completions` and `/v1/chat/completions` over the same scheduler as `/generate`, plain or streamed."""

    @functools.cached_property
    def token_text(self) -> TokenText:
        return TokenText(self.tokenizer)

    def _openai_sampling(self, b, prompt_len, model_defaults, chat):
        """SGLang's sampling parameters for an OpenAI request (`model_defaults`: what a chat request takes from the
        model's generation_config.json where it sends nothing; {} for /v1/completions)."""
        if chat:  # SGLang: `max_completion_tokens or max_tokens`, else up to the context
            max_tokens = b.get("max_completion_tokens") or b.get("max_tokens")
        else:  # CompletionRequest.max_tokens: 16 unless sent, and positive
            max_tokens = b.get("max_tokens")
            max_tokens = 16 if max_tokens is None else max_tokens
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
                raise RequestError("max_tokens must be positive")
        sp = {
            "max_new_tokens": max_tokens if max_tokens is not None else self.context_len - prompt_len - 1,
            "n": b.get("n", 1),
            "stop": b.get("stop"),
            "stop_token_ids": b.get("stop_token_ids"),
            "sampling_seed": b.get("seed"),
            **openai_sampling_params(b, model_defaults),
        }
        for k in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if k in b:
                sp[k] = b[k]
        return {k: v for k, v in sp.items() if v is not None}

    def _openai_reqs(self, b, prompts, model_defaults, mm=None, chat=True):
        """The checked requests of one OpenAI call: for each prompt (a list of ids) its n choices, prompt by prompt."""
        unserved = [k for k in _NOT_SERVED if b.get(k) not in (None, False)]
        if unserved:
            raise RequestError(f"{', '.join(unserved)}: not supported by slime's CPU server")
        rids = b.get("rid")  # SGLang's request ids: one per prompt; a string names a batch's prompts R_0, R_1, ...
        if rids is not None and not (isinstance(rids, str) or (isinstance(rids, list) and len(rids) == len(prompts))):
            raise RequestError(f"rid must be a string or a list of one per prompt ({len(prompts)})")
        if chat and b.get("stream"):  # SGLang's checks of a streamed chat request
            for field in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
                if b.get(field):
                    where = " on /v1/chat/completions" if field == "return_token_ids" else ""
                    raise RequestError(
                        f"{field} is not supported with streaming{where}. Please set stream=false when using {field}=true."
                    )
        if chat:  # SGLang: `logprobs` a boolean, `top_logprobs` how many alternatives
            want_lp, top_n = bool(b.get("logprobs")), b.get("top_logprobs") or 0
        else:  # `logprobs: N` both asks for log-probs (0 too) and for N alternatives
            want_lp, top_n = b.get("logprobs") is not None, b.get("logprobs") or 0
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise RequestError(
                f"{'top_logprobs' if chat else 'logprobs'} must be a non-negative integer, got {top_n!r}"
            )
        # an echoed completion with log-probs: SGLang's from the prompt's first token on
        start = 0 if not chat and b.get("echo") and top_n else -1
        adapter = openai_requested_adapter(b, self.served_model_name)
        if isinstance(adapter, list) and len(adapter) != len(prompts):  # SGLang's batch normalisation
            raise RequestError(
                f"lora_path is a list of {len(adapter)}: it needs one entry per prompt ({len(prompts)})"
            )
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        reqs, names = [], []
        for i, (ids, name) in enumerate(zip(prompts, adapters)):
            sp = SamplingParams.from_dict(
                self._openai_sampling(b, len(ids), model_defaults, chat), self.cfg.vocab_size
            )
            self._check_prompt(ids, sp)
            rid = prompt_rid(rids, i, len(prompts) > 1)
            for _ in range(sp.n):
                r = Req(
                    ids,
                    sp,
                    rid=None if sp.n > 1 else rid,  # parallel samples get fresh ids
                    return_logprob=want_lp,
                    logprob_start_len=start,
                    top_logprobs_num=top_n,
                )
                r.index, r.mm = len(reqs), mm
                reqs.append(r)
                names.append(name)
        for r, lora in zip(reqs, self._acquire_loras(names)):
            r.lora = lora
        return reqs

    async def _chat_media(self, inputs):
        """(images, videos) of a chat's parts, fetched and checked as SGLang takes them (empty lists without any)."""
        if not inputs.images and not inputs.videos:
            return [], []
        if self.processor is None:
            raise RequestError(f"media parts: the served model ({self.cfg.architecture}) takes text only")
        body = {"image_data": inputs.images, "video_data": inputs.videos}
        body = await asyncio.to_thread(fetch_remote_media, body)
        return images_per_prompt(body, 1, False, self.cfg.model_type)[0], videos_per_prompt(body, 1, False)[0]

    def _response(self, b, kind, choices, prompt_len, reqs, n, reasoning=0):
        """The response around `choices` (n per prompt), as SGLang builds it: the request's own `model` echoed, each
        prompt's tokens (and cached ones) counted once, and the first choice's weight version (and its per-token
        spans) in `metadata`."""
        cached = sum(r.cached_tokens for r in reqs[::n]) if self.args.enable_cache_report else None
        return web.json_response(
            {
                "id": reqs[0].rid,  # SGLang's: the first choice's request id
                "object": kind,
                "created": int(time.time()),
                "model": b.get("model", "default"),
                "choices": choices,
                "usage": _usage(prompt_len, sum(len(r.output_ids) for r in reqs), cached, reasoning),
                "metadata": self._versions(reqs[0]),
            }
        )

    # ------------------------------------------------------------------ log-probs of output tokens [a, b)
    def _completion_logprobs(self, r, a=0, b=None, prompt=False):
        """SGLang's LogProbs of legacy completions (offsets unknown: -1): output tokens [a, b), after the prompt's
        tokens (`prompt`: an echo asked for their log-probs; the first has none)."""
        tt = self.token_text
        entries = [(lp, t) for lp, t, _ in r.input_logprobs or []] if prompt else []
        entries += zip(r.output_logprobs[a:b], r.output_ids[a:b])
        tops = [*(r.input_top_logprobs or []), *r.output_top_logprobs[a:b]] if prompt else r.output_top_logprobs[a:b]
        return {
            "text_offset": [-1] * len(entries),
            "token_logprobs": [lp for lp, _ in entries],
            "tokens": [tt.lossless(t) for _, t in entries],
            "top_logprobs": [None if row is None else {tt.lossless(t): v for v, t, _ in row} for row in tops],
        }

    def _chat_logprobs(self, r, a=0, b=None):
        """SGLang's ChoiceLogprobs of chat."""
        tt, tops = self.token_text, r.output_top_logprobs[a:b]
        return {
            "content": [
                {
                    **tt.item(t, v),
                    "top_logprobs": [tt.item(alt, alt_v) for alt_v, alt, _ in (tops[k] if k < len(tops) else [])],
                }
                for k, (t, v) in enumerate(zip(r.output_ids[a:b], r.output_logprobs[a:b]))
            ]
        }

    # ------------------------------------------------------------------ /v1/completions
    def _completion_prompts(self, prompt) -> list:
        """SGLang's CompletionRequest.prompt (a string, a list of ids, or a list of either): [(ids, echo text)]."""
        if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
            raise RequestError("Prompt cannot be empty")

        def ids_ok(p):
            return isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)

        if isinstance(prompt, str) or ids_ok(prompt):
            prompt = [prompt]
        if not isinstance(prompt, list) or not all(isinstance(p, str) or ids_ok(p) for p in prompt):
            raise RequestError("prompt must be a string, a list of token ids, or a list of either")
        if len({type(p) for p in prompt}) > 1:
            raise RequestError("prompt: a batch is all strings or all lists of token ids")
        return [
            (self.tokenizer.encode(p), p)
            if isinstance(p, str)
            else (p, self.tokenizer.decode(p, skip_special_tokens=True))
            for p in prompt
        ]

    async def v1_completions(self, request):
        b = await self._body(request)
        self._check_ready()
        prompts = self._completion_prompts(b.get("prompt"))
        reqs = self._openai_reqs(b, [ids for ids, _ in prompts], {}, chat=False)
        n = len(reqs) // len(prompts)
        # SGLang's echo: each choice's text after its prompt's (ids decoded without special tokens)
        echo = [text if b.get("echo") else "" for _, text in prompts for _ in range(n)]
        echo_logprobs = bool(b.get("echo") and b.get("logprobs"))
        if b.get("stream"):
            return await self._completion_stream(request, b, reqs, n, echo, echo_logprobs)
        reqs = await self._run(reqs)
        choices = []
        for r in reqs:
            choices.append(
                {
                    "index": r.index,
                    "text": echo[r.index] + r.text,
                    "logprobs": self._completion_logprobs(r, prompt=echo_logprobs) if r.return_logprob else None,
                    "finish_reason": _finish(r),
                    "matched_stop": r.finish_reason.get("matched"),
                    # SGLang's return_token_ids: the sampled and the prompt's ids
                    **(
                        {"token_ids": r.output_ids, "prompt_token_ids": r.input_ids}
                        if b.get("return_token_ids")
                        else {}
                    ),
                }
            )
        return self._response(b, "text_completion", choices, sum(len(ids) for ids, _ in prompts), reqs, n)

    async def _completion_stream(self, request, b, reqs, n, echo, echo_logprobs):
        """SGLang's streamed completion: a chunk per update of a choice (its new text, log-probs and, asked, token
        ids; in its first the echo and the prompt's ids), the finish reason in its last; then the usage when asked."""
        st = _StreamState(b, reqs, n, self.args.enable_cache_report)

        def events(r, text, out_ids, finished):
            first, delta, (a, e) = st.take(r, text, out_ids, finished)
            _end_on_error(r, finished)
            with_prompt = first and echo_logprobs
            choice = {
                "index": r.index,
                "text": echo[r.index] + delta if first else delta,
                "logprobs": self._completion_logprobs(r, a, e, with_prompt)
                if r.return_logprob and (a < e or with_prompt)
                else None,
                "finish_reason": _finish(r) if finished else None,
                "matched_stop": r.finish_reason.get("matched") if finished else None,
            }
            if b.get("return_token_ids"):
                choice["token_ids"] = out_ids[a:e]
                if first:
                    choice["prompt_token_ids"] = list(r.input_ids)
            usage = st.usage(r.index) if st.continuous else None
            return [_event(st.chunk("text_completion", [choice], usage=usage))]

        def tail():
            if not st.include_usage:
                return []
            usage = {k: v for k, v in st.total_usage().items() if v is not None}  # SGLang: exclude_none
            return [_event(st.chunk("text_completion", [], usage=usage))]

        return await self._stream(request, reqs, events, tail)

    # ------------------------------------------------------------------ /v1/chat/completions
    def _chat_inputs(self, b, **kw) -> chat_prompt.TemplateInputs:
        msgs = b.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise RequestError("messages must be a non-empty list of {role, content} objects")
        msgs = [_with_checked_role(m) for m in msgs]
        if self.processor is None:  # SGLang's check for a text-only model
            parts = [p for m in msgs if isinstance(m.get("content"), list) for p in m["content"]]
            media = [p.get("type") for p in parts if isinstance(p, dict)]
            media = [t for t in media if t in ("image_url", "video_url", "audio_url")]
            if media:
                raise RequestError(f"Model only supports text input; received unsupported content type '{media[0]}'.")
        fmt = chat_prompt.content_format(self.tokenizer.chat_template or "")
        return chat_prompt.template_inputs(b, msgs, fmt, **kw)

    async def v1_chat_completions(self, request):
        b = await self._body(request)
        self._check_ready()
        inputs = self._chat_inputs(b)
        parser = self.args.tool_call_parser if inputs.tools_active else None
        images, videos = await self._chat_media(inputs)
        ids = chat_prompt.render(self.tokenizer, inputs)
        if inputs.tools_active:  # SGLang keeps special tokens in the text of a chat with tools
            b = {**b, "skip_special_tokens": False}
        mm = None
        if videos:
            ids, mm = expand_with_videos(self.processor, list(ids), images, videos, "the chat prompt")
        elif images:
            ids, mm = expand(self.processor, list(ids), images, "the chat prompt")
        ids = list(ids)
        reqs = self._openai_reqs(b, [ids], self.chat_sampling_defaults, mm)
        split, count = self._reasoning(b, inputs)
        if b.get("stream"):
            return await self._chat_stream(request, b, reqs, parser, inputs.declared_tools, split, count)
        reqs = await self._run(reqs)
        want_prompt = b.get("return_prompt_token_ids") or b.get("return_token_ids")
        choices = []
        for i, r in enumerate(reqs):
            reasoning, text = split(False).parse(r.text) if split else (None, r.text)
            message, finish = _tool_calls(r, parser, inputs.declared_tools, text, reasoning)
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._chat_logprobs(r) if r.return_logprob else None,
                    "finish_reason": finish,
                    "matched_stop": None if finish == "tool_calls" else r.finish_reason.get("matched"),
                    # SGLang's return_prompt_token_ids / return_token_ids
                    **({"prompt_token_ids": ids} if want_prompt else {}),
                    **({"response_token_ids": r.output_ids} if b.get("return_token_ids") else {}),
                }
            )
        thought = sum(count(r.output_ids) for r in reqs) if count else 0
        return self._response(b, "chat.completion", choices, len(ids), reqs, len(reqs), thought)

    def _reasoning(self, b, inputs):
        """With --reasoning-parser, as SGLang decides for a chat: (`split(stream_reasoning)` -> a reasoning detector
        of an output, or None when `separate_reasoning` is false; `count(output ids)` -> its thinking tokens, or None
        outside thinking mode). Without: (None, None)."""
        parser = self.args.reasoning_parser
        if not parser:
            return None, None
        template_forces, toggle = self.reasoning_toggle
        think = thinking(parser, toggle, inputs.kwargs, inputs.kwargs.get("reasoning_effort"))
        count = functools.partial(reasoning_tokens, end_ids=self.think_end_ids) if think else None
        if b.get("separate_reasoning") is False:
            return None, count
        nonempty = inputs.kwargs.get("force_nonempty_content") is True
        return functools.partial(
            detector, parser, template_forces or think, previous_content=inputs.prefix or "", force_nonempty=nonempty
        ), count

    async def _chat_stream(self, request, b, reqs, parser=None, tools=None, split=None, count=None):
        """SGLang's streamed chat completion: per choice a first chunk with the role, then a chunk per update
        that adds text (with its new tokens' log-probs: an update that adds no text sends none, as SGLang); once
        every choice finished, a chunk with each one's finish reason, then the usage when asked. With a tool-call
        parser and tools in play, each update's text goes through it (`_tool_events`); with a reasoning parser, first
        through the reasoning split (its part in `reasoning_content` chunks); with a parser on the server, log-probs no
        text chunk carried go in a chunk of their own, as SGLang's."""
        st = _StreamState(b, reqs, len(reqs), self.args.enable_cache_report, count)
        thoughts = {r.index: split(b.get("stream_reasoning") is not False) for r in reqs} if split else {}
        calls = {r.index: tool_call_stream(parser, tools) for r in reqs} if parser else {}
        made_calls = set()  # choices that sent a call: a stop is reported as "tool_calls"

        def chunk(i, delta, logprobs=None, finish_reason=None, matched_stop=None, usage=None):
            choice = {
                "index": i,
                "delta": {"reasoning_content": None, **delta},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "matched_stop": matched_stop,
            }
            return _event(st.chunk("chat.completion.chunk", [choice], **({} if usage is None else {"usage": usage})))

        def events(r, text, out_ids, finished):
            first, delta, (a, e) = st.take(r, text, out_ids, finished)
            _end_on_error(r, finished)
            out = [chunk(r.index, {"role": "assistant", "content": ""})] if first else []
            logprobs = self._chat_logprobs(r, a, e) if r.return_logprob and a < e else None
            usage = st.usage(r.index, True) if st.continuous else None
            if thoughts:
                think, delta = thoughts[r.index].feed(delta)
                if finished and r.finish_reason["type"] != "abort":  # what the split still holds
                    more, rest = thoughts[r.index].finish()
                    think, delta = think + more, delta + rest
                if think:
                    out.append(chunk(r.index, {"reasoning_content": think}, logprobs, usage=usage))
                    logprobs = None
            if calls:  # the parser's chunks carry no log-probs
                out += self._tool_events(st, r, delta, finished, calls[r.index], made_calls, usage)
            elif delta:
                out.append(chunk(r.index, {"content": delta}, logprobs, usage=usage))
                logprobs = None
            if logprobs is not None and (self.args.tool_call_parser or self.args.reasoning_parser):
                out.append(chunk(r.index, {}, logprobs, usage=usage))  # SGLang's, with a parser: in a chunk alone
            return out

        def tail():
            out = [
                chunk(i, {}, finish_reason=_stream_finish(reason, i in made_calls), matched_stop=reason.get("matched"))
                for i, reason in st.finished.items()
            ]
            if st.include_usage:
                out.append(_event(st.chunk("chat.completion.chunk", [], usage=st.total_usage())))
            return out

        return await self._stream(request, reqs, events, tail)

    @staticmethod
    def _tool_events(st, r, delta, finished, stream, made_calls, usage) -> list:
        """One update of a streamed chat with tools, as SGLang's `_process_tool_call_stream` sends it: the visible
        text the parser lets through, then each call piece (a call's id, name and empty arguments first, then its
        arguments' pieces), and when the choice ends the arguments its parser held back."""

        def piece(fields):
            delta = {"role": None, "content": None, "reasoning_content": None, **fields}
            choice = {"index": r.index, "delta": delta, "logprobs": None, "finish_reason": None, "matched_stop": None}
            return _event(st.chunk("chat.completion.chunk", [choice], usage=usage))

        def call(c):
            made_calls.add(r.index)
            ident = f"call_{uuid.uuid4().hex[:24]}" if c["name"] else None  # with the name: once per call
            function = {"name": c["name"] or None, "arguments": c["parameters"]}
            return piece(
                {"tool_calls": [{"id": ident, "index": c["tool_index"], "type": "function", "function": function}]}
            )

        text, found = stream.feed(delta)
        out = [piece({"content": text})] if text else []
        out += [call(c) for c in found]
        if finished and (rest := stream.unstreamed()) is not None:
            out.append(call(rest))
        return out

    # ------------------------------------------------------------------ /tokenize, /detokenize
    async def tokenize(self, request):
        """SGLang's /tokenize: a prompt (or a list of them) encoded, or a chat's messages rendered as a chat
        completion renders them (`add_generation_prompt` given: as given, with or without the assistant's opening)."""
        b = await self._body(request)
        prompt, msgs = b.get("prompt"), b.get("messages")
        if (prompt is None) == (msgs is None):
            # SGLang's TokenizeRequest validator: refused before its handler runs
            raise ContractError("Value error, Exactly one of 'prompt' or 'messages' must be provided.")
        max_len = getattr(self.tokenizer, "model_max_length", -1)
        if not isinstance(max_len, int) or not -(2**63) <= max_len < 2**64:
            max_len = self.context_len
        special = b.get("add_special_tokens", True)
        if msgs is not None:
            opening = b.get("add_generation_prompt")
            # SGLang encodes a chat rendered as given with add_special_tokens only when the request set it
            inputs = self._chat_inputs(
                b,
                add_generation_prompt=opening,
                add_special_tokens=opening is not None and special and "add_special_tokens" in b,
            )
            if inputs.images or inputs.videos:
                raise RequestError("media parts: /tokenize of slime's CPU server counts text only")
            tokens = chat_prompt.render(self.tokenizer, inputs)
            count = len(tokens)
        elif isinstance(prompt, str):
            tokens = self.tokenizer.encode(prompt, add_special_tokens=special)
            count = len(tokens)
        elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            tokens = [self.tokenizer.encode(p, add_special_tokens=special) for p in prompt]
            count = [len(t) for t in tokens]
        else:
            raise ContractError(f"prompt: Invalid prompt type: {type(prompt).__name__}. Expected str or List[str].")
        return web.json_response({"tokens": tokens, "count": count, "max_model_len": max_len})

    async def detokenize(self, request):
        """SGLang's /detokenize: a list of ids, or a list of such lists, decoded."""
        b = await self._body(request)
        tokens, skip = b.get("tokens"), b.get("skip_special_tokens", True)

        def ids(seq, message):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
                raise RequestError(message)
            return seq

        if isinstance(tokens, list) and tokens and isinstance(tokens[0], int):
            ids(tokens, "Invalid input: 'tokens' must be a list of integers.")
            text = self.tokenizer.decode(tokens, skip_special_tokens=skip)
        elif isinstance(tokens, list) and tokens and isinstance(tokens[0], list):
            text = [
                self.tokenizer.decode(
                    ids(t, f"Invalid input: Sublist in 'tokens' must contain only integers. Found: {t}"),
                    skip_special_tokens=skip,
                )
                for t in tokens
            ]
        elif tokens == []:
            text = ""
        else:
            raise RequestError(f"Invalid tokens type: {type(tokens)}. Expected List[int] or List[List[int]].")
        return web.json_response({"text": text})
