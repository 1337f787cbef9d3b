"""Finding the processes a test, or the whole test session, started.

A command line does not identify them: Ray retitles its daemons and workers (`raylet`, `ray::MegatronTrainRayActor`),
and a run's forked router carries its driver's. The environment does: every process inherits it, so a marker
variable set before the start (`SLIME_TEST_SESSION` for the session, `SLIME_TEST_RUN` for one subprocess run) is
carried by the driver, its router, the Ray it starts and every worker of that Ray, even after they are reparented.
Except where a process writes its title over its environment, as Ray's agents (`ray::DashboardAgent`,
`ray::RuntimeEnvAgent`) do: those are found as children of a marked raylet while it lives, and once it died
abruptly (killed, or with its driver) as orphaned agents (`orphaned_ray_agents`)."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SESSION_KEY = "SLIME_TEST_SESSION"
RUN_KEY = "SLIME_TEST_RUN"

# Helpers of this interpreter that only end with it (pytest's own process), not processes a test left behind.
_ENDS_WITH_INTERPRETER = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "_inductor/compile_worker")


def carrying(key, value, include_interpreter_helpers=True):
    """Live processes (zombies excluded) other than this one whose environment has `key`=`value`, and their
    descendants (a child that wrote its title over its environment still belongs to whoever started it)."""
    me, found = os.getpid(), {}
    for p in psutil.process_iter(["environ", "status", "cmdline"]):
        try:
            if p.pid == me or p.info["status"] == psutil.STATUS_ZOMBIE or (p.info["environ"] or {}).get(key) != value:
                continue
            cmd = " ".join(p.info["cmdline"] or [])
            if not include_interpreter_helpers and p.ppid() == me and any(h in cmd for h in _ENDS_WITH_INTERPRETER):
                continue
            found[p.pid] = p
        except psutil.Error:
            pass
    for p in list(found.values()):
        with contextlib.suppress(psutil.Error):
            for child in p.children(recursive=True):
                if child.pid != me and child.status() != psutil.STATUS_ZOMBIE:
                    found.setdefault(child.pid, child)
    return list(found.values())


RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # their titles


def orphaned_ray_agents(since):
    """Ray's per-node agents started after `since` whose raylet is gone (adopted by init). Each exits on its own about
    a minute after its raylet died: it first reports the death to the GCS, which waits out a hard-coded timeout when
    the GCS died too (a driver killed with SIGKILL takes both with it; test_fault_tolerance waits for that once)."""
    found = []
    for p in psutil.process_iter(["cmdline", "ppid", "create_time", "status"]):
        with contextlib.suppress(psutil.Error):
            title = (p.info["cmdline"] or [""])[0]
            alive = p.info["status"] != psutil.STATUS_ZOMBIE
            if alive and p.info["ppid"] == 1 and p.info["create_time"] >= since and title.startswith(RAY_AGENTS):
                found.append(p)
    return found


def wait_none_carrying(key, value, timeout, include_interpreter_helpers=True):
    """Processes still carrying `key`=`value` after polling for up to `timeout` seconds (empty once all are gone)."""
    deadline = time.time() + timeout
    while True:
        left = carrying(key, value, include_interpreter_helpers)
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.5)


def cmdline(p):
    """`p`'s command line as one string ("" once it is gone)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def describe(procs):
    return [f"{p.pid} {cmdline(p)[:160]}" for p in procs if cmdline(p)]


def kill(procs):
    """SIGKILL exactly these processes (by pid), then reap what can be reaped."""
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=10)


def listening_pid(port):
    """The process listening on TCP `port` (a server, whichever interpreter launched it)."""
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == int(port) and c.pid:
            return c.pid
    raise AssertionError(f"nothing listens on port {port}")


def run_env(marker):
    """Environment for a subprocess run of train.py: the session's, without RAY_ADDRESS (the run starts its own Ray),
    with `SLIME_TEST_RUN`=`marker` so that everything the run starts can be found afterwards."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env[RUN_KEY] = str(marker)
    return env


def stop_run(proc, marker, timeout=30):
    """Cleanup after a subprocess run, whatever happened: kill the driver if it still runs, then every process that
    carries the run's marker (its Ray, router, servers), by pid. Returns what had to be killed."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        try:
            proc.wait(timeout)
        except Exception:  # noqa: BLE001  (the sweep below still runs)
            pass
    left = wait_none_carrying(RUN_KEY, str(marker), timeout)
    described = describe(left)
    kill(left)
    return described


def wait_for_line(proc, prefix, timeout):
    """Read `proc.stdout` (text) until a line starts with `prefix`: True, or False when the process closed its output
    or `timeout` passed first. A thread keeps reading the output afterwards, so the process never blocks on a full
    pipe; every line read, before and after, is in `proc.lines` (for failure messages)."""
    proc.lines, seen, closed = [], threading.Event(), threading.Event()

    def pump():
        for line in proc.stdout:
            proc.lines.append(line)
            if line.startswith(prefix):
                seen.set()
        closed.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.time() + timeout
    while not seen.is_set() and not closed.is_set() and time.time() < deadline:
        seen.wait(0.2)
    return seen.is_set()


def tail(proc, n=3000):
    """The last `n` characters `wait_for_line` read from `proc`."""
    return "".join(proc.lines)[-n:]


def run(cmd, timeout, **kwargs):
    """`subprocess.run(cmd, capture_output=True, text=True)` that, on timeout, kills the command's whole process group
    (torchrun's ranks, a script's python), not the command alone, and then raises `TimeoutExpired`."""
    with subprocess.Popen(
        cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@contextlib.contextmanager
def preimporting_server(what, *module_argv):
    """`python -m MODULE ARGS SOCKET`, a server that imports what its clients need once and then forks them, ready on
    a unix socket in a new directory: yields (process, directory, socket); killed and removed afterwards."""
    work = tempfile.mkdtemp(prefix="zygote", dir="/tmp")  # a unix socket path must stay short
    sock = os.path.join(work, "s")
    server = subprocess.Popen(
        [sys.executable, "-m", *module_argv, sock],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert wait_for_line(server, "ready", 300), f"{what} did not start within 300s:\n" + tail(server)
        yield server, work, sock
    finally:
        server.kill()
        server.wait(30)
        shutil.rmtree(work, ignore_errors=True)
