"""Ports, host info and a small async HTTP client (aiohttp) with timeouts and retries that name the URL."""

import asyncio
import atexit
import json
import os
import random
import socket
import sys

import aiohttp


def is_port_available(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


# Ray's default worker ports (`ray start --min-worker-port/--max-worker-port`): slime's servers never take one, or a
# Ray worker started later on this node could fail to bind.
RAY_WORKER_PORTS = range(10002, 20000)


def _ephemeral_ports() -> range:
    """The range the OS hands out for connect() and bind(port=0) (Linux's `ip_local_port_range`; IANA's elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
        return range(low, high + 1)
    except (OSError, ValueError):
        return range(49152, 65536)


def free_port(consecutive: int = 1, host: str = "") -> int:
    """First of `consecutive` free ports, drawn at random between Ray's worker ports and the OS's ephemeral range.

    A port is probed here and bound later by another process (a server, a rendezvous store), so it must be one the
    OS never hands out by itself meanwhile: an ephemeral one can be taken by any connect() or bind(0) on the machine
    (gloo alone listens on dozens). Drawing at random keeps concurrent runs on one machine apart."""
    low, high = RAY_WORKER_PORTS.stop, _ephemeral_ports().start
    if high - low < 1000:  # an ephemeral range that starts low leaves nothing below it: draw from above Ray's ports
        high = 65536
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(low, high - consecutive + 1)
        if all(is_port_available(p, host) for p in range(port, port + consecutive)):
            return port
    raise RuntimeError(f"no {consecutive} consecutive free ports in {low}-{high - 1} after 200 tries")


def find_available_port(base_port: int) -> int:
    """First bindable port at or after `base_port + randint(100, 1000)`, stepping +42 (wrapping near 60000)."""
    port = base_port + random.randint(100, 1000)
    while not is_port_available(port):
        port = port + 42 if port < 60000 else port - 43
    return port


def get_host_info() -> tuple[str, str]:
    """(hostname, ip). `SLIME_HOST_IP` overrides the IP; in a process connected to Ray, the IP of its Ray node (so
    every server binds and advertises the address Ray placed it on, also with several nodes on one machine);
    otherwise the hostname's address (127.0.0.1 on a laptop/CI)."""
    hostname = socket.gethostname()
    ip = os.environ.get("SLIME_HOST_IP") or _ray_node_ip()
    if not ip:
        try:
            ip = socket.gethostbyname(hostname)
        except OSError:
            ip = "127.0.0.1"
    return hostname, ip


def _ray_node_ip():
    ray = sys.modules.get("ray")  # only where this process already uses Ray
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return None


_sessions: dict = {}  # event loop -> (its session, the generator that closes it with the loop)


async def loop_session() -> aiohttp.ClientSession:
    """This event loop's shared HTTP session (aiohttp sessions are bound to the loop that created them). It closes
    with its loop: a loop that `asyncio.run` (or any `shutdown_asyncgens`) ends closes it first, so a caller that runs
    `asyncio.run(post(...))` per request leaves no session or socket behind."""
    loop = asyncio.get_running_loop()
    entry = _sessions.get(loop)
    if entry is None or entry[0].closed:
        for gone in [other for other in _sessions if other.is_closed()]:  # closed without shutting down
            del _sessions[gone]
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None),
        )
        closer = _closed_with_loop(loop, session)
        await closer.__anext__()  # suspended at its yield: the loop now tracks it
        entry = _sessions[loop] = (session, closer)
    return entry[0]


async def close_loop_session() -> None:
    """Close this event loop's shared session now (a later request opens another)."""
    entry = _sessions.get(asyncio.get_running_loop())
    if entry is not None:
        await entry[1].aclose()


async def _closed_with_loop(loop, session):
    try:
        yield
    finally:
        if _sessions.get(loop, (None,))[0] is session:
            del _sessions[loop]
        await session.close()


@atexit.register
def close_sessions(timeout: float = 2.0) -> None:
    """Close the shared sessions of loops still open at exit (the background loop of slime.utils.async_utils)."""
    for loop, (session, closer) in list(_sessions.items()):
        if session.closed or loop.is_closed():
            continue
        try:
            if loop.is_running():
                asyncio.run_coroutine_threadsafe(closer.aclose(), loop).result(timeout)
            else:
                loop.run_until_complete(closer.aclose())
        except Exception:  # exiting anyway: a loop that cannot close its session has nothing left to leak
            pass
    _sessions.clear()


def _decode(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class HTTPStatusError(RuntimeError):
    def __init__(self, url, status, body):
        super().__init__(f"{url} answered HTTP {status}: {str(body)[:500]}")
        self.url, self.status, self.body = url, status, body

    def __reduce__(self):  # pickled whole (from a --use-distributed-post poster)
        return HTTPStatusError, (self.url, self.status, self.body)


_dispatcher = None  # --use-distributed-post (slime.utils.distributed_post): posts go through Ray actors


def init_http_client(args):
    """Once per process that posts to the engines: with --use-distributed-post, start the poster actors
    (`--num-gpus-per-node` on every alive Ray node) that `post` sends through from then on."""
    global _dispatcher
    if not args.use_distributed_post or _dispatcher is not None:
        return
    from slime.utils import distributed_post  # lazy: Ray, only with the flag

    _dispatcher = distributed_post.Dispatcher(distributed_post.start_posters(args.num_gpus_per_node))


async def _request(
    method, url, payload=None, max_retries=60, timeout=None, headers=None, retry_interval=1.0, on_retry=None
):
    last = None
    for attempt in range(max(1, max_retries)):
        try:
            async with (await loop_session()).request(
                method, url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    err = HTTPStatusError(url, resp.status, _decode(text))
                    if resp.status < 500:  # a client error will not get better by retrying
                        raise err
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status, message=str(err))
                return _decode(text)
        except HTTPStatusError:
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            last = e
            if on_retry is not None:
                on_retry(e)
            if attempt + 1 < max_retries:
                await asyncio.sleep(retry_interval)
    raise ConnectionError(
        f"{method} {url} failed after {max_retries} attempt(s): {type(last).__name__}: {last}"
    ) from last


async def post_stream(url, payload, timeout=None, headers=None):
    """POST JSON to an SSE endpoint (SGLang's `stream: true`); yields each `data:` event decoded, until `[DONE]`.
    Not retried: a stream cut half-way cannot be resumed by sending the request again. Leaving the loop early
    closes the connection, which the server takes as an abort."""
    try:
        async with (await loop_session()).post(
            url, json=payload, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status >= 400:
                raise HTTPStatusError(url, resp.status, _decode(await resp.text()))
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and "error" in event:  # SGLang checks a streamed request in its stream
                    error = event["error"]
                    raise HTTPStatusError(url, error.get("code", 400) if isinstance(error, dict) else 400, error)
                yield event
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ConnectionError(f"POST {url} (stream) failed: {type(e).__name__}: {e}") from e


async def post(url, payload=None, max_retries=60, timeout=None, headers=None, *, use_http2=False, on_retry=None):
    """POST JSON; returns the decoded JSON (or text). Retries connection errors, timeouts and 5xx once a second;
    `on_retry(exception)` is called after each failed attempt.

    `use_http2` is accepted for slime v0.1.0 callers and ignored: the client speaks HTTP/1.1, which every
    SGLang server and router answers."""
    if _dispatcher is not None:
        return await _dispatcher.post(url, payload, max_retries, timeout, headers, on_retry)
    return await _request(
        "POST", url, payload, max_retries=max_retries, timeout=timeout, headers=headers, on_retry=on_retry
    )


async def get(url, max_retries=3, timeout=30, headers=None, *, use_http2=False):
    """GET; returns the decoded JSON (or text). `use_http2` is accepted and ignored, as in `post`."""
    return await _request("GET", url, None, max_retries=max_retries, timeout=timeout, headers=headers)
