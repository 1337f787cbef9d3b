"""http(s) media URLs downloaded as SGLang 0.5.23's download_remote_media does, by the CPU server (a request's
`image_data`) and by the data path (a dataset's image URLs)."""

import ipaddress
import os
import time
from urllib.parse import urljoin, urlparse

import requests

# SGLang 0.5.23's policy for http(s) image URLs: its --allowed-media-domains (empty: any host) and
# --media-url-max-file-size-mb (0: no limit); REQUEST_TIMEOUT seconds (default 3) for the whole download; at most
# 5 redirects, each destination checked before it is fetched
MAX_REDIRECTS = 5
_policy = {"domains": frozenset(), "max_bytes": 64 * 1024 * 1024}


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
    deadline, current = time.monotonic() + timeout, url
    with requests.Session() as session:
        for hop in range(MAX_REDIRECTS + 1):
            prepared = requests.Request("GET", current).prepare().url
            parsed = urlparse(prepared)
            if parsed.scheme not in ("http", "https") or parsed.hostname is None:
                raise ValueError(f"Invalid media URL: {current!r}")
            host = _normalize_domain(parsed.hostname)
            if _policy["domains"] and host not in _policy["domains"]:
                raise ValueError(
                    f"Media URL domain is not allowed. Allowed domains: {sorted(_policy['domains'])}; "
                    f"input domain: {host}"
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise requests.exceptions.Timeout(f"Timed out while downloading media URL: {url}")
            with session.get(prepared, allow_redirects=False, stream=True, timeout=remaining) as r:
                location = r.headers.get("Location")
                if r.status_code in (301, 302, 303, 307, 308) and location:
                    if hop == MAX_REDIRECTS:
                        raise requests.exceptions.TooManyRedirects(
                            f"Media URL exceeded {MAX_REDIRECTS} redirects: {url}"
                        )
                    current = urljoin(r.url, location)
                    continue
                r.raise_for_status()
                limit, declared = _policy["max_bytes"], r.headers.get("Content-Length")
                too_big = ValueError(f"Remote media exceeds the {limit} byte download limit")
                if limit and declared is not None and declared.isdigit() and int(declared) > limit:
                    raise too_big
                content = bytearray()
                for chunk in r.iter_content(chunk_size=64 * 1024):
                    if time.monotonic() > deadline:
                        raise requests.exceptions.Timeout(f"Timed out while downloading media URL: {url}")
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
