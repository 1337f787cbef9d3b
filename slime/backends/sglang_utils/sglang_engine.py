"""SGLangEngine: a Ray actor that owns one inference server process and wraps its admin endpoints.

The server is SGLang (`python -m sglang.launch_server`) where SGLang and a GPU exist, otherwise slime's CPU server
(`python -m slime.backends.cpu_server`); `server_command` is the one place that chooses. Both speak the same HTTP API,
so every admin call below is the same for both. The server runs in its own session / process group with a
parent-death signal, so neither `shutdown()`, a crash nor `ray.kill(engine)` leaves it running.
"""

import argparse
import atexit
import collections
import contextlib
import functools
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import requests

from slime.ray.ray_actor import RayActor
from slime.utils.http_utils import get_host_info
from slime.utils.lora_utils import hf_target_modules
from slime.utils.process_utils import die_with_parent
from slime.utils.weight_versions import INITIAL_WEIGHT_VERSION

from .arguments import CPU_SERVER_HONOURED, load_table
from .contract import route
from .router import add_worker, remove_worker

logger = logging.getLogger(__name__)

# ServerArgs fields slime sets per engine; every other `args.sglang_<field>` is passed through as --<field>.
_ENGINE_FIELDS = (
    "model_path",
    "trust_remote_code",
    "random_seed",
    "enable_memory_saver",
    "host",
    "port",
    "nccl_port",
    "nnodes",
    "node_rank",
    "dist_init_addr",
    "gpu_id_step",
    "base_gpu_id",
    "tp_size",
    "dp_size",
    "pp_size",
    "ep_size",
    "skip_server_warmup",
    "weight_version",
)
_NOT_SERVER_ARGS = (
    "router_ip",
    "router_port",
    "router_request_timeout_secs",
    "server_concurrency",
    "config",  # --sglang-config: slime's model list, not SGLang's own --config
    "model_routers",
)


def get_base_gpu_id(args, rank: int) -> int:
    num_gpus = min(args.rollout_num_gpus_per_node, args.rollout_num_gpus_per_engine)
    if args.colocate:
        start = rank * num_gpus
    else:
        start = args.actor_num_gpus_per_node * args.actor_num_nodes + rank * num_gpus
    return start % args.rollout_num_gpus_per_node


_ZERO_ARG = {"store_true", "store_false", "store_const", "deprecated_store_true", "deprecated_store_const"}


@functools.lru_cache(None)
def _sglang_flags() -> dict:
    """dest -> SGLang's launch option for it: {flag, default, action, nargs, const, choices}, from the installed
    SGLang's own parser, else the vendored table (the pinned release's options). Where several options share a dest
    (a deprecated spelling and its replacement), the non-deprecated one is used."""
    table = load_table()
    try:
        from sglang.srt.server_args import ServerArgs  # lazy: SGLang is optional (GPU machines only)

        parser = argparse.ArgumentParser(add_help=False)
        ServerArgs.add_cli_args(parser)
        names = {
            argparse._StoreTrueAction: "store_true",
            argparse._StoreFalseAction: "store_false",
            argparse._StoreConstAction: "store_const",
            argparse.BooleanOptionalAction: "boolean_optional",
        }
        entries = []
        for a in parser._actions:
            if not a.option_strings:
                continue
            kind = type(a).__name__
            action = names.get(type(a)) or (
                "deprecated_" + _snake(kind[len("Deprecated") : -len("Action")])
                if kind.startswith("Deprecated")
                else None
            )
            const = getattr(a, "const_value", a.const)
            entries.append(
                {
                    "flags": a.option_strings,
                    "dest": a.dest,
                    "default": a.default,
                    "action": action,
                    "nargs": a.nargs,
                    "const": const,
                    "choices": a.choices,
                }
            )
    except ImportError:
        entries = [
            dict(e, dest=e.get("dest") or e["flags"][0][2:].replace("-", "_"))
            for e in table["arguments"]
            if table["sglang_version"] in e["sglang_versions"]
        ]
    out = {}
    for e in entries:
        action = e.get("action")
        if action in ("store_true", "deprecated_store_true"):
            const = True
        elif action == "store_false":
            const = False
        else:
            const = e.get("const")
        rec = {
            "flag": e["flags"][0],
            "default": e.get("default"),
            "action": action,
            "nargs": e.get("nargs"),
            "const": const,
            "choices": e.get("choices"),
        }
        if e["dest"] not in out or str(out[e["dest"]]["action"]).startswith("deprecated"):
            out[e["dest"]] = rec
    return out


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def _sglang_passthrough(args) -> list:
    """CLI flags for every `args.sglang_<dest>` the user changed from SGLang's default, spelled as SGLang's parser
    takes them back: zero-argument actions as the bare flag, `--no-` for a cleared BooleanOptional, a deprecated
    store-const that takes its one choice as that choice. Unknown ones are dropped."""
    flags, argv = _sglang_flags(), []
    for key, value in sorted(vars(args).items()):
        dest = key[len("sglang_") :]
        if not key.startswith("sglang_") or dest in _NOT_SERVER_ARGS or dest in _ENGINE_FIELDS:
            continue
        if dest not in flags:
            logger.warning(
                "--sglang-%s is not an option of the installed SGLang; not passing it", dest.replace("_", "-")
            )
            continue
        f = flags[dest]
        flag, action = f["flag"], f["action"]
        if value == f["default"]:
            continue
        if action == "boolean_optional":
            argv += [flag if value else "--no-" + flag[2:]]
        elif action in _ZERO_ARG:
            if f["const"] is True and not value:
                continue  # an unset flag (default None)
            if value != f["const"]:
                raise ValueError(f"--sglang-{flag[2:]} can only set {dest} to {f['const']!r}, not {value!r}")
            if f["nargs"] in (0, None) and not (action == "deprecated_store_const" and f["choices"]):
                argv += [flag]
            else:  # takes an argument whatever it stores: its one choice
                argv += [flag, str(f["choices"][0])]
        elif isinstance(value, (list, tuple)):
            argv += [flag] + [str(x) for x in value]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def _cli(kwargs: dict) -> list:
    argv = []
    for k, v in kwargs.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            argv += [flag] if v else []
        else:
            argv += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    return argv


def lora_server_fields(args) -> dict:
    """`--lora-sync adapter`: the server serves LoRA adapters of the run's rank on the run's projections (SGLang's
    flags; the CPU server takes the same). The base weights are never pushed then, so a colocated engine that
    releases its memory keeps a CPU copy of them to resume from."""
    if not (args.enable_lora and args.lora_sync == "adapter"):
        return {}
    fields = {"enable_lora": True, "max_lora_rank": args.lora_rank, "lora_target_modules": hf_target_modules(args)}
    if args.inference_server == "sglang" and args.offload_rollout:
        fields["enable_weights_cpu_backup"] = True
    return fields


def server_python() -> list:
    """The interpreter command the engines run their servers with: SLIME_SERVER_PYTHON (split as a shell would, e.g.
    another venv's python for SGLang, or a launcher that forks pre-imported interpreters) or else this Python."""
    return shlex.split(os.environ.get("SLIME_SERVER_PYTHON", "")) or [sys.executable]


def server_command(args, rank: int, host: str, port: int, nccl_port: int, dist_init_addr: str) -> tuple[str, list]:
    """(kind, argv) of the inference server for engine `rank`: THE place that picks SGLang or slime's CPU server."""
    kind = args.inference_server  # sglang | cpu: parse_args resolved --inference-server auto
    seed = (args.seed or 0) + rank
    if kind == "cpu":
        kw = {
            "model_path": args.hf_checkpoint,
            "host": host,
            "port": port,
            "random_seed": seed,
            "weight_version": INITIAL_WEIGHT_VERSION,
        }
        for field in CPU_SERVER_HONOURED:
            if getattr(args, f"sglang_{field}") is not None:
                kw[field] = getattr(args, f"sglang_{field}")
        kw.update(lora_server_fields(args))
        if args.use_rollout_routing_replay:  # R3: the engine returns each token's routed experts
            kw["enable_return_routed_experts"] = True
        return kind, [*server_python(), "-m", "slime.backends.cpu_server"] + _cli(kw)
    gpus_per_engine, gpus_per_node = args.rollout_num_gpus_per_engine, args.rollout_num_gpus_per_node
    nnodes = max(1, gpus_per_engine // gpus_per_node)
    kw = {
        "model_path": args.hf_checkpoint,
        "random_seed": seed,
        "enable_memory_saver": bool(args.offload_rollout),
        "host": host,
        "port": port,
        "nccl_port": nccl_port,
        "nnodes": nnodes,
        "node_rank": rank % nnodes,
        "dist_init_addr": dist_init_addr,
        "gpu_id_step": 1,
        "base_gpu_id": get_base_gpu_id(args, rank),
        "tp_size": gpus_per_engine,
        "dp_size": args.sglang_dp_size or 1,
        "pp_size": args.sglang_pp_size or 1,
        "ep_size": args.sglang_ep_size or 1,
        "skip_server_warmup": True,
        # the --hf-checkpoint weights are version 0, never SGLang's "default": every label an engine reports is
        # then one slime set (0, or a push's), and a sample's versions can be checked against the pushes
        "weight_version": INITIAL_WEIGHT_VERSION,
        **lora_server_fields(args),
    }
    if args.use_rollout_routing_replay:  # R3: the engine returns each token's routed experts
        kw["enable_return_routed_experts"] = True
    return kind, [*server_python(), "-m", "sglang.launch_server"] + _cli(kw) + _sglang_passthrough(args)


def _die_with_parent():
    """preexec_fn: new session (own process group) and SIGKILL when the actor process dies (Linux)."""
    os.setsid()
    die_with_parent()


def kill_process_group(proc: subprocess.Popen, timeout: float = 10.0):
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        pass


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
        env = dict(os.environ, SLIME_PARENT_PID=str(os.getpid()))
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
            time.sleep(0.5)
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
