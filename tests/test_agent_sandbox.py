"""slime.agent.sandbox's local backend: real subprocesses, real limits, nothing written outside its directory."""

import asyncio
import os
import socket
import uuid

import pytest

from slime.agent.sandbox import (
    ExecResult,
    Limits,
    LocalSandbox,
    Sandbox,
    create_sandbox,
    namespaces_available,
    register_sandbox_backend,
)

pytestmark = pytest.mark.timeout(120)


def run(coro):
    return asyncio.run(coro)


def test_exec_and_files_live_in_the_sandbox_directory():
    async def go():
        async with create_sandbox("local", isolate=False) as sb:
            assert isinstance(sb, Sandbox)
            await sb.write_file("pkg/calc.py", "print(sum(range(10)))\n")
            r = await sb.exec("python3 pkg/calc.py && pwd && echo oops >&2 && exit 3")
            assert r == ExecResult(3, f"45\n{sb.root}\n", "oops\n", False)
            await sb.exec(["sh", "-c", "echo hi > out.txt"])
            assert await sb.read_file("out.txt") == b"hi\n"
            for bad in ("../escape.txt", "/etc/passwd", "pkg/../../x"):
                with pytest.raises(PermissionError, match="outside the sandbox"):
                    await sb.write_file(bad, "x")
                with pytest.raises(PermissionError):
                    await sb.read_file(bad)
            root = sb.root
        assert not root.exists()  # closed: its directory is gone

    run(go())


def test_timeouts_and_resource_limits_are_results_not_exceptions():
    async def go():
        limits = Limits(timeout_s=1.0, memory_bytes=256 << 20, file_size_bytes=1 << 20)
        async with LocalSandbox(limits=limits, isolate=False) as sb:
            r = await sb.exec("sleep 30 & sleep 30; echo never")
            assert r.timed_out and r.returncode < 0 and "never" not in r.stdout
            # the commands below must finish: their own time limit, not the 1 s one (a python3 start-up alone can
            # take that long on a loaded machine, and a timed-out run would not report the MemoryError)
            r = await sb.exec(["python3", "-c", "x = bytearray(512 << 20)"], timeout=60)
            assert not r.timed_out and r.returncode != 0 and "MemoryError" in r.stderr
            r = await sb.exec("head -c 2000000 /dev/zero > big", timeout=60)
            assert not r.timed_out and r.returncode != 0 and os.path.getsize(sb.root / "big") == 1 << 20
            r = await sb.exec("echo $HOME; echo ${SECRET-unset}", env={"EXTRA": "1"}, timeout=60)
            assert r.stdout == f"{sb.root}\nunset\n"  # the host's environment does not leak in

    os.environ["SECRET"] = "host-only"
    try:
        run(go())
    finally:
        del os.environ["SECRET"]


@pytest.mark.skipif(not namespaces_available(), reason="no user/mount/net/pid namespaces on this machine")
def test_isolated_commands_cannot_touch_the_host_outside_their_directory(tmp_path):
    outside = tmp_path / f"outside-{uuid.uuid4().hex}"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")

    # no network: a listener this test starts on the host's loopback, reachable from here, is not from the sandbox
    # (its own network namespace has its own loopback); never an outside address (tests reach only 127.0.0.1)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    socket.create_connection(("127.0.0.1", port), timeout=2).close()  # the control: the host reaches it
    listener.accept()[0].close()

    async def go():
        async with LocalSandbox(isolate=True) as sb:
            r = await sb.exec(f"echo inside > ok.txt; touch {outside}; echo x > {victim}; rm -f {victim}; echo done")
            assert r.stdout == "done\n" and "Read-only file system" in r.stderr
            assert await sb.read_file("ok.txt") == b"inside\n"
            r = await sb.exec(
                f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)\""
            )
            assert r.returncode != 0 and "Error" in r.stderr, (r.stdout, r.stderr)  # no network
            r = await sb.exec("ps -e -o pid= | wc -l")
            assert int(r.stdout) < 10  # its own PID namespace: the host's processes are invisible

    try:
        run(go())
        listener.settimeout(0)
        with pytest.raises(BlockingIOError):  # nothing from the sandbox ever reached the listener
            listener.accept()
    finally:
        listener.close()
    assert not outside.exists() and victim.read_text() == "keep"


def test_remote_backends_plug_in_by_name():
    class Echo:
        def __init__(self, prefix):
            self.prefix = prefix

        async def exec(self, cmd, *, timeout=None, env=None):
            return ExecResult(0, f"{self.prefix}{cmd}", "")

        async def read_file(self, path):
            return b""

        async def write_file(self, path, data):
            pass

        async def close(self):
            pass

    register_sandbox_backend("echo", Echo)
    sb = create_sandbox("echo", prefix="remote:")
    assert isinstance(sb, Sandbox) and run(sb.exec("ls")).stdout == "remote:ls"
    with pytest.raises(ValueError, match="unknown sandbox backend 'nope'"):
        create_sandbox("nope")


@pytest.mark.skipif(not namespaces_available(), reason="no user/mount/net/pid namespaces on this machine")
def test_isolated_commands_get_a_private_dev_shm_and_dev_mqueue():
    """The escape tried: a command writes /dev/shm (and /dev/mqueue where the host has it); the host sees nothing."""
    name = f"slime-sandbox-escape-{uuid.uuid4().hex}"
    targets = [d for d in ("/dev/shm", "/dev/mqueue") if os.path.isdir(d)]
    assert "/dev/shm" in targets, "this machine has no /dev/shm to try the escape on"

    async def go():
        async with LocalSandbox(isolate=True) as sb:
            cmd = "; ".join(f"echo x > {d}/{name} && cat {d}/{name}" for d in targets)
            r = await sb.exec(cmd)
            assert r.returncode == 0 and r.stdout == "x\n" * len(targets), r  # writable, but the sandbox's own
            r = await sb.exec(f"touch /dev/{name}")
            assert r.returncode != 0 and "Read-only file system" in r.stderr  # /dev itself is read-only

    try:
        run(go())
        leaked = [d for d in (*targets, "/dev") if os.path.exists(f"{d}/{name}")]
        assert not leaked, f"the sandbox wrote the host's {leaked}"
    finally:
        for d in (*targets, "/dev"):
            if os.path.exists(f"{d}/{name}"):
                os.remove(f"{d}/{name}")


@pytest.mark.skipif(not namespaces_available(), reason="no user/mount/net/pid namespaces on this machine")
def test_a_mount_the_sandbox_cannot_make_read_only_fails_closed(monkeypatch):
    """A remount that fails (here: `/`, made to fail) stops the command before it runs, in one line naming it."""
    import slime.agent.sandbox as sandbox

    failing = 'mount() { [ "$*" = "-o remount,bind,ro /" ] && return 1; command mount "$@"; }; '
    monkeypatch.setattr(sandbox, "_ISOLATE", failing + sandbox._ISOLATE)

    async def go():
        async with LocalSandbox(isolate=True) as sb:
            with pytest.raises(sandbox.SandboxSetupError) as e:
                await sb.exec("echo ran > ran.txt")
            assert not (sb.root / "ran.txt").exists()
            return str(e.value)

    message = run(go())
    assert message == "sandbox isolation failed, the command was not run: cannot remount / read-only", message
