"""slime's CPU inference server: SGLang's HTTP API (the subset slime and its users call) on an aiohttp app.

Routes, request fields, response shapes, auth levels and memory tags follow SGLang's own definitions
(`slime/backends/sglang_utils/sglang_contract.json`, generated from its source), so the same rollout code, the same
sglang-router and the same weight-sync code talk to either server. Bodies are checked strictly against SGLang's
request classes (an unknown or misspelt field is a 400, where SGLang would silently ignore it).
"""

import asyncio
import hashlib
import hmac
import json
import logging
import os
import signal
import threading
import time
import uuid

import torch
import torch.distributed as dist
from aiohttp import web

from slime.backends.sglang_utils.contract import body_errors, load_contract, route
from slime.utils.distributed_utils import init_process_group, seconds
from slime.utils.tensor_serialization import FlattenedTensorBucket, MultiprocessingSerializer, set_shared_authkey

from .hf_fallback import TokenPool, load_fallback
from .model import KVPool, ModelConfig, Transformer, UnsupportedModelError
from .sampling import RequestError, SamplingParams
from .scheduler import Req, Scheduler
from .weight_checker import WeightChecker, WeightCheckError
from .weights import WeightError, WeightStore, parse_dtype, resolve_dtype

logger = logging.getLogger("slime.cpu_server")
VERSION = "slime-cpu-server-0.1"


class ServerState:
    def __init__(self, weight_version: str, num_threads: int):
        self.weight_version, self.num_threads = weight_version, num_threads

    def bump_version(self, given=None):
        # every update changes the version: the given string, else the next integer
        cur = self.weight_version
        self.weight_version = str(given) if given is not None else (str(int(cur) + 1) if cur.isdigit() else "1")


class CPUInferenceServer:
    def __init__(self, args):
        self.args = args
        self.model_path = os.path.abspath(args.model_path)
        from transformers import AutoTokenizer  # heavy

        self._load_model(args)
        tok_path = args.tokenizer_path or self.model_path
        # two tokenizer instances: HF fast tokenizers are not safe to share between the HTTP and scheduler threads
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=args.trust_remote_code)
        sched_tok = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=args.trust_remote_code)
        self.eos_ids = self._eos_ids()
        self.state = ServerState(args.weight_version, args.num_threads)
        self.scheduler = Scheduler(
            self.model,
            self.weights,
            self.pool,
            sched_tok,
            max_running=args.max_running_requests,
            context_len=self.context_len,
            eos_ids=self.eos_ids,
            max_prefill_tokens=args.max_prefill_tokens,
            random_seed=args.random_seed,
            state=self.state,
        )
        self.served_model_name = args.served_model_name or self.model_path
        self.groups: dict = {}
        self.received = ReceivedBuffers()
        self.released_tags: set = set()  # SGLang memory tags released and not resumed yet
        self.weight_session_open = False  # between /begin_weight_update and /end_weight_update
        self.weight_checker = WeightChecker(lambda: self.weights.state())
        self.started = time.time()
        self.last_gen_throughput = 0.0

    def _load_model(self, args):
        """The compact batched model for the Llama family; transformers (no KV cache) for anything else."""
        try:
            self.cfg = ModelConfig.from_model_dir(self.model_path)
            self.fallback = False
        except UnsupportedModelError as e:
            if not os.path.isfile(os.path.join(self.model_path, "config.json")):
                raise
            logger.warning(
                "%s Serving it with the transformers fallback instead (no KV cache: slow for long outputs).", e
            )
            self.fallback = True
        if self.fallback:
            self.cfg, self.dtype, self.weights, self.model = load_fallback(
                self.model_path, args.dtype, args.trust_remote_code
            )
            self.context_len = args.context_length or self.cfg.max_position_embeddings
            self.max_total_tokens = args.max_total_tokens or args.max_running_requests * self.context_len
            self.pool = TokenPool(self.max_total_tokens)
            return
        self.dtype = resolve_dtype(args.dtype, self.cfg)
        self.context_len = args.context_length or self.cfg.max_position_embeddings
        self.weights = WeightStore(self.cfg, self.dtype)
        self.weights.load_from_dir(self.model_path)
        self.model = Transformer(self.cfg, self.weights, self.dtype, self.context_len + 1)
        bytes_per_token = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * self.dtype.itemsize
        self.max_total_tokens = args.max_total_tokens or min(
            args.max_running_requests * self.context_len, (1 << 30) // bytes_per_token
        )
        self.pool = KVPool(self.cfg, self.max_total_tokens, self.dtype)

    def _eos_ids(self):
        ids = set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        gc = os.path.join(self.model_path, "generation_config.json")
        if os.path.isfile(gc):
            with open(gc) as f:
                e = json.load(f).get("eos_token_id")
            ids |= set([e] if isinstance(e, int) else (e or []))
        return sorted(ids)

    # ------------------------------------------------------------------ app
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 31, middlewares=[self._auth, self._errors])
        r = app.router
        for path, h in [
            ("/health", self.health),
            ("/health_generate", self.health_generate),
            ("/get_server_info", self.server_info),
            ("/server_info", self.server_info),
            ("/get_model_info", self.model_info),
            ("/model_info", self.model_info),
            ("/get_load", self.get_load),
            ("/v1/loads", self.get_load),
            ("/v1/models", self.models),
        ]:
            r.add_get(path, h)
        for path, h in [
            ("/flush_cache", self.flush_cache),
            ("/release_memory_occupation", self.release_memory),
            ("/resume_memory_occupation", self.resume_memory),
            ("/weights_checker", self.weights_checker),
            ("/get_weights_by_name", self.get_weights_by_name),
        ]:
            r.add_route("GET", path, h)
            r.add_route("POST", path, h)
        for path, h in [
            ("/generate", self.generate),
            ("/abort_request", self.abort_request),
            ("/pause_generation", self.pause_generation),
            ("/continue_generation", self.continue_generation),
            ("/init_weights_update_group", self.init_weights_update_group),
            ("/destroy_weights_update_group", self.destroy_weights_update_group),
            ("/update_weights_from_distributed", self.update_weights_from_distributed),
            ("/update_weights_from_tensor", self.update_weights_from_tensor),
            ("/update_weights_from_disk", self.update_weights_from_disk),
            ("/begin_weight_update", self.begin_weight_update),
            ("/end_weight_update", self.end_weight_update),
            ("/update_weight_version", self.update_weight_version),
            ("/v1/completions", self.v1_completions),
            ("/v1/chat/completions", self.v1_chat_completions),
        ]:
            r.add_post(path, h)
        r.add_put("/generate", self.generate)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app):
        self.scheduler.start()

    async def _on_cleanup(self, app):
        self.scheduler.abort(abort_all=True)
        self.scheduler.stop()
        self.weights.cleanup()

    @web.middleware
    async def _auth(self, request, handler):
        """SGLang's API-key rules: health probes always pass; admin endpoints (ADMIN_OPTIONAL) need the admin key
        when one is set, else the API key; the others need the API key when one is set."""
        path, api_key, admin_key = request.path, self.args.api_key, self.args.admin_api_key
        if request.method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics")):
            return await handler(request)
        level = (route(path) or {}).get("auth", "normal")
        need = (admin_key or api_key) if level == "admin_optional" else api_key
        if need:
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token, need):
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            return web.json_response({"error": str(e)}, status=400)
        except WeightError as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        except web.HTTPException:
            raise
        except Exception as e:  # noqa: BLE001  (the server keeps serving; the client gets the reason)
            logger.exception("%s %s failed", request.method, request.path)
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)

    @staticmethod
    async def _body(request) -> dict:
        text = await request.text()
        if not text.strip():
            return {}
        try:
            body = json.loads(text)
        except ValueError as e:
            raise RequestError(f"{request.path}: request body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise RequestError(f"{request.path}: request body must be a JSON object, got {type(body).__name__}")
        if route(request.path) is not None:
            errors = body_errors(request.path, body)
            if request.path == "/generate":
                # sglang-router re-serialises /generate adding fields of its own ("model": null); SGLang's /generate
                # contract ignores unknown top-level keys too. Types and sampling_params stay strict.
                errors = [e for e in errors if not e.startswith("/generate: unknown field")]
            if errors:
                raise RequestError("; ".join(errors))
        return body

    # ------------------------------------------------------------------ info
    async def health(self, request):
        return web.Response(text="")

    async def health_generate(self, request):
        if self.released_tags:
            return web.Response(status=503, text=f"memory released: {sorted(self.released_tags)}")
        if self.scheduler.paused:
            return web.Response(text="")  # paused is healthy; a probe generation would wait for continue
        sp = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0}, self.cfg.vocab_size)
        outs = await self._run([Req([0], sp)], timeout=60)
        ok = outs and outs[0].finish_reason.get("type") != "abort"
        return web.Response(status=200 if ok else 503, text="")

    def _server_info(self):
        a = self.args
        return {
            "model_path": self.model_path,
            "tokenizer_path": a.tokenizer_path or self.model_path,
            "served_model_name": self.served_model_name,
            "host": a.host,
            "port": a.port,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "ep_size": 1,
            "context_length": self.context_len,
            "max_running_requests": a.max_running_requests,
            "max_total_num_tokens": self.max_total_tokens,
            "max_prefill_tokens": a.max_prefill_tokens,
            "random_seed": a.random_seed,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": "cpu",
            "skip_tokenizer_init": False,
            "weight_version": self.state.weight_version,
            "version": VERSION,
            "model_impl": "transformers" if self.fallback else "slime",
            "frontend": "python",
            "startup_time": self.started,
            "internal_states": [{"last_gen_throughput": self.last_gen_throughput}],
        }

    async def server_info(self, request):
        return web.json_response(self._server_info())

    async def model_info(self, request):
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.args.tokenizer_path or self.model_path,
                "served_model_name": self.served_model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.state.weight_version,
                "load_format": "auto",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": self.cfg.model_type,
                "architectures": [self.cfg.architecture],
            }
        )

    async def get_load(self, request):
        return web.json_response([dict(dp_rank=0, **self.scheduler.load())])

    async def models(self, request):
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served_model_name,
                        "object": "model",
                        "created": int(self.started),
                        "owned_by": "sglang",
                        "root": self.served_model_name,
                        "max_model_len": self.context_len,
                    }
                ],
            }
        )

    # ------------------------------------------------------------------ generate
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
        if not sp.max_new_tokens_explicit:  # SGLang clips the default budget to what the context leaves
            sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - n - 1, self.max_total_tokens - n)
            sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        if n + sp.max_new_tokens >= self.context_len:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {n + sp.max_new_tokens} tokens: {n} tokens from the input messages and "
                f"{sp.max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                f"messages or the completion to fit within the limit."
            )
        if n + max(sp.max_new_tokens, 1) > self.max_total_tokens:
            raise RequestError(
                f"The request needs {n + sp.max_new_tokens} KV-cache tokens but the server holds only "
                f"{self.max_total_tokens} (--max-total-tokens)."
            )

    def _build_reqs(self, body, on_update=None):
        prompts, batch = self._prompts(body)
        sps_raw = body.get("sampling_params")
        if isinstance(sps_raw, list) and (not batch or len(sps_raw) != len(prompts)):
            raise RequestError("sampling_params is a list: it needs a batch input with one entry per prompt.")
        rids, lps = body.get("rid"), body.get("return_logprob", False)
        start, topn = body.get("logprob_start_len"), body.get("top_logprobs_num") or 0
        if not isinstance(topn, int) or isinstance(topn, bool) or topn < 0:
            raise RequestError(f"top_logprobs_num must be a non-negative integer, got {topn!r}")
        if body.get("custom_logit_processor") or body.get("input_embeds") is not None or body.get("image_data"):
            raise RequestError(
                "custom_logit_processor, input_embeds and image_data are not supported by slime's CPU server."
            )
        reqs = []
        for i, ids in enumerate(prompts):
            sp_d = sps_raw[i] if isinstance(sps_raw, list) else sps_raw
            sp = SamplingParams.from_dict(sp_d, self.cfg.vocab_size)
            self._check_prompt(ids, sp)
            lp = lps[i] if isinstance(lps, list) else lps
            st = start[i] if isinstance(start, list) else start
            rid = rids[i] if isinstance(rids, list) else (rids if not batch else None)
            if not isinstance(lp, bool) or (st is not None and not isinstance(st, int)):
                raise RequestError("return_logprob must be a boolean and logprob_start_len an integer.")
            for k in range(sp.n):
                r = Req(
                    ids,
                    sp,
                    rid=(f"{rid}-{k}" if rid and sp.n > 1 else rid),
                    return_logprob=lp,
                    logprob_start_len=-1 if st is None else st,
                    top_logprobs_num=topn,
                    stream=bool(body.get("stream")),
                    on_update=on_update,
                )
                r.index, r.text_in_logprobs = len(reqs), bool(body.get("return_text_in_logprobs"))
                reqs.append(r)
        return reqs, batch

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
        futs = []
        for r in reqs:
            fut = loop.create_future()
            futs.append(fut)

            def done(req, fut=fut):
                if req.finished:
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

            r.on_update = done
            self.scheduler.submit(r)
        try:
            return await asyncio.wait_for(asyncio.gather(*futs), timeout)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            for r in reqs:
                self.scheduler.abort(rid=r.rid)
            raise

    def _output(self, r, text=None):
        meta = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "weight_version": r.weight_version or self.state.weight_version,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": 0,
            "num_retractions": r.num_retractions,
            "e2e_latency": time.time() - r.created,
        }
        if r.return_logprob:

            def text_of(t):  # SGLang's return_text_in_logprobs: the token's text in the third slot
                return self.tokenizer.decode([t]) if r.text_in_logprobs else None

            meta["output_token_logprobs"] = [[lp, t, text_of(t)] for lp, t in zip(r.output_logprobs, r.output_ids)]
            meta["input_token_logprobs"] = [[lp, t, text_of(t)] for lp, t, _ in (r.input_logprobs or [])]
            if r.top_logprobs_num:
                meta["output_top_logprobs"] = r.output_top_logprobs
        return {"text": r.text if text is None else text, "output_ids": list(r.output_ids), "meta_info": meta}

    async def generate(self, request):
        body = await self._body(request)
        self._check_ready()
        if body.get("stream"):
            return await self._generate_stream(request, body)
        reqs, batch = self._build_reqs(body)
        t0 = time.time()
        done = await self._run(reqs)
        self.last_gen_throughput = sum(len(r.output_ids) for r in done) / max(time.time() - t0, 1e-6)
        for r in done:
            if r.finish_reason.get("status_code"):
                return web.json_response({"error": r.finish_reason["message"]}, status=r.finish_reason["status_code"])
        outs = [self._output(r) for r in done]
        return web.json_response(outs if batch or len(outs) > 1 else outs[0])

    async def _generate_stream(self, request, body):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_update(req):  # scheduler thread: snapshot the text there (its tokenizer), hand it to the loop
            text = req.text if req.finished else self.scheduler.detokenize(req)
            snap = (req, text, list(req.output_ids), req.finished)
            loop.call_soon_threadsafe(events.put_nowait, snap)

        reqs, batch = self._build_reqs(body, on_update=on_update)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        for r in reqs:
            self.scheduler.submit(r)
        remaining = len(reqs)
        try:
            while remaining:
                r, text, ids, finished = await events.get()
                out = self._output(r, text)
                out["output_ids"] = ids
                if not finished:
                    out["meta_info"]["finish_reason"] = None
                    out["meta_info"]["completion_tokens"] = len(ids)
                if batch or len(reqs) > 1:
                    out["index"] = r.index
                remaining -= finished
                await resp.write(f"data: {json.dumps(out)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            for r in reqs:
                self.scheduler.abort(rid=r.rid)
            raise
        await resp.write_eof()
        return resp

    async def abort_request(self, request):
        body = await self._body(request)
        if body.get("abort_all"):
            self.scheduler.abort(abort_all=True)
        elif body.get("rid"):
            self.scheduler.abort(rid=body["rid"])
        return web.Response(text="")

    # ------------------------------------------------------------------ control
    async def _control(self, fn):
        return await asyncio.wrap_future(self.scheduler.run_control(fn))

    async def flush_cache(self, request):
        # no prefix cache to drop; like SGLang, refuse while requests are in flight (callers retry until 200)
        if not self.scheduler.is_idle():
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.")
        return web.Response(text="Cache flushed.\n")

    async def pause_generation(self, request):
        body = await self._body(request)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise RequestError(f"pause_generation mode must be abort, retract or in_place, got {mode!r}")

        def pause():
            self.scheduler.paused = True

        if mode == "abort":
            self.scheduler.abort(abort_all=True)
        await self._control(pause)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request):
        def cont():
            self.scheduler.paused = False

        await self._control(cont)
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    @staticmethod
    def _tags(body):
        tags = body.get("tags")
        known = set(load_contract()["memory_tags"])  # kv_cache, weights, cuda_graph
        if tags is None:
            return known
        if not isinstance(tags, list) or not set(tags) <= known:
            raise RequestError(f"tags must be a list drawn from {sorted(known)} or null, got {tags!r}")
        return set(tags)

    async def release_memory(self, request):
        tags = self._tags(await self._body(request))

        def release():
            if not self.scheduler.is_idle():
                raise RequestError("release_memory_occupation should be called only when server is idle.")
            if "kv_cache" in tags:
                self.pool.release()
            if "weights" in tags:
                self.weights.release()
                self.received.clear()
            self.released_tags.update(tags)  # cuda_graph: no graphs here, but the tag is held released all the same

        await self._control(release)
        return web.Response(text="")

    async def resume_memory(self, request):
        tags = self._tags(await self._body(request))

        def resume():
            if "weights" in tags:
                self.weights.resume()
            if "kv_cache" in tags and not self.pool.allocated:
                self.pool.allocate()
            self.released_tags.difference_update(tags)

        await self._control(resume)
        self.scheduler.wakeup.set()
        return web.Response(text="")

    # ------------------------------------------------------------------ weights
    async def init_weights_update_group(self, request):
        b = await self._body(request)
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in b]
        if missing:
            raise RequestError(f"init_weights_update_group: missing field(s) {missing}")
        name, backend = b.get("group_name", "weight_update_group"), b.get("backend", "nccl")
        if backend == "nccl" and not torch.cuda.is_available():
            backend = "gloo"  # same call from trainer code written for GPUs; CPU machines use gloo
        url = f"tcp://{b['master_address']}:{b['master_port']}"
        timeout = float(b.get("timeout", 300))

        def join():
            return init_process_group(
                backend=backend,
                init_method=url,
                world_size=int(b["world_size"]),
                rank=int(b["rank_offset"]),
                group_name=name,
                timeout=seconds(timeout),
            )

        old = self.groups.pop(name, None)
        if old is not None:
            # a restarted trainer joins under the same name again: leave the old group first (torch refuses a group
            # name twice; its peers are gone). On the scheduler thread, so no update is receiving on it meanwhile.
            await self._control(lambda: dist.destroy_process_group(old))
        try:
            self.groups[name] = await asyncio.get_running_loop().run_in_executor(None, join)
        except Exception as e:  # noqa: BLE001
            return web.json_response({"success": False, "message": f"failed to join {name} at {url}: {e}"}, status=400)
        return web.json_response({"success": True, "message": f"joined weight update group {name}"})

    async def destroy_weights_update_group(self, request):
        name = (await self._body(request)).get("group_name", "weight_update_group")
        g = self.groups.pop(name, None)
        if g is None:
            return web.json_response({"success": False, "message": f"no weight update group {name!r}"}, status=400)
        dist.destroy_process_group(g)
        return web.json_response({"success": True, "message": f"destroyed {name}"})

    async def update_weights_from_distributed(self, request):
        b = await self._body(request)
        names, dtypes, shapes = b.get("names"), b.get("dtypes"), b.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            raise RequestError("update_weights_from_distributed needs lists names, dtypes and shapes of equal length")
        self._require_session("update_weights_from_distributed")
        name = b.get("group_name", "weight_update_group")
        group = self.groups.get(name)
        if group is None:
            raise WeightError(f"no weight update group {name!r}: call /init_weights_update_group first")
        dts = [parse_dtype(d) for d in dtypes]

        def receive_and_load():
            # receive straight into the live weight when it matches (no extra copy), else into a buffer then load;
            # always consume every broadcast, so a rejected update never leaves the trainer blocked in the collective.
            # All receives are posted at once (the trainer posts all its sends), then awaited.
            received, unknown, works, released = [], [], [], self.weights.released
            named = {} if released else self.weights.named
            for n, dt, shape in zip(names, dts, shapes):
                dst = named.get(n)
                if dst is None or dst.dtype != dt or list(dst.shape) != list(shape) or not dst.is_contiguous():
                    if dst is None and not self.weights.is_ignored(n) and not released:
                        unknown.append(n)
                    dst = torch.empty(shape, dtype=dt)
                    received.append((n, dst))
                works.append(dist.broadcast(dst, src=0, group=group, async_op=True))
            for w in works:
                w.wait()
            if released:
                raise WeightError("weights are released (release_memory_occupation); resume_memory_occupation first")
            if unknown:
                raise WeightError(f"update_weights_from_distributed: unknown parameter(s) {unknown[:5]}")
            self.weights.load(received, "update_weights_from_distributed")
            self.state.bump_version(b.get("weight_version"))

        await self._control(receive_and_load)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_weights_from_tensor(self, request):
        b = await self._body(request)
        self._require_session("update_weights_from_tensor")
        items = b.get("serialized_named_tensors")
        if not isinstance(items, list) or not items or not isinstance(items[0], str):
            raise RequestError("serialized_named_tensors must be a non-empty list of strings (one per TP rank)")
        fmt = b.get("load_format")
        if fmt not in (None, "flattened_bucket", "direct"):
            raise RequestError(f"load_format {fmt!r} is not supported (use null or 'flattened_bucket')")

        def unpack():  # blocking: fetches the shared-memory handles from the sender
            obj = MultiprocessingSerializer.deserialize(items[0])  # this server is TP rank 0
            if fmt == "flattened_bucket":
                return FlattenedTensorBucket(
                    flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"]
                ).reconstruct_tensors()
            return list(obj)

        named = await asyncio.get_running_loop().run_in_executor(None, unpack)

        def load():
            self.weights.load(named, "update_weights_from_tensor")
            self.state.bump_version(b.get("weight_version"))
            self.received.keep(b.get("weight_version"), [t for _, t in named])

        await self._control(load)
        return web.json_response({"success": True, "message": "Succeeded to update parameter online."})

    async def update_weights_from_disk(self, request):
        b = await self._body(request)
        path = b.get("model_path")
        if not isinstance(path, str) or not os.path.isdir(path):
            raise WeightError(f"update_weights_from_disk: model_path {path!r} is not a directory")

        def load():
            self.weights.load_from_dir(path)
            self.state.bump_version(b.get("weight_version"))

        await self._control(load)
        return web.json_response(
            {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        )

    def _require_session(self, what):
        if not self.weight_session_open:
            raise WeightError(f"{what} must run between begin_weight_update() and end_weight_update()")

    async def begin_weight_update(self, request):
        await self._body(request)
        if self.weight_session_open:
            raise WeightError("a weight-update session is already open; call end_weight_update() first")
        self.weight_session_open = True
        return web.json_response({"success": True, "message": "Success"})

    async def end_weight_update(self, request):
        await self._body(request)
        if not self.weight_session_open:
            raise WeightError("no weight-update session is open; call begin_weight_update() first")
        self.weight_session_open = False
        return web.json_response({"success": True, "message": "Success"})

    async def update_weight_version(self, request):
        b = await self._body(request)
        if not isinstance(b.get("new_version"), str):
            raise RequestError("update_weight_version needs new_version (a string)")
        self.state.weight_version = b["new_version"]
        return web.json_response(
            {
                "success": True,
                "message": f"Weight version updated to {b['new_version']}",
                "new_version": b["new_version"],
            }
        )

    async def weights_checker(self, request):
        b = await self._body(request)

        def check():
            return self.weight_checker.handle(b.get("action", "checksum"), b.get("skip_tensor_list"))

        try:
            ranks = await self._control(check)
        except (WeightCheckError, WeightError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        body = {"success": True, "message": "Success."}
        if ranks is not None:  # SGLang: one entry per rank, and a hash over their per-rank checksums
            body["ranks"] = ranks
            body["per_engine_checksum"] = hashlib.sha256(
                "".join(r["per_gpu_checksum"] for r in ranks).encode()
            ).hexdigest()
        return web.json_response(body)

    async def get_weights_by_name(self, request):
        b = await self._body(request)
        t = self.weights.named.get(b.get("name"))
        if t is None:
            raise RequestError(f"get_weights_by_name: unknown parameter {b.get('name')!r}")
        return web.json_response(t.float().reshape(-1)[: int(b.get("truncate_size", 100))].tolist())

    # ------------------------------------------------------------------ OpenAI-compatible
    def _openai_sampling(self, b, prompt_len):
        max_tokens = b.get("max_completion_tokens", b.get("max_tokens"))
        sp = {
            "max_new_tokens": max_tokens if max_tokens is not None else self.context_len - prompt_len - 1,
            "temperature": b.get("temperature", 1.0),
            "top_p": b.get("top_p", 1.0),
            "n": b.get("n", 1),
            "stop": b.get("stop"),
            "stop_token_ids": b.get("stop_token_ids"),
            "frequency_penalty": b.get("frequency_penalty", 0.0),
            "presence_penalty": b.get("presence_penalty", 0.0),
            "sampling_seed": b.get("seed"),
        }
        for k in (
            "top_k",
            "min_p",
            "ignore_eos",
            "skip_special_tokens",
            "no_stop_trim",
            "min_tokens",
            "repetition_penalty",
        ):
            if k in b:
                sp["min_new_tokens" if k == "min_tokens" else k] = b[k]
        return {k: v for k, v in sp.items() if v is not None}

    def _finish_str(self, r):
        return {"stop": "stop", "length": "length", "abort": "abort"}[r.finish_reason["type"]]

    async def _openai_run(self, b, ids):
        if b.get("stream"):
            raise RequestError("stream=true is not supported by slime's CPU server's OpenAI endpoints")
        sp = SamplingParams.from_dict(self._openai_sampling(b, len(ids)), self.cfg.vocab_size)
        self._check_prompt(ids, sp)
        want_lp = bool(b.get("logprobs"))
        return await self._run([Req(ids, sp, return_logprob=want_lp) for _ in range(sp.n)])

    def _usage(self, prompt_len, reqs):
        c = sum(len(r.output_ids) for r in reqs)
        return {"prompt_tokens": prompt_len, "completion_tokens": c, "total_tokens": prompt_len + c}

    async def v1_completions(self, request):
        b = await self._body(request)
        self._check_ready()
        prompt = b.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise RequestError("prompt must be a string or a list of token ids (batch prompts: send one request each)")
        reqs = await self._openai_run(b, ids)
        choices = []
        for i, r in enumerate(reqs):
            lp = None
            if r.return_logprob:
                toks = [self.tokenizer.decode([t]) for t in r.output_ids]
                lp = {"tokens": toks, "token_logprobs": r.output_logprobs, "top_logprobs": None, "text_offset": None}
            choices.append(
                {
                    "index": i,
                    "text": r.text,
                    "logprobs": lp,
                    "finish_reason": self._finish_str(r),
                    "matched_stop": r.finish_reason.get("matched"),
                }
            )
        return web.json_response(
            {
                "id": uuid.uuid4().hex,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.served_model_name,
                "choices": choices,
                "usage": self._usage(len(ids), reqs),
            }
        )

    async def v1_chat_completions(self, request):
        b = await self._body(request)
        self._check_ready()
        msgs = b.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise RequestError("messages must be a non-empty list of {role, content} objects")
        kw = {"tools": b["tools"]} if b.get("tools") else {}
        try:
            ids = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **kw
            )
        except Exception as e:  # noqa: BLE001  (a template error is the client's message list)
            raise RequestError(f"the chat template could not render these messages: {e}") from None
        reqs = await self._openai_run(b, list(ids))
        choices = []
        for i, r in enumerate(reqs):
            lp = None
            if r.return_logprob:
                lp = {
                    "content": [
                        {
                            "token": self.tokenizer.decode([t]),
                            "logprob": v,
                            "bytes": list(self.tokenizer.decode([t]).encode()),
                            "top_logprobs": [],
                        }
                        for t, v in zip(r.output_ids, r.output_logprobs)
                    ]
                }
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r.text, "reasoning_content": None, "tool_calls": None},
                    "logprobs": lp,
                    "finish_reason": self._finish_str(r),
                    "matched_stop": r.finish_reason.get("matched"),
                }
            )
        return web.json_response(
            {
                "id": uuid.uuid4().hex,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.served_model_name,
                "choices": choices,
                "usage": self._usage(len(ids), reqs),
            }
        )


class ReceivedBuffers:
    """The shared-memory buffers `update_weights_from_tensor` received, held until an update no longer sends them.

    Trainers send the same shared buffers on every update. While this server holds one, torch's sharing cache
    resolves the next handle of it to the mapping it already has: no new mmap, no page faults while copying, no
    munmap afterwards (together these cost more than the copy itself). Held: the buffers of the previous update
    and of the current one (calls with the same `weight_version` belong to one update).
    """

    def __init__(self):
        self._version, self._current, self._previous = object(), {}, {}

    def keep(self, version, tensors):
        if version is None or version != self._version:
            self._version, self._previous, self._current = version, self._current, {}
        for t in tensors:
            storage = t.untyped_storage()
            self._current[storage.data_ptr()] = storage
            self._previous.pop(storage.data_ptr(), None)

    def clear(self):
        self._current, self._previous = {}, {}


def _exit_with_parent():
    """A server started by an engine actor (SLIME_PARENT_PID) shuts down when that actor dies, even by SIGKILL."""
    parent = int(os.environ.get("SLIME_PARENT_PID", "0"))
    if not parent:
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        logger.warning("parent process %d is gone; shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_server(args):
    torch.set_num_threads(args.num_threads)
    _exit_with_parent()
    set_shared_authkey()  # colocated trainers send shared-memory handles authenticated with this key
    server = CPUInferenceServer(args)
    logger.info(
        "loaded %s (%s, %s) context %d, KV pool %d tokens, max running %d",
        server.model_path,
        server.cfg.architecture,
        server.dtype,
        server.context_len,
        server.max_total_tokens,
        args.max_running_requests,
    )

    async def ready(app):
        logger.info("The server is fired up and ready to roll! http://%s:%d", args.host, args.port)

    app = server.make_app()
    app.on_startup.append(ready)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None, handle_signals=True)
