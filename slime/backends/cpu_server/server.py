"""slime's CPU inference server: SGLang's HTTP API (the subset slime and its users call) on an aiohttp app.

Routes, request fields, response shapes, auth levels and memory tags follow SGLang's own definitions
(`slime/backends/sglang_utils/sglang_contract.json`, generated from its source), so the same rollout code, the same
sglang-router and the same weight-sync code talk to either server. Bodies are checked strictly against SGLang's
request classes (an unknown or misspelt field is a 400, where SGLang would silently ignore it).

Laid out as SGLang's server is: this file is the HTTP entry point (routes, auth, errors, info and control
endpoints); `generate_api.py` handles requests, `scheduler.py` is the scheduler core, `weight_api.py` the weight and
memory API, `openai_api.py` the OpenAI-compatible API.
"""

import asyncio
import hmac
import json
import logging
import os
import signal
import threading
import time

import psutil
import torch
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from slime.backends.sglang_utils.contract import body_errors, route
from slime.utils.fingerprint import ALGORITHMS, combine
from slime.utils.quantization import QuantScheme
from slime.utils.reasoning_parser import THINK_END, template_toggle
from slime.utils.sampling_record import generation_config_defaults
from slime.utils.tensor_serialization import set_shared_authkey

from .fingerprint import ServedFingerprint
from .generate_api import GenerateAPI
from .hf_fallback import TokenPool, load_fallback
from .lora import LoRARegistry
from .model import KVPool, ModelConfig, Transformer, UnsupportedModelError
from .openai_api import OpenAIAPI
from .radix_cache import eviction_order
from .sampling import ContractError, RequestError, SamplingParams, error_body
from .scheduler import Req, Scheduler
from .weight_api import ReceivedBuffers, WeightAPI
from .weight_checker import WeightChecker
from .weights import WeightError, WeightStore, resolve_dtype

logger = logging.getLogger("slime.cpu_server")
VERSION = "slime-cpu-server-0.1"


class ServerState:
    def __init__(self, weight_version: str, num_threads: int):
        self.weight_version, self.num_threads = weight_version, num_threads
        # the scheduler's hook, called with the old label on every change (on the scheduler thread): it records the
        # change for each live request with output, as SGLang's scheduler does for its per-token version spans
        self.on_version_change = None

    def set_version(self, new):
        old, self.weight_version = self.weight_version, str(new)
        if self.weight_version != old and self.on_version_change is not None:
            self.on_version_change(old)

    def bump_version(self, given=None):
        # every update changes the version: the given string, else the next integer
        cur = self.weight_version
        self.set_version(str(given) if given is not None else (str(int(cur) + 1) if cur.isdigit() else "1"))


class CPUInferenceServer(GenerateAPI, WeightAPI, OpenAIAPI):
    def __init__(self, args):
        self.args = args
        self.model_path = os.path.abspath(args.model_path)
        # as SGLang's --sampling-defaults: what a chat request that leaves a sampling parameter out gets
        model_defaults = args.sampling_defaults == "model"
        self.chat_sampling_defaults = generation_config_defaults(self.model_path) if model_defaults else {}
        from transformers import AutoTokenizer  # heavy

        self._load_model(args)
        tok_path = args.tokenizer_path or self.model_path
        # two tokenizer instances: HF fast tokenizers are not safe to share between the HTTP and scheduler threads
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=args.trust_remote_code)
        sched_tok = AutoTokenizer.from_pretrained(tok_path, trust_remote_code=args.trust_remote_code)
        self.eos_ids = self._eos_ids()
        if args.reasoning_parser:  # the chat template's reasoning toggle, and how </think> encodes
            self.reasoning_toggle = template_toggle(self.tokenizer.chat_template)
            self.think_end_ids = self.tokenizer.encode(THINK_END, add_special_tokens=False)
        self.state = ServerState(args.weight_version, args.num_threads)
        self.loras = self._lora_registry(args)
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
            lora_registry=self.loras,
            batch_invariant=args.enable_deterministic_inference,
            share_prefill=not args.disable_radix_cache,
            eviction_order=eviction_order(args.radix_eviction_policy, args.radix_eviction_policy_config),
        )
        self.served_model_name = args.served_model_name or self.model_path
        self.groups: dict = {}
        self.received = ReceivedBuffers()
        self.released_tags: set = set()  # SGLang memory tags released and not resumed yet
        self.weight_session_open = False  # between /begin_weight_update and /end_weight_update
        self.weight_checker = WeightChecker(lambda: self.weights.state(), on_change=self._weights_changed)
        self.served_fingerprint = ServedFingerprint(lambda: self.weights)
        # held by every change of the weights or of their version label (`_weights_control`) and by a fingerprint
        # while it hashes off the scheduler thread: updates copy in place, so the two must not overlap
        self.weights_lock = asyncio.Lock()
        self.started = time.time()
        self.last_gen_throughput = 0.0

    def _load_model(self, args):
        """The compact batched model for the Llama family; transformers (no KV cache) for anything else."""
        self.processor = None  # a vision-language model's (the fallback's), else None
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
            with open(os.path.join(self.model_path, "config.json")) as f:
                qc = json.load(f).get("quantization_config")
            quant = QuantScheme(qc, f"{self.model_path}/config.json quantization_config") if qc else None
            self.cfg, self.dtype, self.weights, self.model = load_fallback(
                self.model_path, args.dtype, args.trust_remote_code, quant
            )
            self.context_len = args.context_length or self.cfg.max_position_embeddings
            self.max_total_tokens = args.max_total_tokens or args.max_running_requests * self.context_len
            self.pool = TokenPool(self.max_total_tokens)
            if self.cfg.vision:
                from slime.utils.processing_utils import load_processor

                self.processor = load_processor(self.model_path)
            if args.enable_return_routed_experts:
                self.model.enable_routed_experts_capture(self.pool)
            return
        if args.enable_return_routed_experts:
            raise UnsupportedModelError(
                f"--enable-return-routed-experts: {self.cfg.architecture} has no routed MoE experts to return"
            )
        self.dtype = resolve_dtype(args.dtype, self.cfg)
        self.context_len = args.context_length or self.cfg.max_position_embeddings
        qc = self.cfg.quantization_config
        quant = QuantScheme(qc, f"{self.model_path}/config.json quantization_config") if qc else None
        self.weights = WeightStore(self.cfg, self.dtype, quant)
        self.weights.load_from_dir(self.model_path)
        self.model = Transformer(self.cfg, self.weights, self.dtype, self.context_len + 1)
        bytes_per_token = 2 * self.cfg.num_layers * self.cfg.num_kv_heads * self.cfg.head_dim * self.dtype.itemsize
        self.max_total_tokens = args.max_total_tokens or min(
            args.max_running_requests * self.context_len, (1 << 30) // bytes_per_token
        )
        self.pool = KVPool(self.cfg, self.max_total_tokens, self.dtype)

    def _lora_registry(self, args):
        if not (args.enable_lora or args.lora_paths):  # as SGLang: --lora-paths implies --enable-lora
            return None
        try:
            return LoRARegistry(args, self.model.lora_dims(), self.dtype, fuse=self.model.fuses_lora)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None

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
            ("/slime/weights_fingerprint", self.weights_fingerprint),
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
            ("/pull_weights", self.pull_weights),
            ("/begin_weight_update", self.begin_weight_update),
            ("/end_weight_update", self.end_weight_update),
            ("/update_weight_version", self.update_weight_version),
            ("/load_lora_adapter", self.load_lora_adapter),
            ("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors),
            ("/unload_lora_adapter", self.unload_lora_adapter),
            ("/v1/completions", self.v1_completions),
            ("/v1/chat/completions", self.v1_chat_completions),
            ("/tokenize", self.tokenize),
            ("/v1/tokenize", self.tokenize),
            ("/detokenize", self.detokenize),
            ("/v1/detokenize", self.detokenize),
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
            return web.json_response(error_body(request.path, e), status=400)
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
        # FastAPI (SGLang's HTTP layer) reads a body as JSON when it has no Content-Type or a JSON one (else the
        # body fails validation); SGLang's OpenAI routes insist on application/json
        content_type = request.headers.get("Content-Type")
        media = (content_type or "").split(";")[0].strip().lower()
        is_json = media == "application/json" or (media.startswith("application/") and media.endswith("+json"))
        if (request.path.startswith("/v1/") and media != "application/json") or (content_type and not is_json):
            raise ContractError(
                f"{request.path}: Content-Type {content_type!r}: only 'application/json' is allowed", unparsed=True
            )
        try:
            body = json.loads(text)
        except ValueError as e:
            raise ContractError(f"{request.path}: request body is not valid JSON ({e})", unparsed=True) from None
        if not isinstance(body, dict):
            raise ContractError(
                f"{request.path}: request body must be a JSON object, got {type(body).__name__}", unparsed=True
            )
        if route(request.path) is not None:
            errors = body_errors(request.path, body)
            if request.path == "/generate":
                # sglang-router re-serialises /generate adding fields of its own ("model": null); SGLang's /generate
                # contract ignores unknown top-level keys too. Types and sampling_params stay strict.
                errors = [e for e in errors if not e.startswith("/generate: unknown field")]
            if errors:
                raise ContractError("; ".join(errors))
        return body

    # ------------------------------------------------------------------ info
    async def health(self, request):
        return web.Response(text="")

    async def health_generate(self, request):
        if self.released_tags:
            return web.Response(status=503, text=f"memory released: {sorted(self.released_tags)}")
        if self.scheduler.paused:
            return web.Response(text="")  # paused is healthy; a probe generation would wait for continue
        # As SGLang: any answer from the scheduler is healthy, an aborted probe included (a rollout's abort-all
        # or a weight update's pause may abort it); no answer within the window is not.
        sp = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0}, self.cfg.vocab_size)
        try:
            await self._run([Req([0], sp)], timeout=60)
        except asyncio.TimeoutError:
            return web.Response(status=503, text="no answer from the scheduler within 60s")
        return web.Response(text="")

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
            "enable_lora": self.loras is not None,
            "enable_return_routed_experts": bool(a.enable_return_routed_experts),
            "max_lora_rank": None if self.loras is None else self.loras.max_rank,
            "lora_target_modules": None if self.loras is None else sorted(self.loras.targets or ()),
            "max_loras_per_batch": a.max_loras_per_batch,
            "max_loaded_loras": a.max_loaded_loras,
            "weight_version": self.state.weight_version,
            "version": VERSION,
            "model_impl": "transformers" if self.fallback else "slime",
            "frontend": "python",
            "startup_time": self.started,
            "internal_states": [{"last_gen_throughput": self.last_gen_throughput}],
        }

    async def server_info(self, request):
        return web.json_response(self._server_info())

    def _weights_changed(self):
        self.weights.generation += 1

    async def weights_fingerprint(self, request):
        """The served weights' fingerprint and the hash of every HF tensor behind it (`?algorithm=tiles32|xxh3`, the
        trainer's; default tiles32); with `?adapter=NAME`, those of the LoRA adapter loaded under NAME instead (its
        tensors as they arrived; null when no adapter of that name is loaded)."""
        algorithm, adapter = request.query.get("algorithm", "tiles32"), request.query.get("adapter")
        if algorithm not in ALGORITHMS:
            raise RequestError(f"/slime/weights_fingerprint: algorithm {algorithm!r} is not one of {list(ALGORITHMS)}")
        if adapter is not None and self.loras is None:
            raise RequestError("/slime/weights_fingerprint: adapter given but LoRA is not enabled (--enable-lora)")
        # hashed in a worker thread, so generation goes on; the lock keeps weight and version changes out until the
        # hashes are done, so (weight_version, hashes) describe one state
        async with self.weights_lock:
            version = self.state.weight_version
            if adapter is not None:
                loaded = self.loras.get(adapter)
                hashes = None if loaded is None else await asyncio.to_thread(loaded.tensor_hashes, algorithm)
                body = {
                    "adapter": adapter,
                    "adapter_fingerprint": combine(hashes) if hashes else None,
                    "adapter_tensor_hashes": hashes,
                }
            else:
                snap = self.served_fingerprint.snapshot(algorithm)
                hashes = await asyncio.to_thread(self.served_fingerprint.hashes, snap)
                body = {"weights_fingerprint": combine(hashes) if hashes else None, "tensor_hashes": hashes}
        return web.json_response({"weight_version": version, "algorithm": algorithm, **body})

    async def model_info(self, request):
        algorithm, fingerprint = self.served_fingerprint.cached()
        return web.json_response(
            {
                # slime's own key (SGLang ignores unknown ones): the served weights' fingerprint once computed for
                # them (`/slime/weights_fingerprint` computes it; the rollout manager asks after every push), else
                # null. Not computed here: /model_info must answer while an update holds the scheduler.
                "weights_fingerprint": fingerprint,
                "weights_fingerprint_algorithm": algorithm,
                "model_path": self.model_path,
                "tokenizer_path": self.args.tokenizer_path or self.model_path,
                "served_model_name": self.served_model_name,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.state.weight_version,
                "load_format": "auto",
                "reasoning_parser": self.args.reasoning_parser,
                "tool_call_parser": self.args.tool_call_parser,
                "disaggregation_mode": "null",  # SGLang's default, a string
                "has_image_understanding": self.processor is not None,
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

    # ------------------------------------------------------------------ control
    async def _control(self, fn):
        return await asyncio.wrap_future(self.scheduler.run_control(fn))

    async def _weights_control(self, fn):
        """`_control` for a change of the weights or of their version label: waits for a fingerprint being hashed,
        and for an earlier update's tensors still being hashed as they landed."""
        async with self.weights_lock:
            for job in self.served_fingerprint.hashing():
                await asyncio.wrap_future(job)
            return await self._control(fn)

    async def flush_cache(self, request):
        # like SGLang, refuse while requests are in flight (callers retry until 200)
        if not self.scheduler.is_idle():
            return web.Response(status=400, text="Cache not flushed: there are running or waiting requests.")
        await self._control(lambda: None)  # every control task drops the prefix cache first
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

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

    # ------------------------------------------------------------------ weights

    # ------------------------------------------------------------------ OpenAI-compatible


def _exit_with_parent():
    """A server started by an engine actor (SLIME_PARENT_PID) shuts down when that actor dies, even by SIGKILL. The
    actor is watched by pid and start time, not as this process's parent: an interpreter launcher
    (SLIME_SERVER_PYTHON) may run the server as another process's child."""
    pid = int(os.environ.get("SLIME_PARENT_PID", "0"))
    if not pid:
        return
    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        parent = None

    def alive():
        try:  # is_running also tells a reused pid from the actor
            return parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch():
        while parent is not None and alive():
            time.sleep(1.0)
        logger.warning("parent process %d is gone; shutting down", pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


class _OneLineBadRequests(logging.Filter):
    """A request aiohttp cannot parse (answered 400) is the client's fault: one warning line, as SGLang's uvicorn
    logs it, not an ERROR with a traceback. sglang-router probes every worker with HTTP/2's preface before HTTP/1.1."""

    def filter(self, record):
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = (exc.message or type(exc).__name__).strip().splitlines()[0].rstrip(":")
            record.msg, record.args = "Invalid HTTP request received from %s: %s", (*record.args[:1], reason)
            record.levelno, record.levelname, record.exc_info, record.exc_text = logging.WARNING, "WARNING", None, None
        return True


def run_server(args):
    torch.set_num_threads(args.num_threads)
    logging.getLogger("aiohttp.server").addFilter(_OneLineBadRequests())
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

    def ready(_):  # run_app "prints" once its sockets listen: SGLang's line, said only when it is true
        logger.info("The server is fired up and ready to roll! http://%s:%d", args.host, args.port)

    web.run_app(server.make_app(), host=args.host, port=args.port, access_log=None, print=ready, handle_signals=True)
