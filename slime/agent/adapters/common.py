"""What the OpenAI and Anthropic adapters share: sessions, one turn against the engine, and the trajectory.

A turn: the client's request is translated to chat-template messages (the protocol's job), rendered to token ids
with the tokenizer's chat template, sent to the engine's `/generate` (through the router, keyed by the session id)
with `input_ids` and `return_logprob` (and, under top-p replay, `return_sampling_mask`, sent to one worker
directly since the router drops it), the sampled text is split into reasoning / text / tool calls in the model
family's format, the protocol's reply is sent (JSON or SSE), and only then the turn -- prompt ids, sampled ids and
log-probs as the engine returned them -- is recorded in the session's tree (a client that went away never received
the turn, so it is not part of its trajectory). `finish_session` turns the tree into `Sample`s.

The adapter's `app` may run in another thread's event loop than the caller's (see `aiohttp_threaded`); the session
table is guarded by a lock and nothing here is tied to one loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import threading
import time
import urllib.error
import uuid
import zlib
from typing import Any

import aiohttp
from aiohttp import web

from slime.agent.trajectory import TrajectoryTree, TurnRecord
from slime.backends.sglang_utils.router import ROUTING_KEY_HEADER, list_workers
from slime.utils.output_parsing import ParsedOutput, check_parser_names, parse_output
from slime.utils.sampling_record import applied_sampling_params, segment_record
from slime.utils.top_p_replay import SGLANG_SAMPLING_MASK_MAX_TOKENS, truncates
from slime.utils.types import Sample
from slime.utils.weight_versions import call_spans

logger = logging.getLogger(__name__)
_ENDED_SESSIONS_KEPT = 10_000  # ended session ids remembered for a clear 409 (a few hundred KB at most)


# the sampling parameters a client could send that change the distribution sampled from, with the engine's defaults
DISTRIBUTION_KEYS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
ROLLOUT_FLAGS = {"temperature": "--rollout-temperature", "top_p": "--rollout-top-p", "top_k": "--rollout-top-k"}


class AdapterError(Exception):
    """A request the adapter cannot honour; rendered in the protocol's own error shape."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


class Unreachable(AdapterError):
    """An engine that could not be connected to (or dropped the connection)."""


@dataclasses.dataclass
class Session:
    session_id: str
    tree: TrajectoryTree
    sampling_defaults: dict
    max_context_tokens: int
    inflight: int = 0
    closed: bool = False  # no new requests
    finished: bool = False  # its samples are built: no more turns (a request still running then is not recorded)
    opened_at: float = dataclasses.field(default_factory=time.monotonic)


class BaseAdapter:
    """Serve one chat protocol over the policy's engine and record each session's turns.

    tokenizer: the policy's HF tokenizer (its chat template renders every prompt).
    sglang_url: the router's (or one engine's) base URL.
    tool_parser / reasoning_parser: SGLang parser names (`qwen25`, `qwen3`, ...); None leaves the text as it is.
    chat_template_kwargs: extra arguments for `apply_chat_template` (e.g. {"enable_thinking": False}).
    generate_fields: extra `/generate` fields of every turn, e.g. `slime.utils.lora_utils.generate_fields(args)`
        (the policy's adapter under `--lora-sync adapter`).
    allow_client_sampling_params: accept a client's temperature / top-p / top-k / penalties that differ from the
        session's (logged once). By default such a request is refused with a 400 naming the parameter: the trainer
        scores at the rollout's parameters, so a turn sampled at others would train with biased importance ratios.
        Accepted, a client's temperature is replayed per token and a client's top-p / top-k / min-p turn asks for
        its kept sets (below), which the trainer replays for that turn's tokens.
    return_kept_sets: ask the engine for each step's kept token set (top-p / top-k replay) on every turn; set it to
        `slime.utils.top_p_replay.sampling_is_truncated(args)`. The router drops the field, so these turns go to one
        of its workers directly (or to sglang_url itself when it is one engine).
    sampling_mask_max_tokens: the engines' --sampling-mask-max-tokens (slime's
        --sglang-sampling-mask-max-tokens). SGLang returns kept sets only under a finite top-k up to it, so a turn
        that asks for them with top-p or min-p alone samples with it as its top-k, as the rollout flags do.
    worker_api_key: the engines' --sglang-api-key, sent with the requests that go to a worker directly.
    """

    protocol = ""

    def __init__(
        self,
        *,
        tokenizer,
        sglang_url: str,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        chat_template_kwargs: dict | None = None,
        request_timeout: float = 900.0,
        generate_fields: dict | None = None,
        allow_client_sampling_params: bool = False,
        return_kept_sets: bool = False,
        worker_api_key: str | None = None,
        sampling_mask_max_tokens: int = SGLANG_SAMPLING_MASK_MAX_TOKENS,
    ):
        check_parser_names(tool_parser, reasoning_parser)
        self.allow_client_sampling_params = allow_client_sampling_params
        if allow_client_sampling_params:
            logger.warning(
                "the %s agent adapter accepts clients' own temperature / top-p / top-k / penalties "
                "(allow_client_sampling_params): each turn records what it was sampled with, and the train-data "
                "check refuses a trained turn the trainer cannot score unless --no-check-sampling-params",
                self.protocol,
            )
        self.tokenizer = tokenizer
        self.sglang_url = sglang_url.rstrip("/")
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.request_timeout = request_timeout
        self.generate_fields = dict(generate_fields or {})
        self.return_kept_sets, self.worker_api_key = return_kept_sets, worker_api_key
        self.sampling_mask_max_tokens = sampling_mask_max_tokens
        self._workers: list[str] = []  # the router's workers, read on first use and after a failure
        self._sessions: dict[str, Session] = {}
        # the latest ended sessions (id -> how they ended), so a late request hears 409, not "open it first"
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.app = web.Application(client_max_size=64 << 20)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self._register_routes(self.app)

    # ------------------------------------------------------------------ protocol hooks
    def _register_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _session_id(self, request: web.Request, body: dict) -> str | None:
        raise NotImplementedError

    def _check_body(self, body: dict) -> None:
        """Raise AdapterError for anything the adapter cannot honour."""
        raise NotImplementedError

    def _to_chat(self, body: dict) -> tuple[list[dict], list[dict] | None, bool]:
        """(chat-template messages, tools in the template's function shape, whether to parse tool calls)."""
        raise NotImplementedError

    def _sampling_params(self, body: dict) -> dict:
        raise NotImplementedError

    def _error_response(self, err: AdapterError) -> web.Response:
        raise NotImplementedError

    async def _respond(
        self, request: web.Request, body: dict, parsed: ParsedOutput, turn: TurnRecord
    ) -> web.StreamResponse:
        raise NotImplementedError

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str, *, sampling_defaults: dict | None = None, max_context_tokens: int = 0):
        """Start recording a session. Its requests carry `session_id` as the API key (or in the body's metadata).

        sampling_defaults: engine sampling params applied under the request's own (e.g. the rollout's temperature).
        max_context_tokens: a prompt this long or longer is refused; generation is capped to what is left.
        """
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is already open; session ids must be unique")
            self._ended.pop(session_id, None)
            self._sessions[session_id] = Session(
                session_id, TrajectoryTree(session_id), dict(sampling_defaults or {}), int(max_context_tokens)
            )

    async def finish_session(
        self,
        session_id: str,
        *,
        base_sample: Sample,
        reward: Any = None,
        extra_metadata: dict | None = None,
        wait_timeout: float = 30.0,
    ) -> list[Sample]:
        """Close the session and return one loss-masked Sample per branch (siblings share a rollout_id).

        Requests still running are waited for (up to wait_timeout); later requests for the session are refused.
        """
        session = self._close(session_id)
        deadline = time.monotonic() + wait_timeout
        while session.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with self._lock:
            self._sessions.pop(session_id, None)
            self._remember_ended(session_id, "is already finished")
            session.finished = True
            if session.inflight:
                logger.warning(
                    "session %s finished with %d request(s) still running; their turns are not recorded",
                    session_id,
                    session.inflight,
                )
            return session.tree.to_samples(
                base_sample, reward=reward, extra_metadata=extra_metadata, tokenizer=self.tokenizer
            )

    def drop_session(self, session_id: str, reason: str) -> None:
        """Forget a session without producing samples (the episode failed or was abandoned); logs why."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is not None:
                self._remember_ended(session_id, f"was dropped ({reason})")
        if session is None:
            return
        session.closed = session.finished = True
        logger.warning(
            "agent session %s dropped after %d turn(s), its samples discarded: %s",
            session_id,
            session.tree.num_turns,
            reason,
        )

    def drop_stale_sessions(self, max_age_s: float) -> list[str]:
        """Drop every session opened more than max_age_s ago and never finished; returns their ids."""
        now = time.monotonic()
        with self._lock:
            stale = [sid for sid, s in self._sessions.items() if now - s.opened_at > max_age_s]
        for sid in stale:
            self.drop_session(sid, f"never finished within {max_age_s:.0f}s of opening")
        return stale

    def close(self) -> None:
        """Drop every session still open (logged): nothing outlives the adapter."""
        with self._lock:
            open_ids = list(self._sessions)
        for sid in open_ids:
            self.drop_session(sid, "the adapter closed before finish_session")

    def open_sessions(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def _remember_ended(self, session_id: str, how: str) -> None:
        self._ended[session_id] = how
        if len(self._ended) > _ENDED_SESSIONS_KEPT:
            self._ended.popitem(last=False)

    def _close(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise KeyError(f"no open session {session_id!r}")
            session.closed = True
            return session

    # ------------------------------------------------------------------ one turn
    async def _health(self, request):
        return web.json_response({"ok": True})

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "slime-policy", "object": "model"}]})

    def render(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _handle(self, request: web.Request, api=None) -> web.StreamResponse:
        """One turn. api: the object whose protocol hooks serve this route (default: the adapter's own); an
        adapter serving a second API on the same sessions (OpenAI's Responses beside Chat Completions) passes it."""
        api = self if api is None else api
        try:
            try:
                body = await request.json()
            except ValueError as e:
                raise AdapterError(400, f"the request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise AdapterError(400, "the request body must be a JSON object")
            session = self._acquire(api._session_id(request, body))
        except AdapterError as err:
            return api._error_response(err)
        try:
            api._check_body(body)
            messages, tools, parse_tools = api._to_chat(body)
            prompt_ids = self.render(messages, tools)
            client_sp = api._sampling_params(body)
            self._check_client_sampling(session, client_sp)
            sp = {**session.sampling_defaults, **client_sp}
            self._fit_context(session, prompt_ids, sp)
            turn = await self._generate(session.session_id, prompt_ids, sp)
            if turn.finish_reason == "abort":  # the rollout is stopping (or weights are updating): end the episode
                raise AdapterError(
                    503, "the engine aborted the generation (the rollout is stopping)", kind="overloaded_error"
                )
            raw = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
            parsed = parse_output(
                raw,
                tools=tools if parse_tools else None,
                tool_parser=self.tool_parser,
                reasoning_parser=self.reasoning_parser,
            )
            turn = dataclasses.replace(turn, message=assistant_message(parsed), ill_formed=parsed.ill_formed)
            response = await api._respond(request, body, parsed, turn)
            # a streamed answer has reached the client by now, which may already be in finish_session: it waits for
            # this request, so the turn counts unless the samples were built without it (the wait timed out)
            with self._lock:
                if session.finished:
                    logger.warning(
                        "session %s: a turn finished after finish_session gave up waiting; not recorded",
                        session.session_id,
                    )
                else:
                    session.tree.add_turn(turn)
            return response
        except AdapterError as err:
            return api._error_response(err)
        except (ConnectionResetError, asyncio.CancelledError):
            raise  # the client went away: nothing to answer, nothing recorded
        except Exception as e:  # a bug or a malformed engine reply must not take the rollout down
            logger.exception("session %s: the %s adapter failed a request", session.session_id, self.protocol)
            return api._error_response(AdapterError(500, f"slime's adapter failed: {e!r}", kind="api_error"))
        finally:
            with self._lock:
                session.inflight -= 1

    def _acquire(self, session_id: str | None) -> Session:
        if not session_id:
            raise AdapterError(
                401,
                "no session id: pass the session id as the API key (or metadata.session_id)",
                kind="authentication_error",
            )
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None and session_id in self._ended:
                raise AdapterError(409, f"session {session_id!r} {self._ended[session_id]}")
            if session is None:
                raise AdapterError(
                    404, f"unknown session {session_id!r}: open_session it first", kind="not_found_error"
                )
            if session.closed:
                raise AdapterError(409, f"session {session_id!r} is already finished")
            session.inflight += 1
            return session

    def _check_client_sampling(self, session: Session, client_sp: dict) -> None:
        """Refuse (400) a client's sampling parameter that changes the distribution the session samples from: the
        trainer scores every token at the rollout's parameters (--rollout-temperature, over the full vocabulary or the
        kept sets), so a client's own temperature / top-p / top-k / penalties would bias the importance ratios.
        A value equal to the session's (after SGLang's normalisation) is accepted."""
        if self.allow_client_sampling_params:
            return
        base = applied_sampling_params(session.sampling_defaults)
        for key in DISTRIBUTION_KEYS:
            if key not in client_sp:
                continue
            try:
                changed = applied_sampling_params({**session.sampling_defaults, key: client_sp[key]}) != base
            except (TypeError, ValueError):
                raise AdapterError(400, f"{key} must be a number, got {client_sp[key]!r}", param=key) from None
            if changed:
                ours = session.sampling_defaults.get(key)
                ours = DISTRIBUTION_KEYS[key] if ours is None else ours
                flag = f" ({ROLLOUT_FLAGS[key]})" if key in ROLLOUT_FLAGS else ""
                raise AdapterError(
                    400,
                    f"{key}={client_sp[key]!r} differs from this session's {key}={ours!r}{flag}: the trainer scores "
                    "every sampled token at the rollout's sampling parameters, so a client may not change them "
                    f"(leave {key} unset or send the session's value)",
                    param=key,
                )

    def _fit_context(self, session: Session, prompt_ids: list[int], sp: dict) -> None:
        limit = session.max_context_tokens
        if not limit:
            return
        if len(prompt_ids) >= limit:
            raise AdapterError(
                400,
                f"context too long: the prompt renders to {len(prompt_ids)} tokens and this session allows "
                f"{limit} (prompt + completion)",
                param="messages",
            )
        sp["max_new_tokens"] = min(sp.get("max_new_tokens", limit), limit - len(prompt_ids))

    async def _generate(self, session_id: str, prompt_ids: list[int], sp: dict) -> TurnRecord:
        applied = applied_sampling_params(sp)
        # a client's own truncation (allowed) is replayed like the flags': the turn brings its kept sets
        replayed = self.return_kept_sets or (self.allow_client_sampling_params and truncates(applied))
        if replayed and applied["top_k"] <= 0:  # SGLang returns kept sets only under a finite top-k
            sp = {**sp, "top_k": self.sampling_mask_max_tokens}
        payload = {
            "rid": uuid.uuid4().hex,
            "input_ids": prompt_ids,
            # the sampled ids are the training target, so the engine must return them untrimmed
            "sampling_params": {**sp, "skip_special_tokens": False, "no_stop_trim": True},
            "return_logprob": True,
            **self.generate_fields,
        }
        if replayed:  # top-p replay: each step's kept token set
            payload["return_sampling_mask"] = True
            data, url = await self._post_to_a_worker(session_id, payload)
        else:
            data, url = await self._post(self.sglang_url, payload, {ROUTING_KEY_HEADER: session_id})
        meta = data["meta_info"]
        pairs = meta["output_token_logprobs"]
        kept_sets = self._kept_sets(meta, len(pairs), url) if replayed else None
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=[int(p[1]) for p in pairs],
            # under replay the engine's log-probs renormalised over the kept sets, as the trainer scores them
            output_log_probs=[float(x) for x in meta["output_token_sampling_logprobs"]]
            if kept_sets is not None
            else [float(p[0]) for p in pairs],
            finish_reason=(meta.get("finish_reason") or {}).get("type") or "stop",
            weight_version=meta.get("weight_version"),
            weight_version_spans=tuple(call_spans(meta, len(pairs))),
            sampling_params=segment_record(
                meta,
                payload["sampling_params"],
                start=0,
                end=0,
                source=f"the {self.protocol} agent adapter",
                body=payload,
            ),
            kept_sets=kept_sets,
        )

    async def _post(self, base: str, payload: dict, headers: dict) -> tuple[dict, str]:
        """POST the /generate to `base`: (its JSON, base), else an AdapterError (`Unreachable` when no connection)."""
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout, trust_env=False) as http,
                http.post(f"{base}/generate", json=payload, headers=headers) as r,
            ):
                text = await r.text()
                if r.status >= 500:
                    raise AdapterError(
                        502, f"the engine at {base} failed ({r.status}): {text[:500]}", kind="api_error"
                    )
                if r.status >= 400:
                    raise AdapterError(400, f"the engine refused the request: {_engine_message(text)}")
                return await r.json(content_type=None), base
        except aiohttp.ClientConnectionError as e:  # _post_to_a_worker tries another worker
            raise Unreachable(502, f"the engine at {base} is unreachable: {e!r}", kind="api_error") from e
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise AdapterError(502, f"the engine at {base} is unreachable: {e!r}", kind="api_error") from e

    async def _post_to_a_worker(self, session_id: str, payload: dict, attempts: int = 3) -> tuple[dict, str]:
        """POST a /generate that asks for kept sets straight to one engine: sglang-router drops
        `return_sampling_mask`. A session always goes to the same worker (a stable hash of its id, so its turns keep
        their prefix cache); a worker that cannot be reached is skipped, with the list re-read (fault tolerance
        replaces engines). These requests bypass slime's recording proxy; the turns record their own parameters."""
        headers = {"Authorization": f"Bearer {self.worker_api_key}"} if self.worker_api_key else {}
        key, last = zlib.crc32(session_id.encode()), None
        for attempt in range(attempts):
            if attempt or not self._workers:
                self._workers = await self._list_workers()
            worker = self._workers[(key + attempt) % len(self._workers)]
            try:
                return await self._post(worker, payload, headers)
            except Unreachable as e:
                last = e
                logger.warning(
                    "session %s: worker %s did not serve /generate (%s); trying another", session_id, worker, e.message
                )
        raise AdapterError(
            502, f"no worker of {self.sglang_url} served session {session_id}: {last.message}", kind="api_error"
        )

    async def _list_workers(self) -> list[str]:
        """The router's workers, or [sglang_url] when it is one engine (which lists no workers: 404)."""
        try:
            urls = await asyncio.get_running_loop().run_in_executor(None, list_workers, self.sglang_url)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return [self.sglang_url]
            raise AdapterError(502, f"{self.sglang_url} did not list its workers: {e}", kind="api_error") from e
        except (urllib.error.URLError, OSError) as e:
            raise AdapterError(502, f"the router at {self.sglang_url} is unreachable: {e!r}", kind="api_error") from e
        if not urls:
            raise AdapterError(502, f"the router at {self.sglang_url} lists no worker", kind="api_error")
        return [u.rstrip("/") for u in urls]

    @staticmethod
    def _kept_sets(meta: dict, num_tokens: int, url: str) -> tuple:
        """One kept set per output token (and their renormalised log-probs), or a 502 naming the engine."""
        masks, logprobs = meta.get("output_token_sampling_mask"), meta.get("output_token_sampling_logprobs")
        if masks is None or logprobs is None or len(masks) != num_tokens or len(logprobs) != num_tokens:
            raise AdapterError(
                502,
                f"the engine at {url} returned {'no' if masks is None else len(masks)} sampling mask(s) for "
                f"{num_tokens} tokens, which top-p / top-k replay needs (its return_sampling_mask)",
                kind="api_error",
            )
        return tuple(tuple(int(t) for t in m) for m in masks)


def _engine_message(text: str) -> str:
    try:
        err = json.loads(text).get("error", text)
    except (ValueError, AttributeError):
        return text[:500]
    return (err.get("message") if isinstance(err, dict) else str(err))[:500]


def assistant_message(parsed: ParsedOutput) -> dict:
    """The reply as a chat-template message (tool-call arguments as dicts, as templates expect)."""
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.text}
    if parsed.reasoning:
        msg["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in parsed.tool_calls
        ]
    return msg


def reject_unknown_fields(body: dict, known: set[str], api: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise AdapterError(
            400,
            f"unsupported field(s) {', '.join(map(repr, unknown))} for the {api} API on slime's adapter",
            param=unknown[0],
        )


def check_openai_tool_choice(body: dict) -> None:
    """The OpenAI APIs' `tool_choice`: 'auto' (the default) or 'none'; one that forces a call needs constrained
    decoding, which the adapter does not do."""
    tc = body.get("tool_choice")
    if tc not in (None, "auto", "none"):
        raise AdapterError(
            400,
            f"tool_choice={tc!r} is not supported: the adapter does not constrain decoding; use 'auto' or 'none'",
            param="tool_choice",
        )


def function_tool(name: Any, description: Any, parameters: Any) -> dict:
    if not isinstance(name, str) or not name:
        raise AdapterError(400, "every tool needs a non-empty string name", param="tools")
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description or "",
            "parameters": parameters or {"type": "object", "properties": {}},
        },
    }
