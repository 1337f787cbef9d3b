"""http(s) media URLs downloaded as SGLang 0.5.23's download_remote_media does, by the CPU server (a request's
`image_data`) and by the data path (a dataset's image URLs)."""

import ipaddress
import os
import socket
import threading
import time
from urllib.parse import urljoin, urlparse

import requests
import urllib3

# SGLang 0.5.23's policy for http(s) image URLs: its --allowed-media-domains (empty: any host) and
# --media-url-max-file-size-mb (0: no limit); REQUEST_TIMEOUT seconds (default 3) for the whole download; at most
# 5 redirects, each destination checked before it is fetched
MAX_REDIRECTS = 5
_policy = {"domains": frozenset(), "max_bytes": 64 * 1024 * 1024}
# requests' timeout bounds each socket operation, so a server that trickles its headers or body would hold a download
# far past REQUEST_TIMEOUT: each download's sockets are recorded (per thread) and shut down at its deadline
_opened = threading.local()


class _Recorded:
    def connect(self):
        super().connect()
        _opened.socks.append(self.sock)


class _HTTPConnection(_Recorded, urllib3.connection.HTTPConnection):
    pass


class _HTTPSConnection(_Recorded, urllib3.connection.HTTPSConnection):
    pass


class _HTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


_POOLS = {"http": _HTTPPool, "https": _HTTPSPool}


class _Adapter(requests.adapters.HTTPAdapter):
    """requests' adapter with its sockets recorded in `_opened.socks` (direct, and through an http(s) proxy)."""

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = _POOLS

    def proxy_manager_for(self, proxy, **kwargs):
        manager = super().proxy_manager_for(proxy, **kwargs)
        if manager.pool_classes_by_scheme is urllib3.poolmanager.pool_classes_by_scheme:  # not SOCKS
            manager.pool_classes_by_scheme = _POOLS
        return manager


def _shut(socks, expired):
    """At the deadline: wake every read blocked on the download's sockets (each then fails or ends early)."""
    expired.set()
    for sock in list(socks):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed
            pass


def _normalize_domain(domain: str) -> str:
    domain = domain.strip().rstrip(".")
    if not domain or "://" in domain or any(c in domain for c in "/?#@"):
        raise ValueError(f"Invalid allowed media domain {domain!r}: provide a hostname only")
    if domain.startswith("[") and domain.endswith("]"):
        domain = domain[1:-1]
    try:
        return str(ipaddress.ip_address(domain))
    except ValueError:
        if ":" in domain:
            raise ValueError(f"Invalid allowed media domain {domain!r}: ports are not supported") from None
    return domain.encode("idna").decode("ascii").lower()


def configure_media_urls(allowed_domains, max_file_size_mb: int):
    """The server's flags, checked at start-up (a bad domain or a negative size is a one-line error)."""
    if max_file_size_mb < 0:
        raise ValueError("--media-url-max-file-size-mb must be non-negative")
    _policy["domains"] = frozenset(_normalize_domain(d) for d in allowed_domains or ())
    _policy["max_bytes"] = max_file_size_mb * 1024 * 1024


def download(url: str) -> bytes:
    """An http(s) image's bytes under the policy above, as SGLang's download_remote_media fetches it."""
    timeout = int(os.environ.get("REQUEST_TIMEOUT", "3"))
    timed_out = requests.exceptions.Timeout(
        f"Timed out after {timeout} s (REQUEST_TIMEOUT) while downloading media URL: {url}"
    )
    _opened.socks, expired = [], threading.Event()
    watchdog = threading.Timer(timeout, _shut, (_opened.socks, expired))
    watchdog.daemon = True
    try:
        with requests.Session() as session:
            session.mount("http://", _Adapter())
            session.mount("https://", _Adapter())
            watchdog.start()
            content = _fetch(session, url, time.monotonic() + timeout, timed_out)
    except Exception:
        if expired.is_set():  # whatever failed, it failed because the deadline shut its socket
            raise timed_out from None
        raise
    finally:
        watchdog.cancel()
        _opened.socks = []
    if expired.is_set():  # a body without a Content-Length just ends early when its socket is shut
        raise timed_out
    return content


def _fetch(session, url, deadline, timed_out):
    current = url
    for hop in range(MAX_REDIRECTS + 1):
        prepared = requests.Request("GET", current).prepare().url
        parsed = urlparse(prepared)
        if parsed.scheme not in ("http", "https") or parsed.hostname is None:
            raise ValueError(f"Invalid media URL: {current!r}")
        host = _normalize_domain(parsed.hostname)
        if _policy["domains"] and host not in _policy["domains"]:
            raise ValueError(
                f"Media URL domain is not allowed. Allowed domains: {sorted(_policy['domains'])}; input domain: {host}"
            )
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise timed_out
        with session.get(prepared, allow_redirects=False, stream=True, timeout=remaining) as r:
            location = r.headers.get("Location")
            if r.status_code in (301, 302, 303, 307, 308) and location:
                if hop == MAX_REDIRECTS:
                    raise requests.exceptions.TooManyRedirects(f"Media URL exceeded {MAX_REDIRECTS} redirects: {url}")
                current = urljoin(r.url, location)
                continue
            r.raise_for_status()
            limit, declared = _policy["max_bytes"], r.headers.get("Content-Length")
            too_big = ValueError(f"Remote media exceeds the {limit} byte download limit")
            if limit and declared is not None and declared.isdigit() and int(declared) > limit:
                raise too_big
            content = bytearray()
            for chunk in r.iter_content(chunk_size=64 * 1024):
                if limit and len(content) + len(chunk) > limit:
                    raise too_big
                content.extend(chunk)
            return bytes(content)
    raise AssertionError("unreachable")


def download_image(url: str, where: str) -> bytes:
    """`download`, any failure a ValueError of one line naming `where` and the URL."""
    try:
        return download(url)
    except (requests.RequestException, ValueError) as e:
        raise ValueError(f"{where}: could not download image {url[:200]!r}: {e}") from None
