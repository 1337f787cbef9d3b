"""Where an agent's tools run: a small async sandbox contract, a local process-isolated backend, remote backends' hook.

Contract (`Sandbox`): `exec(cmd, timeout=..., env=...) -> ExecResult`, `read_file(path) -> bytes`,
`write_file(path, data)`, `close()`, and `async with`. Paths are relative to the sandbox's working directory.
A command that runs past its timeout is killed (its whole process group) and reported with `timed_out=True`; a
crash is a non-zero `returncode`. Neither raises: the agent sees the result and the episode goes on.

`LocalSandbox` runs commands as subprocesses in a fresh temporary directory, under resource limits (CPU seconds,
address space, file size, open files) and with a minimal environment. With `isolate=True` (the default where
`unshare` can create namespaces) each command also runs in its own mount, network, PID and IPC namespaces in which
every filesystem is read-only except the sandbox directory (/dev and /sys included), /dev/shm and /dev/mqueue are
the sandbox's own, and nothing is reachable over the network: a command cannot write outside its directory. A
mount that cannot be set up so raises `SandboxSetupError` naming it, and the command does not run (fail closed).
Without namespaces, only the file API is confined to the directory.

Remote backends (a container service, a cloud sandbox) implement the same four methods and register a factory:
`register_sandbox_backend("name", factory)`; `create_sandbox("name", **kwargs)` builds one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import resource
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class ExecResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool = False


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float = 30.0  # wall clock, per command
    cpu_s: int = 30  # RLIMIT_CPU
    memory_bytes: int = 1 << 30  # RLIMIT_AS
    file_size_bytes: int = 64 << 20  # RLIMIT_FSIZE
    open_files: int = 256  # RLIMIT_NOFILE
    output_bytes: int = 1 << 20  # stdout / stderr kept per command (the rest is cut)


@runtime_checkable
class Sandbox(Protocol):
    async def exec(
        self, cmd: str | list[str], *, timeout: float | None = None, env: dict | None = None
    ) -> ExecResult: ...

    async def read_file(self, path: str) -> bytes: ...

    async def write_file(self, path: str, data: str | bytes) -> None: ...

    async def close(self) -> None: ...


_BACKENDS: dict[str, Callable[..., Sandbox]] = {}


def register_sandbox_backend(name: str, factory: Callable[..., Sandbox]) -> None:
    _BACKENDS[name] = factory


def create_sandbox(backend: str = "local", **kwargs) -> Sandbox:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown sandbox backend {backend!r}; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[backend](**kwargs)


@functools.cache
def namespaces_available() -> bool:
    """Whether `unshare` can give a command its own user, mount, network, PID and IPC namespaces here."""
    if shutil.which("unshare") is None:
        return False
    try:
        r = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--fork", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


# Runs inside the new namespaces: every mount read-only (/dev and /sys included), then the sandbox directory
# writable again, a private /dev/shm (tmpfs) and /dev/mqueue (this IPC namespace's queues), then the command. Any
# step that fails stops it before the command runs, its reason the last line on stderr (fail closed); the command
# runs only after "ready" went to the descriptor the host reads (closed first, so the command cannot forge it).
# bash, not sh: the descriptor's number may have two digits.
_ISOLATE = (
    'fail() { echo "$1" >&2; exit 125; }; '
    'mount --make-rprivate / || fail "cannot make the mounts private"; '
    'mount --bind "$SANDBOX_DIR" "$SANDBOX_DIR" || fail "cannot bind-mount $SANDBOX_DIR"; '
    # already read-only mounts are skipped: one inherited from the host's namespace cannot be made writable here
    "awk '$4 !~ /^ro(,|$)/ {print $2}' /proc/self/mounts | sort -r -u | while read -r m; do "
    "m=$(printf '%b' \"$m\"); "
    'case "$m" in "$SANDBOX_DIR"|/proc|/proc/*) continue;; esac; '
    'mount -o remount,bind,ro "$m" || fail "cannot remount $m read-only"; done || exit 125; '
    'mount --bind "$SANDBOX_DIR" "$SANDBOX_DIR" || fail "cannot bind-mount $SANDBOX_DIR"; '
    "if [ -d /dev/shm ]; then mount -t tmpfs -o nosuid,nodev,mode=1777,size=$SANDBOX_SHM_BYTES tmpfs /dev/shm "
    '|| fail "cannot mount a private /dev/shm"; fi; '
    "if [ -d /dev/mqueue ]; then mount -t mqueue -o nosuid,nodev,noexec mqueue /dev/mqueue "
    '|| fail "cannot mount a private /dev/mqueue"; fi; '
    'cd "$SANDBOX_DIR" || fail "cannot enter $SANDBOX_DIR"; '
    'echo ready >&"$SANDBOX_READY_FD" || fail "cannot report ready"; exec {SANDBOX_READY_FD}>&-; '
    'unset SANDBOX_READY_FD SANDBOX_SHM_BYTES; set +e; exec "$@"'
)


class SandboxSetupError(RuntimeError):
    """The isolation of a command could not be set up (a mount it needs failed): the command did not run."""


def _apply_limits(limits: Limits) -> None:  # in the child, before exec
    os.setsid()
    for res, value in (
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_AS, limits.memory_bytes),
        (resource.RLIMIT_FSIZE, limits.file_size_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
    ):
        resource.setrlimit(res, (value, value))


class LocalSandbox:
    """Subprocesses in a temporary directory, under resource limits (and namespaces where available)."""

    def __init__(self, *, limits: Limits | None = None, isolate: bool | None = None, root: str | None = None):
        self.limits = limits or Limits()
        if isolate is None:
            isolate = namespaces_available()
        elif isolate and not namespaces_available():
            raise RuntimeError("isolate=True needs `unshare` with user, mount, network and PID namespaces")
        self.isolate = isolate
        self.root = Path(tempfile.mkdtemp(prefix="slime-sandbox-", dir=root)).resolve()
        self._closed = False

    async def __aenter__(self) -> LocalSandbox:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _path(self, path: str) -> Path:
        p = (self.root / path).resolve()
        if p != self.root and self.root not in p.parents:
            raise PermissionError(f"{path!r} is outside the sandbox directory")
        return p

    async def write_file(self, path: str, data: str | bytes) -> None:
        p = self._path(path)
        if len(data) > self.limits.file_size_bytes:
            raise ValueError(f"{path!r}: {len(data)} bytes exceed the sandbox's file size limit")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    async def read_file(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    async def exec(self, cmd: str | list[str], *, timeout: float | None = None, env: dict | None = None) -> ExecResult:
        if self._closed:
            raise RuntimeError("the sandbox is closed")
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        environ = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.root),
            "TMPDIR": str(self.root),
            "LANG": "C.UTF-8",
            "SANDBOX_DIR": str(self.root),
            **(env or {}),
        }
        ready_r = ready_w = None
        if self.isolate:
            argv = [
                "unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--fork",
                "--mount-proc", "bash", "-c", _ISOLATE, "sandbox", *argv,
            ]  # fmt: skip
            ready_r, ready_w = os.pipe()
            environ.update(SANDBOX_READY_FD=str(ready_w), SANDBOX_SHM_BYTES=str(self.limits.file_size_bytes))
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                cwd=self.root,
                env=environ,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                preexec_fn=functools.partial(_apply_limits, self.limits),
                pass_fds=() if ready_w is None else (ready_w,),
            )
        finally:
            if ready_w is not None:
                os.close(ready_w)
        limit = self.limits.timeout_s if timeout is None else timeout
        timed_out = False
        try:
            try:
                out, err = await asyncio.wait_for(proc.communicate(), limit)
            except asyncio.TimeoutError:
                timed_out = True
                _kill_group(proc.pid)
                out, err = await proc.communicate()
            if ready_r is not None and not _read_ready(ready_r):
                lines = err.decode(errors="replace").strip().splitlines()
                reason = lines[-1] if lines else f"exit status {proc.returncode}"
                raise SandboxSetupError(f"sandbox isolation failed, the command was not run: {reason}")
        finally:
            if ready_r is not None:
                os.close(ready_r)
        cap = self.limits.output_bytes
        return ExecResult(
            proc.returncode if not timed_out else -signal.SIGKILL,
            out[:cap].decode(errors="replace"),
            err[:cap].decode(errors="replace"),
            timed_out,
        )

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            shutil.rmtree(self.root, ignore_errors=True)

    def __repr__(self) -> str:
        return f"LocalSandbox({shlex.quote(str(self.root))}, isolate={self.isolate})"


def _read_ready(fd: int) -> bool:
    """Whether the isolation script reported it is ready to run the command (every writer is gone by now)."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 16) == b"ready\n"
    except BlockingIOError:
        return False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


register_sandbox_backend("local", LocalSandbox)
