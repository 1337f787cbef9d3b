"""SGLangEngine: a Ray actor that owns one inference server process and wraps its admin endpoints.

The server is SGLang (`python -m sglang.launch_server`) where SGLang and a GPU exist, otherwise slime's CPU server
(`python -m slime.backends.cpu_server`); `server_launch.server_command` is the one place that chooses. Both speak the same HTTP API,
so every admin call below is the same for both. The server runs in its own session / process group with a
parent-death signal, so neither `shutdown()`, a crash nor `ray.kill(engine)` leaves it running.
"""

import atexit
import collections
import contextlib
import logging
import os
import subprocess
import tempfile
import time

import requests

from slime.ray.ray_actor import RayActor
from slime.utils.http_utils import get_host_info

from .contract import route
from .router import add_worker, remove_worker
from .server_launch import _die_with_parent, kill_process_group, server_command, server_env

logger = logging.getLogger(__name__)


class SGLangEngine(RayActor):
    def __init__(self, args, rank: int):
        self.args, self.rank = args, rank
        self.process = None
        self.external = False  # attached to a server someone else started (see `attach`)
        self.host = self.port = self.url = None
        self.router_url = None
        self.log_path = None
        self._http = requests.Session()
        self._http.trust_env = False
        self._lora_loaded = False  # whether this server holds the policy's adapter (--lora-sync adapter)
        # SGLang's auth: admin endpoints (ADMIN_OPTIONAL) take the admin key when one is set, else the API key;
        # the others take the API key (the admin key is refused there)
        api_key = args.sglang_api_key
        admin_key = args.sglang_admin_api_key or api_key
        self._auth = {
            level: {"Authorization": f"Bearer {key}"} if key else {}
            for level, key in (("admin_optional", admin_key), ("normal", api_key))
        }

    # ------------------------------------------------------------------ lifecycle
    def init(self, dist_init_addr, port, nccl_port, host=None, startup_timeout: float | None = None, join_router=True):
        """Start the server; it joins the router unless `join_router` is False (a replacement engine joins only once
        it serves the trainers' weights, see `join_router`)."""
        args = self.args
        self.host = host or get_host_info()[1]
        self.port = port
        self.url = f"http://{self.host}:{port}"
        kind, cmd = server_command(args, self.rank, self.host, port, nccl_port, dist_init_addr)
        self.kind = kind
        env = dict(os.environ, SLIME_PARENT_PID=str(os.getpid()), **server_env(args, kind))
        fd, self.log_path = tempfile.mkstemp(prefix=f"slime-engine{self.rank}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.process = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
            )
        atexit.register(self.shutdown)
        logger.info(
            "engine %d: %s server pid %d at %s (log %s)", self.rank, kind, self.process.pid, self.url, self.log_path
        )
        nnodes = max(1, args.rollout_num_gpus_per_engine // args.rollout_num_gpus_per_node) if kind == "sglang" else 1
        if self.rank % nnodes != 0:
            return  # only node 0 of a multi-node engine serves HTTP
        self._wait_ready(startup_timeout or 600.0)
        self._check_identity()
        if join_router:
            self.join_router()

    def attach(self, url: str, join_router=True):
        """Drive an engine slime did not start (--rollout-external-engine-addrs): no process of ours, so nothing
        here or in `shutdown` starts or stops it; its shape and model were checked at start-up."""
        self.kind, self.external = "external", True
        self.url = url
        self.host, self.port = url.rsplit("//", 1)[1].rsplit(":", 1)
        self.check_alive()
        if join_router:
            self.join_router()

    def join_router(self):
        """Register this server with the run's router (none with an external --sglang-router-ip left unset)."""
        if self.args.sglang_router_ip:
            self.router_url = f"http://{self.args.sglang_router_ip}:{self.args.sglang_router_port}"
            add_worker(self.router_url, self.url, api_key=self.args.sglang_api_key)

    def _log_tail(self, n=40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(collections.deque(f, maxlen=n))
        except OSError:
            return "(no log)"

    def _wait_ready(self, timeout: float):
        deadline = time.time() + timeout
        probe = "/health_generate" if self.kind == "sglang" else "/health"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"inference server for engine {self.rank} ({self.url}) exited with code "
                    f"{self.process.returncode} during startup. Last log lines ({self.log_path}):\n{self._log_tail()}"
                )
            try:
                if self._http.get(self.url + probe, timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                tail = self._log_tail()
                kill_process_group(self.process)
                raise TimeoutError(
                    f"inference server for engine {self.rank} at {self.url} was not healthy within "
                    f"{timeout:.0f}s. Last log lines ({self.log_path}):\n{tail}"
                )
            time.sleep(0.2)
        self.flush_cache(timeout=max(deadline - time.time(), 30))

    def _check_identity(self):
        """The server answering at our URL must be ours: it echoes this run's --sglang-served-model-name (a per-run
        token unless the user set one). Another run's server on a reused port would otherwise get our traffic and
        weights."""
        expected = self.args.sglang_served_model_name
        key = self.args.sglang_api_key
        resp = self._http.get(
            f"{self.url}/get_server_info", timeout=30, headers={"Authorization": f"Bearer {key}"} if key else {}
        )
        try:
            echoed = resp.json().get("served_model_name") if resp.status_code == 200 else f"HTTP {resp.status_code}"
        except (ValueError, AttributeError):  # not JSON, or not an object: some other kind of server
            echoed = f"a non-SGLang answer {resp.text[:80]!r}"
        if echoed != expected:
            raise RuntimeError(
                f"engine {self.rank}: the server answering at {self.url} is not this run's engine "
                f"(served_model_name {echoed!r}, expected {expected!r}); another process holds port "
                f"{self.port}"
            )

    def shutdown(self):
        if self.router_url:
            try:
                remove_worker(self.router_url, self.url)
            except Exception as e:  # noqa: BLE001  (the router may already be gone at teardown)
                logger.warning(
                    "engine %d: could not remove %s from router %s: %s", self.rank, self.url, self.router_url, e
                )
            self.router_url = None
        stopped_by_us = self.process is not None and self.process.poll() is None
        kill_process_group(self.process)
        if stopped_by_us and self.log_path:  # a server that died by itself keeps its log, which its errors name
            with contextlib.suppress(OSError):
                os.remove(self.log_path)

    def get_url(self) -> str:
        return self.url

    def check_alive(self) -> str:
        """Raise (with the server's last log lines) if the inference server process has exited, or if an external
        engine no longer answers; else return the URL."""
        if self.external:
            try:
                resp = self._http.get(f"{self.url}/health", timeout=10, headers=self._auth["normal"])
            except requests.RequestException as e:
                raise RuntimeError(
                    f"external inference engine {self.url} does not answer: {type(e).__name__}"
                ) from None
            if resp.status_code != 200:
                raise RuntimeError(f"external inference engine {self.url}: /health answered HTTP {resp.status_code}")
            return self.url
        if self.process is not None and self.process.poll() is not None:
            raise RuntimeError(
                f"inference server of engine {self.rank} at {self.url} exited with code "
                f"{self.process.returncode}. Last log lines ({self.log_path}):\n{self._log_tail()}"
            )
        return self.url

    def _raise_if_exiting(self, grace: float = 5.0):
        """A refused or dropped connection often means the server is dying: give it `grace` seconds to be reaped so
        the error names the exit (and its log) rather than the socket."""
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            return
        self.check_alive()

    def health_generate(self, timeout: float = 30.0) -> bool:
        """GET /health_generate (a one-token generation on SGLang and on the CPU server); raises if the server does
        not answer 200 within `timeout` seconds. Only node 0 of a multi-node engine serves HTTP."""
        if self.url is None or (self.process is None and not self.external):
            return True
        self.check_alive()
        try:
            resp = self._http.get(f"{self.url}/health_generate", timeout=timeout, headers=self._auth["normal"])
        except requests.Timeout:
            raise TimeoutError(f"did not answer /health_generate within {timeout:g}s (hung?)") from None
        except requests.RequestException as e:
            if not self.external:
                self._raise_if_exiting()
            raise RuntimeError(f"GET /health_generate failed: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raise RuntimeError(f"GET /health_generate answered HTTP {resp.status_code}")
        return True

    def get_server_pid(self) -> int | None:
        return self.process.pid if self.process else None

    # ------------------------------------------------------------------ admin calls (straight to the worker)
    def _make_request(self, endpoint: str, payload=None, timeout: float | None = None, method: str = "POST"):
        url = f"{self.url}/{endpoint}"
        try:
            resp = self._http.request(
                method,
                url,
                json=payload if method == "POST" else None,
                timeout=timeout,
                headers=self._headers(endpoint),
            )
        except requests.RequestException as e:
            raise RuntimeError(f"engine {self.rank}: {method} {url} failed: {e}") from e
        if resp.status_code >= 400:
            raise RuntimeError(
                f"engine {self.rank}: {method} {url} answered HTTP {resp.status_code}: {resp.text[:1000]}"
            )
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def _headers(self, endpoint: str) -> dict:
        return self._auth[(route("/" + endpoint) or {}).get("auth", "normal")]

    def _checked(self, endpoint, result):
        if isinstance(result, dict) and result.get("success") is False:
            raise RuntimeError(f"engine {self.rank}: {endpoint} failed at {self.url}: {result.get('message')}")
        return result

    def begin_weight_update(self):
        """Open SGLang's weight-update session: every update_weights_from_{distributed,tensor} of one update runs
        inside one begin/end pair (end re-runs the weights' post-processing, so once per update, not per bucket)."""
        return self._checked("begin_weight_update", self._make_request("begin_weight_update", {}, timeout=60))

    def end_weight_update(self):
        return self._checked("end_weight_update", self._make_request("end_weight_update", {}, timeout=600))

    def init_process_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        return self._make_request(
            "init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    def destroy_weights_update_group(self, group_name):
        return self._make_request("destroy_weights_update_group", {"group_name": group_name})

    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, weight_version=None, flush_cache=False
    ):
        dtypes = [str(d).replace("torch.", "") for d in dtypes]
        shapes = [list(s) for s in shapes]
        payload = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._checked(
            "update_weights_from_distributed", self._make_request("update_weights_from_distributed", payload)
        )

    def update_weights_from_tensor(
        self, serialized_named_tensors, load_format=None, flush_cache=False, weight_version=None
    ):
        payload = {
            "serialized_named_tensors": serialized_named_tensors,
            "load_format": load_format,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._checked("update_weights_from_tensor", self._make_request("update_weights_from_tensor", payload))

    def update_weights_from_disk(self, model_path, weight_version=None):
        payload = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return self._checked("update_weights_from_disk", self._make_request("update_weights_from_disk", payload))

    def pull_weights(self, target_version: int, source_dir=None, local_checkpoint_dir=None):
        """Bring this engine host's local checkpoint to `target_version` (`/pull_weights`: a published full version
        copied, a delta applied on its base and verified per tensor, 0 = seed it from the engine's model path). The
        engine then reloads it through `update_weights_from_disk`. Stock SGLang 0.5.23 has no such endpoint
        (slime's patched SGLang and slime's CPU server do): the flags that need it are refused at start-up there."""
        payload = {
            "local_checkpoint_dir": local_checkpoint_dir or self.args.update_weight_local_checkpoint_dir,
            "source_dir": source_dir or self.args.update_weight_disk_dir,
            "target_version": int(target_version),
        }
        return self._checked("pull_weights", self._make_request("pull_weights", payload))

    def flush_cache(self, timeout: float = 60.0):
        """GET /flush_cache until 200 (it refuses while requests are in flight); raises at once if the server exited."""
        deadline = time.time() + timeout
        while True:
            self.check_alive()  # a dead server would only refuse connections until the deadline
            try:
                r = self._http.get(f"{self.url}/flush_cache", timeout=10, headers=self._headers("flush_cache"))
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except requests.RequestException as e:
                last = str(e)
            if time.time() > deadline:
                raise TimeoutError(
                    f"engine {self.rank}: {self.url}/flush_cache did not succeed within {timeout:.0f}s ({last})"
                )
            time.sleep(0.2)

    def release_memory_occupation(self, tags=None):
        self.flush_cache()
        return self._make_request("release_memory_occupation", {"tags": tags})

    def resume_memory_occupation(self, tags=None):
        return self._make_request("resume_memory_occupation", {"tags": tags})

    def pause_generation(self, mode: str = "abort"):
        return self._make_request("pause_generation", {"mode": mode})

    def continue_generation(self):
        return self._make_request("continue_generation", {})

    def check_weights(self, action: str):
        """SGLang's `/weights_checker`: `snapshot` the served weights, `reset_tensors` (overwrite them with noise),
        `compare` the served weights with the snapshot (a 400 naming the differing tensors), or `checksum`."""
        return self._checked(f"weights_checker {action}", self._make_request("weights_checker", {"action": action}))

    def update_lora_adapter(self, name, config_dict, payload, checksums, weight_version):
        """Replace the served adapter `name` by a new version (`--lora-sync adapter`), between pause_generation and
        continue_generation: SGLang refuses to load a name twice, so the old version is unloaded first, then the new
        one is loaded from `payload` (one by-value copy for every TP rank, each tensor verified by sha256) and the
        server's weight version set."""
        if self._lora_loaded:
            self._checked("unload_lora_adapter", self._make_request("unload_lora_adapter", {"lora_name": name}))
            self._lora_loaded = False
        body = {
            "lora_name": name,
            "config_dict": config_dict,
            "serialized_named_tensors": [payload] * self._tp_size(),
            "load_format": "flattened_bucket",
            "expected_checksums": checksums,
        }
        self._checked("load_lora_adapter_from_tensors", self._make_request("load_lora_adapter_from_tensors", body))
        self._lora_loaded = True
        self._make_request("update_weight_version", {"new_version": str(weight_version)})

    def _tp_size(self) -> int:
        if self.external:
            return next(i["tp_size"] for i in self.args.rollout_external_engine_infos if i["url"] == self.url)
        return self.args.rollout_num_gpus_per_engine if self.kind == "sglang" else 1

    def get_weights_fingerprint(self, timeout: float = 300, algorithm: str = "tiles32", adapter: str | None = None):
        """slime's CPU server: `{weight_version, weights_fingerprint, tensor_hashes}` of the weights it serves (tiles32
        per HF tensor, see slime.utils.fingerprint), or with `adapter` `{weight_version, adapter_fingerprint,
        adapter_tensor_hashes}` of the LoRA adapter it serves under that name. None for an engine without the route
        (SGLang: its tensors are fused and sharded, not HF-named; it has no adapter hash either)."""
        if self.kind == "sglang":
            return None
        url = f"{self.url}/slime/weights_fingerprint"
        try:
            resp = self._http.get(
                url,
                params={"algorithm": algorithm, **({"adapter": adapter} if adapter is not None else {})},
                timeout=timeout,
                headers=self._headers("slime/weights_fingerprint"),
            )
        except requests.RequestException as e:
            raise RuntimeError(f"engine {self.rank}: GET {url} failed: {e}") from e
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            raise RuntimeError(f"engine {self.rank}: GET {url} answered HTTP {resp.status_code}: {resp.text[:1000]}")
        return resp.json()

    def get_weight_version(self) -> str:
        return self._make_request("model_info", method="GET", timeout=30)["weight_version"]
