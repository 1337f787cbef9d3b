"""What every `/generate` through the policy's router was sampled with, so that samples whose generate function records
nothing can still be checked (`slime.rollout.sampling_provenance`) and scored at their own temperature.

Users' generate functions build their own requests and may send any sampling parameter, adapter or none. Every one of
them reaches the engines through the router address slime gives them (`args.sglang_router_ip/port`), so the rollout
controller puts a thin proxy on that address (`RecordingProxy`, the real router moves behind it): it forwards every
request unchanged (streams included) and records each finished `/generate` output in a `RequestLedger` -- the
normalised sampling parameters (the engine's echo where it gives one, else the request's, as
`slime.utils.sampling_record` defines them), the adapter the request named and the engine's weight-version spans,
keyed by the output token ids. Before a rollout is converted to train data, `RequestLedger.attach` finds, for each
sample with no record of its own, the outputs its trained tokens are made of (a turn is one output, or several
consecutive ones when a partial rollout resumed it) and writes their records onto the sample, as the default generate
would have. Tokens that match no output keep today's rule (trained at the flags, one warning; refused under
`--lora-sync adapter`). Identical outputs from different prompts are told apart by the last input ids when the request
sent ids (a text request cannot be). OpenAI requests (`/v1/chat/completions`, `/v1/completions`) are recorded when
their answers carry token ids (`return_token_ids`; streamed completions too, while SGLang refuses them on a streamed
chat), with what SGLang applied (`record_openai`). `--no-check-sampling-params`
starts no proxy.
"""

import asyncio
import collections
import json
import logging
import threading

import aiohttp
import numpy as np
import xxhash
from aiohttp import web

from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.utils.sampling_record import (
    META_KEY,
    generation_config_defaults,
    openai_requested_adapter,
    openai_sampling_params,
    segment_record,
)
from slime.utils.weight_versions import append_spans, call_spans

logger = logging.getLogger(__name__)

SOURCE = "a request through slime's router"  # a ledger record's `source` (what the refusals name)
TAIL = 64  # input ids kept per output to tell identical outputs of different prompts apart
# hop-by-hop and re-computed headers; the client's encoding is not forwarded, so answers arrive uncompressed
_DROP = {
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "accept-encoding",
    "content-encoding",
}


def _ids(tokens) -> bytes:
    return np.asarray(tokens, dtype=np.int32).tobytes()


class _Entry:
    __slots__ = ("ids", "record", "spans", "tail", "taken")

    def __init__(self, ids, record, spans, tail):
        self.ids, self.record, self.spans, self.tail, self.taken = ids, record, spans, tail, False


class RequestLedger:
    """Recorded outputs, by their token ids, until a sample takes them or `max_tokens` newer ones push them out."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._by_ids = {}  # xxh3 of the output's int32 ids -> [_Entry] (identical outputs: oldest first)
        self._lengths = {}  # first token -> Counter(output length): where an output starting there may end
        self._fifo = collections.deque()  # arrival order, for eviction (taken entries are dropped lazily)
        self._tokens, self._live = 0, 0

    def __len__(self):
        return self._live

    # ---------------------------------------------------------------- recording (the proxy's thread)
    def add(self, output_ids, record: dict, spans: list, input_ids=None) -> None:
        ids = _ids(output_ids)
        tail = _ids(input_ids[-TAIL:]) if input_ids is not None else None
        entry = _Entry(ids, record, spans, tail)
        with self._lock:
            self._by_ids.setdefault(xxhash.xxh3_64_intdigest(ids), []).append(entry)
            self._lengths.setdefault(int(output_ids[0]), collections.Counter())[len(output_ids)] += 1
            self._fifo.append(entry)
            self._tokens, self._live = self._tokens + len(output_ids), self._live + 1
            while self._tokens > self.max_tokens and self._fifo:
                old = self._fifo.popleft()
                if not old.taken:
                    self._remove(old)
            if len(self._fifo) > 2 * self._live + 1024:  # taken entries behind an old one nobody took
                self._fifo = collections.deque(e for e in self._fifo if not e.taken)

    def _remove(self, entry):
        key = xxhash.xxh3_64_intdigest(entry.ids)
        bucket = self._by_ids[key]
        bucket.remove(entry)
        if not bucket:
            del self._by_ids[key]
        n, first = len(entry.ids) // 4, int(np.frombuffer(entry.ids[:4], np.int32)[0])
        lengths = self._lengths[first]
        lengths[n] -= 1
        if not lengths[n]:
            del lengths[n]
        if not lengths:
            del self._lengths[first]
        self._tokens, self._live = self._tokens - n, self._live - 1
        entry.taken = True

    def _take(self, ids: bytes, tail: bytes):
        """The oldest recorded output with exactly these ids (one from the same prompt first), removed; or None."""
        bucket = [e for e in self._by_ids.get(xxhash.xxh3_64_intdigest(ids), ()) if e.ids == ids]
        if not bucket:
            return None
        entry = next((e for e in bucket if e.tail is not None and e.tail == tail[-len(e.tail) :]), bucket[0])
        self._remove(entry)
        return entry

    # ---------------------------------------------------------------- matching (the controller, before conversion)
    def _split(self, tokens: np.ndarray, start: int, end: int):
        """The recorded outputs tokens[start:end] is made of, in order, as (start, end, entry); stops at the first
        position no recorded output starts at (the rest of the run stays unrecorded)."""
        found, i = [], start
        while i < end:
            starting = self._lengths.get(int(tokens[i]), ())
            lengths = sorted((n for n in starting if n <= end - i), reverse=True)  # the longest output first
            tail = tokens[max(0, i - TAIL) : i].tobytes()
            entry = next((e for n in lengths if (e := self._take(tokens[i : i + n].tobytes(), tail))), None)
            if entry is None:
                break
            n = len(entry.ids) // 4
            found.append((i, i + n, entry))
            i += n
        return found

    def attach(self, samples) -> int:
        """Write the records of the outputs each unrecorded sample's trained tokens came from onto it
        (`metadata["sampling_params"]`, and its weight-version spans where it has none). Returns how many samples
        got a record."""
        attached = 0
        with self._lock:
            for s in samples:
                if not s.response_length or (isinstance(s.metadata, dict) and s.metadata.get(META_KEY)):
                    continue
                tokens = np.asarray(s.tokens, dtype=np.int32)
                prompt = len(tokens) - s.response_length
                mask = np.ones(s.response_length, bool) if s.loss_mask is None else np.asarray(s.loss_mask) != 0
                found = []
                for a, b in _runs(mask):
                    found += self._split(tokens, prompt + a, prompt + b)
                if not found:
                    continue
                if s.metadata is None:
                    s.metadata = {}
                s.metadata[META_KEY] = [{**e.record, "response_span": [a - prompt, b - prompt]} for a, b, e in found]
                if not s.weight_version_spans:
                    spans = []
                    for a, _, e in found:
                        append_spans(spans, e.spans, a - prompt)
                    s.weight_version_spans = spans
                attached += 1
        return attached


def _runs(mask):
    """[start, end) of each maximal run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


# ---------------------------------------------------------------- what one /generate produced
def _per_prompt(value, i):
    return value[i] if isinstance(value, list) else value


def record_generate(ledger: RequestLedger, body: dict, outputs: list) -> int:
    """Add every finished output of one `/generate` (`body`: the request; `outputs`: SGLang's answer as a list, a
    stream's last event per output) to the ledger. Returns how many were recorded."""
    ids = body.get("input_ids")
    prompts = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]
    if not isinstance(ids, list) and isinstance(body.get("text"), list):
        prompts = [None] * len(body["text"])
    sps = body.get("sampling_params")
    # SGLang answers n outputs per prompt, prompt after prompt (a stream's events carry `index` in that order)
    owner = [i for i in range(len(prompts)) for _ in range(int((_per_prompt(sps, i) or {}).get("n") or 1))]
    recorded = 0
    for k, out in enumerate(outputs):
        k = out.get("index", k)
        meta = out.get("meta_info") or {}
        output_ids = out.get("output_ids")
        if output_ids is None and meta.get("output_token_logprobs") is not None:
            output_ids = [t[1] for t in meta["output_token_logprobs"]]
        if not output_ids or not meta.get("finish_reason") or k >= len(owner):
            continue
        i = owner[k]
        request = {"lora_path": _per_prompt(body.get("lora_path"), i)}
        request["custom_logit_processor"] = _per_prompt(body.get("custom_logit_processor"), i)
        record = segment_record(meta, _per_prompt(sps, i), start=0, end=len(output_ids), source=SOURCE, body=request)
        record["origin"] = f"{record['origin']}, recorded at the router"
        ledger.add(output_ids, record, call_spans(meta, len(output_ids)), prompts[i])
        recorded += 1
    return recorded


OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")


class _StreamAnswer:
    """What a stream's events add up to, folded as they pass: /generate's last event per output (SGLang's events are
    cumulative); a streamed completion's choices, each with its token ids joined, its prompt's ids and its finish
    reason."""

    def __init__(self, path):
        self.generate, self.outputs = path == "/generate", {}

    def add(self, event):
        if self.generate:
            self.outputs[event.get("index", 0)] = event
            return
        for c in event.get("choices") or []:
            choice = self.outputs.setdefault(c["index"], {"token_ids": [], "prompt_token_ids": None})
            choice["token_ids"] += c.get("token_ids") or []
            choice["prompt_token_ids"] = choice["prompt_token_ids"] or c.get("prompt_token_ids")
            choice["finish_reason"] = c.get("finish_reason")

    def answer(self):
        outputs = [self.outputs[k] for k in sorted(self.outputs)]
        return outputs if self.generate else {"choices": outputs}


def record_openai(ledger: RequestLedger, path: str, body: dict, answer: dict, chat_defaults: dict) -> int:
    """Add every finished choice of one OpenAI request whose answer carries its token ids (SGLang's
    `return_token_ids`: `response_token_ids` for chat, `token_ids` for completions) to the ledger, sampled with what
    SGLang applies: the request's parameters, then (chat only) `chat_defaults`, the model's generation_config.json,
    then OpenAI's. A choice without its ids cannot be matched to a sample and is not recorded."""
    chat = path == "/v1/chat/completions"
    sp = openai_sampling_params(body, chat_defaults if chat else {})
    recorded = 0
    for choice in answer.get("choices") or []:
        output_ids = choice.get("response_token_ids" if chat else "token_ids")
        if not output_ids or not choice.get("finish_reason"):
            continue
        request = {"lora_path": openai_requested_adapter(body)}
        record = segment_record(None, sp, start=0, end=len(output_ids), source=SOURCE, body=request)
        record["origin"] = f"{path} request with SGLang's defaults, recorded at the router"
        ledger.add(output_ids, record, [], choice.get("prompt_token_ids"))
        recorded += 1
    return recorded


class RecordingProxy:
    """An aiohttp server, in a thread of its own, that forwards everything to `upstream` (the router) and records
    each `/generate` (and each OpenAI request whose answer carries token ids) into `ledger`. `chat_defaults`: what
    the engines give a chat request that leaves a sampling parameter out (`chat_sampling_defaults`)."""

    def __init__(self, upstream: str, ledger: RequestLedger, timeout: float, chat_defaults=None):
        self.upstream, self.ledger, self.timeout = upstream.rstrip("/"), ledger, timeout
        self.chat_defaults = dict(chat_defaults or {})
        self.session = None
        self._warned = False

    def start(self, host: str, port: int = 0):
        app = web.Application(client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        # a client that leaves cancels the forwarded request, which the router and the engine take as an abort
        self.handle = run_app_in_thread(
            app, host=host, port=port, name="slime-recording-proxy", cancel_on_disconnect=True
        )
        logger.info("recording proxy on %s in front of sglang-router %s", self.handle.url, self.upstream)
        return self

    @property
    def url(self) -> str:
        return self.handle.url

    def stop(self):
        self.handle.stop()

    async def _open(self, _app):
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), trust_env=False, auto_decompress=False
        )

    async def _close(self, _app):
        await self.session.close()

    async def forward(self, request: web.Request):
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        url = f"{self.upstream}{request.rel_url}"
        generate = request.method == "POST" and request.path == "/generate"
        openai = request.method == "POST" and request.path in OPENAI_PATHS
        try:
            async with self.session.request(
                request.method, url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout)
            ) as up:
                out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _DROP}
                if up.content_type == "text/event-stream":
                    # a streamed chat carries no token ids (SGLang refuses return_token_ids there)
                    recordable = generate or (openai and request.path == "/v1/completions")
                    return await self._stream(request, up, out_headers, body if recordable else None, request.path)
                data = await up.read()
                if generate and up.status == 200:
                    self._record(body, lambda: json.loads(data))
                elif openai and up.status == 200:
                    self._record(body, lambda: json.loads(data), path=request.path)
                return web.Response(body=data, status=up.status, headers=out_headers)
        except asyncio.TimeoutError:
            return web.json_response(
                {"error": f"slime's recording proxy: {url} did not answer within {self.timeout:.0f}s"}, status=504
            )
        except aiohttp.ClientError as e:
            return web.json_response({"error": f"slime's recording proxy: {url}: {type(e).__name__}: {e}"}, status=502)

    async def _stream(self, request, up, headers, body, path):
        """Forward a stream as it comes; record its outputs (`body`: the request, None for a stream nothing can be
        recorded from) once it ends."""
        resp = web.StreamResponse(status=up.status, headers=headers)
        await resp.prepare(request)
        answer, buffer = _StreamAnswer(path), b""
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
            if body is None:
                continue
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
                    try:
                        answer.add(json.loads(line[5:]))
                    except ValueError:
                        pass
        if body is not None and up.status == 200:
            self._record(body, answer.answer, path=path)
        await resp.write_eof()
        return resp

    def _record(self, body: bytes, outputs, path="/generate"):
        """Recording never fails a request: what cannot be parsed stays unrecorded (logged once)."""
        try:
            answer = outputs()
            if path == "/generate":
                record_generate(self.ledger, json.loads(body), answer if isinstance(answer, list) else [answer])
            else:
                record_openai(self.ledger, path, json.loads(body), answer, self.chat_defaults)
        except Exception as e:  # noqa: BLE001
            if not self._warned:
                self._warned = True
                logger.warning("recording proxy: could not record a %s (%s: %s)", path, type(e).__name__, e)


def chat_sampling_defaults(args) -> dict:
    """What the policy's engines give a chat request that leaves a sampling parameter out: `--hf-checkpoint`'s
    generation_config.json under SGLang's `--sampling-defaults model` (its default, `--sglang-sampling-defaults`)."""
    if (getattr(args, "sglang_sampling_defaults", None) or "model") != "model":
        return {}
    return generation_config_defaults(args.hf_checkpoint)


def start_recording_proxy(args):
    """Put a recording proxy on a new port in front of the policy's router and point this process's
    `args.sglang_router_ip/port` (what every rollout and generate function reads) at it. Returns (proxy, ledger), or
    (None, None) when there is nothing to record: no router, or `--no-check-sampling-params`."""
    if args.debug_train_only or not args.sglang_router_ip or args.no_check_sampling_params:
        return None, None
    samples = max(args.rollout_batch_size, args.over_sampling_batch_size or 0) * args.n_samples_per_prompt
    # room for a few rollouts of full-length answers (they are taken as samples are converted)
    ledger = RequestLedger(max_tokens=max(1 << 22, 4 * samples * (args.rollout_max_response_len or 1024)))
    router = (args.sglang_router_ip, args.sglang_router_port)
    timeout = float(args.sglang_router_request_timeout_secs) + 60
    proxy = RecordingProxy(f"http://{router[0]}:{router[1]}", ledger, timeout, chat_sampling_defaults(args))
    proxy.start(router[0])
    args.sglang_router_port = proxy.handle.port
    args.sglang_router_behind_proxy = (
        router  # the real router's (ip, port), for code that must reach it, not the proxy
    )
    routers = args.sglang_model_routers or {}
    args.sglang_model_routers = {
        k: (proxy.handle.host, proxy.handle.port) if tuple(v) == router else v for k, v in routers.items()
    }
    return proxy, ledger
