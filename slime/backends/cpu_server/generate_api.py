"""Request handling of slime's CPU server: `/generate` (plain and streamed) and `/abort_request`, as SGLang's
http_server / tokenizer manager answer them."""

import asyncio
import base64
import json
import time

from aiohttp import web

from slime.utils.top_p_replay import SGLANG_SAMPLING_MASK_MAX_TOKENS

from .media import (
    collapse_placeholders,
    expand,
    expand_with_videos,
    fetch_remote_media,
    has_remote_media,
    images_per_prompt,
    videos_per_prompt,
)
from .sampling import RequestError, SamplingParams, error_response
from .scheduler import Req
from .weights import WeightError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EndOfStream(Exception):
    """Raised by a stream's `events` with the events that end it early; its other requests are aborted."""

    def __init__(self, events):
        super().__init__("end of stream")
        self.events = events


def _check_sampling_mask(want_mask, mode, sp, cap=SGLANG_SAMPLING_MASK_MAX_TOKENS):
    """SGLang's checks of return_sampling_mask / sampling_logprobs_mode (tokenizer manager and scheduler); `cap` is
    the server's --sampling-mask-max-tokens."""
    if mode is not None and not want_mask:
        raise RequestError("sampling_logprobs_mode can only be set when return_sampling_mask=true.")
    if mode not in (None, "selected", "support"):
        raise RequestError(f"sampling_logprobs_mode must be 'selected' or 'support', got {mode!r}")
    if want_mask and sp.top_k != 1 and not 1 < sp.top_k <= cap:
        raise RequestError(
            f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= "
            f"{cap}; got top_k={sp.top_k}. Lower top_k or increase --sampling-mask-max-tokens."
        )


def prompt_rid(rids, i, batch):
    """Prompt i's request id from a request's `rid` (SGLang's normalisation): its entry of a list, or a string
    naming a batch's prompts R_0, R_1, ..."""
    return rids[i] if isinstance(rids, list) else (f"{rids}_{i}" if batch and rids is not None else rids)


def _parallel_sample_nums(sps_raw) -> list:
    """Each prompt's `n` (SGLang's parallel_sample_num), from one sampling_params dict or a list of them."""
    return [(d or {}).get("n", 1) for d in sps_raw] if isinstance(sps_raw, list) else [(sps_raw or {}).get("n", 1)]


def _check_batch_fields(body, num_prompts, batch, sps_raw):
    """SGLang's GenerateReqInput normalisation checks of the per-prompt fields (io_struct.py), answered as its 400s."""
    ns = _parallel_sample_nums(sps_raw)
    if len(set(map(str, ns))) > 1:
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
    rids = body.get("rid")
    if rids is not None and not isinstance(rids, (str, list)):
        raise RequestError("The rid should be a string or a list of strings.")
    if isinstance(rids, list):
        if len(rids) != num_prompts:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
        duplicates = sorted({r for r in rids if rids.count(r) > 1}, key=str)
        if duplicates:
            raise RequestError(f"Duplicate request IDs detected within the request: {duplicates}")
    for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask"):
        value = body.get(name)
        if isinstance(value, list):
            if ns[0] != 1:
                raise RequestError(f"Cannot use list {name} with parallel_sample_num > 1")
            if len(value) != num_prompts:
                raise RequestError(f"{name} is a list of {len(value)}: it needs one entry per prompt ({num_prompts})")


# SGLang request fields that change its answer and this server does not implement: refused when set, not ignored
_NOT_SERVED = (
    "return_entropy",
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
    "return_indexer_topk",
    "require_reasoning",
    "max_thinking_tokens",
    "positional_embed_overrides",
    "multi_item_delimiter_indices",
    "token_indices_to_pool",
)


def _token_ids_logprob(value, num_prompts, sps_raw, vocab_size) -> list:
    """SGLang's normalisation of token_ids_logprob to one list (or None) per prompt: one id, one list for every
    prompt, or a list per prompt; ids outside the vocabulary are refused by name (SGLang would index past it)."""
    if not value:
        return [None] * num_prompts
    if not isinstance(value, list):
        value = [value]
    if not isinstance(value[0], list):
        per_prompt = [value] * num_prompts
    else:
        if _parallel_sample_nums(sps_raw)[0] != 1:
            raise RequestError("Cannot use list token_ids_logprob with parallel_sample_num > 1")
        if len(value) != num_prompts:
            raise RequestError(
                f"token_ids_logprob is a list of {len(value)} lists: it needs one per prompt ({num_prompts})"
            )
        per_prompt = [ids or None for ids in value]
    for ids in per_prompt:
        if ids is not None and not isinstance(ids, list):
            raise RequestError(f"token_ids_logprob: {ids!r} is not a list of token ids")
        for t in ids or []:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
                raise RequestError(f"token_ids_logprob: {t!r} is not a token id of this model (0..{vocab_size - 1})")
    return per_prompt


class GenerateAPI:
    """`/generate` and `/abort_request`: prompts checked, requests built and run on the scheduler, SGLang's output shape."""

    def _prompts(self, body):
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise RequestError("Either text or input_ids should be provided (exactly one of them).")
        if ids is not None:

            def is_ids(x):
                return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

            if is_ids(ids):
                return [ids], False
            if isinstance(ids, list) and ids and all(is_ids(x) for x in ids):
                return ids, True
            raise RequestError(
                f"input_ids must be a list of token ids or a non-empty list of such lists, got {str(ids)[:100]}"
            )
        if self.processor is not None:  # SGLang's Qwen-VL processor: a placeholder run is one image
            text = collapse_placeholders(text) if isinstance(text, str) else text
            if isinstance(text, list):
                text = [collapse_placeholders(t) if isinstance(t, str) else t for t in text]
        if isinstance(text, str):
            return [self.tokenizer.encode(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [self.tokenizer.encode(t) for t in text], True
        raise RequestError(f"text must be a string or a non-empty list of strings, got {str(text)[:100]}")

    def _check_prompt(self, ids, sp):
        n, V = len(ids), self.cfg.vocab_size
        if n == 0:
            raise RequestError("The input is empty: input_ids / text must contain at least one token.")
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestError(f"input_ids contain token id {bad[0]} outside the vocabulary [0, {V}).")
        if n >= self.context_len:
            raise RequestError(
                f"The input ({n} tokens) is longer than the model's context length ({self.context_len} tokens)."
            )
        if sp.max_new_tokens_explicit and n + sp.max_new_tokens > self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {n + sp.max_new_tokens} tokens: {n} tokens from the input messages and "
                f"{sp.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit."
            )
        # then SGLang's scheduler caps every budget to what its request length limit (context - 1) leaves
        budget = self.context_len - n - 2
        if not sp.max_new_tokens_explicit:
            budget = min(budget, self.max_total_tokens - n)
        sp.max_new_tokens = max(0, min(sp.max_new_tokens, budget))
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        if n + max(sp.max_new_tokens, 1) > self.max_total_tokens:
            raise RequestError(
                f"The request needs {n + sp.max_new_tokens} KV-cache tokens but the server holds only "
                f"{self.max_total_tokens} (--max-total-tokens)."
            )

    def _build_reqs(self, body):
        prompts, batch = self._prompts(body)
        sps_raw = body.get("sampling_params")
        if isinstance(sps_raw, list) and (not batch or len(sps_raw) != len(prompts)):
            raise RequestError("sampling_params is a list: it needs a batch input with one entry per prompt.")
        rids, lps = body.get("rid"), body.get("return_logprob", False)
        start, topn = body.get("logprob_start_len"), body.get("top_logprobs_num") or 0
        _check_batch_fields(body, len(prompts), batch, sps_raw)
        token_ids = _token_ids_logprob(body.get("token_ids_logprob"), len(prompts), sps_raw, self.cfg.vocab_size)
        for t in topn if isinstance(topn, list) else [topn]:  # one for all prompts, or one per prompt
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise RequestError(f"top_logprobs_num must be a non-negative integer, got {t!r}")
        if body.get("session_id") is not None and body.get("session_params") is not None:
            raise RequestError("session_id and session_params cannot both be set.")
        if body.get("return_hidden_states"):  # SGLang's answer when its server was not started to return them
            raise RequestError(
                "The server is not configured to return hidden states. Please set `--return-hidden-states-mode last`, "
                "`--return-hidden-states-mode full`, or the legacy `--enable-return-hidden-states` flag."
            )
        if body.get("custom_logit_processor") or body.get("input_embeds") is not None:
            raise RequestError("custom_logit_processor and input_embeds are not supported by slime's CPU server.")
        unserved = [k for k in _NOT_SERVED if body.get(k) not in (None, False)]
        if unserved:
            raise RequestError(f"{', '.join(unserved)}: not supported by slime's CPU server")
        if self.processor is None and (body.get("image_data") or body.get("video_data") or body.get("audio_data")):
            raise RequestError(
                f"image_data / video_data / audio_data: the served model ({self.cfg.architecture}) takes text only"
            )
        images = videos = None
        if self.processor is not None:
            images = images_per_prompt(body, len(prompts), batch, self.cfg.model_type)
            videos = videos_per_prompt(body, len(prompts), batch)
        masks_raw, mode_raw = body.get("return_sampling_mask"), body.get("sampling_logprobs_mode")
        want_routed, routed_start = bool(body.get("return_routed_experts")), body.get("routed_experts_start_len") or 0
        loras_raw, lora_names = body.get("lora_path"), []
        if isinstance(loras_raw, list) and len(loras_raw) != len(prompts):
            raise RequestError(
                f"lora_path is a list of {len(loras_raw)}: it needs one entry per prompt ({len(prompts)})"
            )
        reqs = []
        for i, ids in enumerate(prompts):
            sp_d = sps_raw[i] if isinstance(sps_raw, list) else sps_raw
            sp = SamplingParams.from_dict(sp_d, self.cfg.vocab_size)
            mm = None
            where = f"prompt {i}" if batch else "the prompt"
            if videos is not None and videos[i]:
                ids, mm = expand_with_videos(self.processor, ids, images[i], videos[i], where)
            elif images is not None and images[i]:
                ids, mm = expand(self.processor, ids, images[i], where)
            self._check_prompt(ids, sp)
            want_mask = bool(masks_raw[i] if isinstance(masks_raw, list) else masks_raw)
            mode = mode_raw[i] if isinstance(mode_raw, list) else mode_raw
            _check_sampling_mask(want_mask, mode, sp, self.args.sampling_mask_max_tokens)
            if want_routed:  # SGLang's scheduler checks, answered as its 400 abort
                if routed_start < 0:
                    raise RequestError(
                        f"recv_req.routed_experts_start_len={routed_start} is lower than 0. "
                        "Please use a non-negative routed_experts_start_len."
                    )
                if routed_start > len(ids):
                    raise RequestError(
                        f"recv_req.routed_experts_start_len={routed_start} is higher than the number of input tokens "
                        f"len(req.origin_input_ids)={len(ids)}. Please use a smaller routed_experts_start_len."
                    )
            lp = lps[i] if isinstance(lps, list) else lps
            st = start[i] if isinstance(start, list) else start
            # SGLang's request ids: a string names a batch's prompts R_0, R_1, ...; parallel samples get fresh ones
            rid = prompt_rid(rids, i, batch)
            if not isinstance(lp, bool) or (st is not None and not isinstance(st, int)):
                raise RequestError("return_logprob must be a boolean and logprob_start_len an integer.")
            if lp and st is not None and st > len(ids):  # SGLang's scheduler check, answered as its 400 abort
                raise RequestError(
                    f"req.logprob_start_len={st} is higher than the number of input tokens "
                    f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len."
                )
            for k in range(sp.n):
                r = Req(
                    ids,
                    sp,
                    rid=None if sp.n > 1 else rid,
                    return_logprob=lp,
                    logprob_start_len=-1 if st is None else st,
                    top_logprobs_num=topn[i] if isinstance(topn, list) else topn,
                    token_ids_logprob=token_ids[i],
                    return_sampling_mask=want_mask,
                    return_routed_experts=want_routed,
                    routed_experts_start_len=routed_start,
                )
                r.index, r.text_in_logprobs = len(reqs), bool(body.get("return_text_in_logprobs"))
                r.return_prompt_token_ids = bool(body.get("return_prompt_token_ids"))
                r.mm = mm
                r.support_logprobs = mode == "support"
                reqs.append(r)
                lora_names.append(loras_raw[i] if isinstance(loras_raw, list) else loras_raw)
        for r, adapter in zip(reqs, self._acquire_loras(lora_names)):
            r.lora = adapter
        return reqs, batch

    def _acquire_loras(self, names):
        """SGLang's checks of `lora_path`; the adapters are held by the requests until they finish."""
        if not any(names):
            return [None] * len(names)
        if self.loras is None:
            raise RequestError(
                f"LoRA adapter '{next(n for n in names if n)}' was requested, but LoRA is not enabled. Please launch "
                "the server with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                "endpoint."
            )
        try:
            return self.loras.acquire([n or None for n in names])
        except (KeyError, WeightError) as e:  # not loaded, or evicted and no room to load it again
            raise RequestError(e.args[0]) from None

    def _check_ready(self):
        if self.released_tags:
            raise web.HTTPServiceUnavailable(
                text=json.dumps(
                    {
                        "error": f"the server's memory is released ({', '.join(sorted(self.released_tags))}; "
                        "release_memory_occupation): call /resume_memory_occupation with these tags "
                        "before generating"
                    }
                ),
                content_type="application/json",
            )

    async def _run(self, reqs, timeout=None):
        loop = asyncio.get_running_loop()
        all_done = loop.create_future()
        pending = {id(r) for r in reqs}

        def done(req):  # on the scheduler thread: the event loop is woken once, by the last request to finish
            if req.finished and id(req) in pending:
                pending.discard(id(req))
                if not pending:
                    loop.call_soon_threadsafe(lambda: all_done.done() or all_done.set_result(reqs))

        for r in reqs:
            r.on_update = done
        self.scheduler.submit(*reqs)
        try:
            return await asyncio.wait_for(all_done, timeout)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            for r in reqs:
                self.scheduler.abort(rid=r.rid)
            raise

    def _versions(self, r) -> dict:
        """`weight_version`, and (SGLang 0.5.23) the per-token version spans of a finished request."""
        if r.finished and r.weight_versions:
            return {
                "weight_version": r.weight_versions[-1]["version"],
                "weight_versions": [dict(s) for s in r.weight_versions],
            }
        return {"weight_version": r.weight_version or self.state.weight_version}

    def _output(self, r, text=None):
        meta = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "reasoning_tokens": 0,  # SGLang counts thinking tokens of thinking-mode chats only
            "completion_tokens": len(r.output_ids),
            "cached_tokens": r.cached_tokens,  # prompt tokens served from another request's prefill
            "num_retractions": r.num_retractions,
            "e2e_latency": time.time() - r.created,
            # slime's addition (SGLang echoes no sampling parameter): what this request was sampled with
            "sampling_params": r.sp.applied(),
        }
        meta.update(self._versions(r))
        if r.return_logprob:

            def text_of(t):  # SGLang's return_text_in_logprobs: the token's text in the third slot
                return self.tokenizer.decode([t]) if r.text_in_logprobs else None

            meta["output_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(r.output_logprobs, r.output_ids)]
            meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
            meta["input_token_logprobs"] = [[lp, t, text_of(t)] for lp, t, _ in (r.input_logprobs or [])]

            def rows(entries):  # per position [[log-prob, id, text], ...], or None where SGLang has none
                return [row and [[v, t, text_of(t)] for v, t, _ in row] for row in entries or []]

            if r.top_logprobs_num:
                meta["input_top_logprobs"] = rows(r.input_top_logprobs)
                meta["output_top_logprobs"] = rows(r.output_top_logprobs)
            if r.token_ids_logprob:
                meta["input_token_ids_logprobs"] = rows(r.input_token_ids_logprobs)
                meta["output_token_ids_logprobs"] = rows(r.output_token_ids_logprobs)
        if r.return_sampling_mask:  # SGLang: per output token its sampling support and behaviour log-prob(s)
            meta["output_token_sampling_mask"] = [list(m) for m in r.output_sampling_masks]
            meta["output_token_sampling_logprobs"] = [
                list(lps) if r.support_logprobs else lps[m.index(t)]
                for m, lps, t in zip(r.output_sampling_masks, r.output_sampling_logprobs, r.output_ids)
            ]
            meta["output_token_sampling_mask_length"] = len(r.output_sampling_masks)
        if r.routed_experts is not None:  # SGLang: base64 of the int32 [tokens, layers, top_k] array, row-major
            meta["routed_experts"] = base64.b64encode(r.routed_experts.numpy().tobytes()).decode("utf-8")
        out = {"text": r.text if text is None else text, "output_ids": list(r.output_ids), "meta_info": meta}
        if r.return_prompt_token_ids:  # the prompt as the model saw it (images expanded)
            out["prompt_token_ids"] = list(r.input_ids)
        return out

    async def generate(self, request):
        body = await self._body(request)
        self._check_ready()
        if self.processor is not None and has_remote_media(body):
            body = await asyncio.to_thread(fetch_remote_media, body)
        if body.get("stream"):
            return await self._generate_stream(request, body)
        reqs, batch = self._build_reqs(body)
        t0 = time.time()
        done = await self._run(reqs)
        self.last_gen_throughput = sum(len(r.output_ids) for r in done) / max(time.time() - t0, 1e-6)
        for r in done:
            code = r.finish_reason.get("status_code")
            if code:  # SGLang: a 400 abort is its ValueError's body, another code its HTTPException's
                message = r.finish_reason["message"]
                body = {"error": {"message": message}} if code == 400 else error_response(message, str(code), code)
                return web.json_response(body, status=code)
        outs = [self._output(r) for r in done]
        return web.json_response(outs if batch or len(outs) > 1 else outs[0])

    async def _generate_stream(self, request, body):
        try:
            reqs, batch = self._build_reqs(body)
        except RequestError as e:  # SGLang checks a streamed request inside its stream: 200, one error event, [DONE]
            error = {"message": str(e), "type": "invalid_request_error", "code": 400, "retryable": False}
            resp = web.StreamResponse(headers=SSE_HEADERS)
            await resp.prepare(request)
            await resp.write(f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp

        def events(r, text, ids, finished):  # each update: the request's whole output so far
            out = self._output(r, text)
            out["output_ids"] = ids
            if not finished:
                out["meta_info"]["finish_reason"] = None
                out["meta_info"]["completion_tokens"] = len(ids)
            if batch or len(reqs) > 1:
                out["index"] = r.index
            return [f"data: {json.dumps(out)}\n\n"]

        return await self._stream(request, reqs, events)

    async def _stream(self, request, reqs, events, tail=lambda: []):
        """Run `reqs`, answering as a server-sent event stream: `events(req, text, output ids, finished)` -> the
        events of one update (or EndOfStream), then `tail()`'s and `data: [DONE]`. A client that leaves aborts the
        requests."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        shown = {}

        def on_update(req):  # scheduler thread: snapshot the text there (its tokenizer), hand it to the loop
            text = req.text
            if not req.finished:  # as SGLang's detokenizer: a character still missing bytes is not shown yet
                text = self.scheduler.detokenize(req)
                if text.endswith("\ufffd"):
                    text = shown.get(id(req), "")
                shown[id(req)] = text
            loop.call_soon_threadsafe(updates.put_nowait, (req, text, list(req.output_ids), req.finished))

        resp = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await resp.prepare(request)
        except BaseException:  # the client left before anything ran: give back the adapters the requests hold
            for r in reqs:
                if r.lora is not None:
                    self.loras.release(r.lora)
            raise
        for r in reqs:
            r.stream, r.on_update = True, on_update
        self.scheduler.submit(*reqs)
        remaining = len(reqs)
        try:
            while remaining:
                update = await updates.get()
                remaining -= update[3]
                try:
                    out, ended = events(*update), False
                except EndOfStream as end:
                    out, ended = end.events, True
                for event in out:
                    await resp.write(event.encode())
                if ended:
                    break
            else:
                for event in tail():
                    await resp.write(event.encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            remaining = True
            raise
        finally:
            if remaining:
                for r in reqs:
                    self.scheduler.abort(rid=r.rid)
        await resp.write_eof()
        return resp

    async def abort_request(self, request):
        body = await self._body(request)
        if body.get("abort_all"):
            self.scheduler.abort(abort_all=True)
        elif body.get("rid"):
            self.scheduler.abort(rid=body["rid"])
        return web.Response(text="")
