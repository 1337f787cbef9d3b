"""sglang-router: start it, register / list / remove workers, and fan an abort out to every worker.

The router is the real `sglang_router` wheel (it runs on CPU). Facts it forces on us (sglang-router 0.3):
workers are registered with `POST /workers` after 0.2.1 and `/add_worker?url=` up to 0.2.1; the router does not
forward `/abort_request` (control calls go to each worker directly); a dead worker stays listed, so fan-outs must
tolerate dead URLs; its Prometheus exporter binds 0.0.0.0:29000 unless told otherwise, and dies if that port is busy.
A worker's API key goes in its registration (`{"api_key": ...}`): the router then sends it as a Bearer token with
every request it makes to that worker. (The router's own `--api-key` is different: it locks the router's endpoints.)
"""

import asyncio
import json
import logging
import multiprocessing
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from importlib.metadata import version

import aiohttp
import psutil
from packaging.version import parse

from slime.utils.http_utils import free_port, get_host_info
from slime.utils.process_utils import die_with_parent

logger = logging.getLogger(__name__)

# the request header whose value the router's consistent_hashing policy keys on (a session's turns: one engine)
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def _router_version():
    return parse(version("sglang-router"))


def uses_workers_api() -> bool:
    """True for sglang-router > 0.2.1 (`/workers`), False for the older `/add_worker` / `/list_workers` API."""
    return _router_version() > parse("0.2.1")


_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never route loopback calls via a proxy


def _http(method, url, body=None, timeout=10.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with _opener.open(req, timeout=timeout) as resp:
        text = resp.read().decode()
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def wait_for_http(url: str, timeout: float, what: str, process=None, interval: float = 0.2):
    """Poll GET url until it answers 200; raise naming `what` on timeout or when `process` died first."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if process is not None and not _alive(process):
            raise RuntimeError(f"{what} exited (code {_exitcode(process)}) before {url} answered")
        try:
            _http("GET", url, timeout=5)
            return
        except (urllib.error.URLError, OSError) as e:
            last = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what} at {url} (last error: {last})")


def _alive(p):
    return p.is_alive() if hasattr(p, "is_alive") else p.poll() is None


def _exitcode(p):
    return p.exitcode if hasattr(p, "exitcode") else p.returncode


def run_router(router_args, parent_pid=None):
    """Process target: runs the Rust router until terminated (imports avoid launch_router's heavy mini_lb import).

    The router dies with the process that started it, even when that one is killed with SIGKILL."""
    die_with_parent(parent_pid)
    from sglang_router.router import Router  # heavy: only the driver starts a router

    Router.from_args(router_args).start()


def start_router(args, timeout: float = 60.0):
    """Start sglang-router in its own process unless `--sglang-router-ip` points at an external one.

    Sets `args.sglang_router_ip/port` and returns the `multiprocessing.Process` (None for an external router)."""
    if args.sglang_router_ip:
        if not args.sglang_router_port:
            raise ValueError(
                "--sglang-router-ip is set but --sglang-router-port is not: give both for an external router"
            )
        return None
    ip, port = get_host_info()[1], args.sglang_router_port
    if port:
        process = launch_router(args, ip, port, timeout)
    else:
        process, port = launch_router_on_free_port(args, ip, timeout)
    args.sglang_router_ip, args.sglang_router_port = ip, port
    return process


def launch_router_on_free_port(args, ip: str, timeout: float = 60.0):
    """`launch_router` on a port chosen here; returns (process, port). Another process can take a free port before
    the router binds it (the router then exits): new ports are chosen, twice."""
    for attempt in range(3):
        port = free_port()
        try:
            return launch_router(args, ip, port, timeout), port
        except RuntimeError as e:
            if attempt == 2:
                raise
            logger.warning("sglang-router did not start on port %d (%s); trying other ports", port, e)


def router_args_of(args, ip: str, port: int):
    """The router's configuration: the user's `--router-*` flags (sglang-router's own, as current slime passes
    them), with this run's address, a free Prometheus port (its default 29000 is shared by every run on the host)
    and `--sglang-router-request-timeout-secs` as the per-request timeout. The `--router-*` flags for what is set
    here (and `--worker-urls`) are refused at start-up (`slime.utils.flag_support.REFUSED`)."""
    from sglang_router.router_args import RouterArgs  # lazy: rollout code uses this module's worker calls only

    router_args = RouterArgs.from_cli_args(args, use_router_prefix=True)
    router_args.host = ip
    router_args.port = port
    router_args.worker_urls = []  # engines register themselves once they are up (add_worker)
    router_args.prometheus_host = ip
    router_args.prometheus_port = free_port()
    router_args.request_timeout_secs = int(args.sglang_router_request_timeout_secs)
    return router_args


def launch_router(args, ip: str, port: int, timeout: float = 60.0):
    """Run sglang-router on ip:port in a child process (bound to this process's life); return once it answers.

    Also how a router that died is restarted: on the same address, so every client's URL stays valid."""
    router_args = router_args_of(args, ip, port)
    process = multiprocessing.Process(
        target=run_router, args=(router_args, os.getpid()), daemon=True, name="sglang-router"
    )
    process.start()
    url = f"http://{ip}:{port}"
    try:
        wait_for_http(f"{url}/health", timeout, "sglang-router", process)
        _check_listener(process, port, "sglang-router")
    except Exception:
        stop_router(process)
        raise
    logger.info("sglang-router %s listening on %s (pid %d)", _router_version(), url, process.pid)
    return process


def _check_listener(process, port: int, what: str):
    """The answer on `port` came from `process`: another run's router there would otherwise get our engines."""
    deadline = time.time() + 10
    while time.time() < deadline:
        if not _alive(process):
            raise RuntimeError(f"{what} exited (code {_exitcode(process)}): port {port} is taken by another process")
        try:
            connections = psutil.Process(process.pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:  # it exited since: the check above says so, next round (and the caller retries)
            continue
        if port in {c.laddr.port for c in connections if c.status == psutil.CONN_LISTEN}:
            return
        time.sleep(0.1)
    raise RuntimeError(
        f"{what} (pid {process.pid}) is not the process listening on port {port}: another run's server answered there"
    )


def stop_router(process, timeout: float = 10.0):
    if process is None or not process.is_alive():
        return
    process.terminate()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join(5)


def router_url(args) -> str:
    """The policy's router, for slime's own calls: behind the recording proxy when one runs (slime's generate records
    what it samples with itself, so it skips the proxy's hop; user code reads args.sglang_router_ip/port, the proxy)."""
    ip, port = getattr(args, "sglang_router_behind_proxy", None) or (args.sglang_router_ip, args.sglang_router_port)
    return f"http://{ip}:{port}"


def add_worker(router: str, worker_url: str, timeout: float = 60.0, wait: bool = True, api_key: str | None = None):
    """Register worker_url with the router; with `wait`, return once the router lists it. `api_key`: the worker's
    (--sglang-api-key), which the router must send with each request it routes there (SGLang refuses them else)."""
    if uses_workers_api():
        body = {"url": worker_url, "worker_type": "regular"}
        if api_key:
            body["api_key"] = api_key
        _http("POST", f"{router}/workers", body, timeout=timeout)
    else:  # 0.2.1 and older: synchronous, waits for the worker's /health itself
        if api_key:
            raise ValueError(
                f"sglang-router {_router_version()} cannot pass --sglang-api-key to its workers; use sglang-router > 0.2.1"
            )
        _http("POST", f"{router}/add_worker?url={urllib.parse.quote(worker_url, safe=':/')}", timeout=timeout)
    if not wait:
        return
    deadline = time.time() + timeout
    while worker_url not in list_workers(router):
        if time.time() > deadline:
            raise TimeoutError(f"router {router} did not list worker {worker_url} within {timeout:.0f}s")
        time.sleep(0.1)


def _workers(router: str, timeout: float = 10.0) -> list:
    return (_http("GET", f"{router}/workers", timeout=timeout) or {}).get("workers", [])


def list_workers(router: str, timeout: float = 10.0) -> list:
    """URLs of every registered worker (dead ones included: the router keeps them listed)."""
    if uses_workers_api():
        return [w["url"] for w in _workers(router, timeout)]
    return (_http("GET", f"{router}/list_workers", timeout=timeout) or {}).get("urls", [])


def remove_worker(router: str, worker_url: str, timeout: float = 10.0):
    if uses_workers_api():
        for w in _workers(router, timeout):
            if w["url"] == worker_url:
                _http("DELETE", f"{router}/workers/{w['id']}", timeout=timeout)
    else:
        _http("POST", f"{router}/remove_worker?url={urllib.parse.quote(worker_url, safe=':/')}", timeout=timeout)


async def abort_all(router: str, timeout: float = 10.0, admin_key: str | None = None) -> list:
    """POST {"abort_all": true} to every worker's /abort_request (the router does not route it), with `admin_key`
    (--sglang-admin-api-key, else --sglang-api-key) when the workers have one.

    Dead or hanging workers are skipped after `timeout` seconds; returns the URLs that acknowledged."""
    urls = await asyncio.get_running_loop().run_in_executor(None, list_workers, router, timeout)
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}

    async def one(session, url):
        try:
            async with session.post(f"{url}/abort_request", json={"abort_all": True}, headers=headers) as resp:
                return url if resp.status < 400 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            logger.warning("abort_all: worker %s unreachable (%s); skipping it", url, type(e).__name__)
            return None

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), trust_env=False) as session:
        done = await asyncio.gather(*(one(session, u) for u in urls))
    return [u for u in done if u]
