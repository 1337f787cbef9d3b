"""Tests, examples, scripts, benchmarks, tools and docs address nothing beyond loopback: every IP literal is loopback
(127/8, ::1) or the bind-all 0.0.0.0 (a listen address), and a URL in code reaches only loopback, localhost or a
dotless placeholder (`http://h:1`, never resolved). Not even documentation addresses (RFC 5737's TEST-NETs): a
stand-in for another host is another loopback address (127.0.2.x); a test that needs an address it cannot use makes
the failure on loopback, e.g. a port its own listener holds (tests/test_core_utils.py), and a test showing that
something has no network starts its own listener on 127.0.0.1 (tests/test_agent_sandbox.py)."""

import ipaddress
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("tests", "examples", "scripts", "benchmarks", "tools", "docs", "README.md")
# Exceptions, each a (file, literal) pair with its reason: none.
ALLOWED: set = set()
SELF = "tests/test_no_outside_addresses.py"  # its own samples of what the scan must catch
IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.]*\d)")
URL = re.compile(r"\b(?:https?|wss?|tcp|grpc)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)")
CODE = (".py", ".sh", ".yaml", ".yml", ".toml", ".json", ".cfg", ".ini")


def _allowed_ip(text):
    try:
        ip = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return True  # not an address (e.g. 999.1.1.1): nothing to reach
    return ip.is_loopback or ip == ipaddress.ip_address("0.0.0.0")


def _allowed_host(host):
    if host.startswith("[") or re.fullmatch(r"[\d.]+", host):
        return _allowed_ip(host)
    return host == "localhost" or "." not in host  # a dotless placeholder (h, x, host) names no real machine


def _files():
    for top in SCANNED:
        path = os.path.join(ROOT, top)
        if os.path.isfile(path):
            yield path
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            yield from (os.path.join(dirpath, f) for f in filenames)


def _ip(*octets):
    return ".".join(map(str, octets))


def offenders():
    found = []
    for path in _files():
        rel = os.path.relpath(path, ROOT)
        if rel == SELF or os.path.getsize(path) > 4 << 20:
            continue
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except UnicodeDecodeError:
            continue  # binary (images, checkpoints)
        code = rel.endswith(CODE)
        for n, line in enumerate(lines, 1):
            bad = [ip for ip in IPV4.findall(line) if not _allowed_ip(ip)]
            # in code, a URL's host is a target; in prose and comments a URL is a link for the reader
            if code and not line.lstrip().startswith("#"):
                bad += [h for h in URL.findall(line) if not _allowed_host(h)]
            bad = [b for b in dict.fromkeys(bad) if (rel, b) not in ALLOWED]
            found += [f"{rel}:{n}: {b}" for b in bad]
    return found


def test_no_address_outside_this_machine_is_named():
    found = offenders()
    assert not found, "addresses beyond loopback (use 127.0.0.1, or 127.0.2.x for another host):\n" + "\n".join(found)


def test_the_scan_finds_what_it_must(tmp_path, monkeypatch):
    """The scanner itself: a public IP, a TEST-NET address and a public URL host in code are caught with file:line;
    loopback, bind-all, placeholders and a version-like string are not; a prose link is not."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(
        'a = "1.1.1.1"\nb = "http://example.com:80/x"\nc = ("127.0.0.1", "127.0.2.7", "0.0.0.0", "http://h:1")\n'
        'd = "v1.2.3.4.5"\n# see https://github.com/THUDM/slime\ne = "http://[::1]:8000"\nf = "http://[2606:4700::1]:80"\n'
        # RFC 5737 documentation addresses, assembled here so that no source file names them
        f'g = ("{_ip(192, 0, 2, 7)}", "http://{_ip(198, 51, 100, 2)}:80", "{_ip(203, 0, 113, 9)}")\n'
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "d.md").write_text("See https://github.com/THUDM/slime, or http://10.0.0.7:30000.\n")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    assert sorted(offenders()) == [
        "docs/d.md:1: 10.0.0.7",
        "tests/t.py:1: 1.1.1.1",
        "tests/t.py:2: example.com",
        "tests/t.py:7: [2606:4700::1]",
        f"tests/t.py:8: {_ip(192, 0, 2, 7)}",
        f"tests/t.py:8: {_ip(198, 51, 100, 2)}",
        f"tests/t.py:8: {_ip(203, 0, 113, 9)}",
    ]
