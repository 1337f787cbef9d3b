"""Python processes forked from a pre-imported interpreter: the test session's Ray workers and CPU inference servers.

Every run starts a handful of Ray actors (a trainer per rank, the rollout controller, one actor per engine), each a
fresh interpreter that spends seconds importing torch, transformers and Megatron before it does anything: on the
2-core test machine most of a short run's CPU. A CPU inference server that a test starts spends three more seconds on
torch and transformers. Here one server imports them once (PRELOAD). The test session's Ray starts every worker
through `py_executable` (a runtime-env field Ray reads for exactly this: how to run a worker) as this file's client,
and `tests/test_cpu_server.py`'s `start_cpu_server` runs `python -m slime.backends.cpu_server` through it too. The
client sends its arguments (a script and its arguments, or `-m MODULE ...`), environment, working directory and
stdin/stdout/stderr to the server, which forks a child that runs them; the client stays as the process its caller
started, passes signals on, and exits as the child did (its exit code, or SIGKILL for a child a signal killed). The
program itself runs unchanged: only the interpreter's start is shared. Ray is not pre-imported, nor is any slime
module but the package itself, so nothing they read from the environment at import time comes from the server's;
`import slime` comes first, as in every slime process, because it decides how megatron-core is imported (on CPU,
its fused helpers run eagerly: `slime.utils.device.eager_megatron_fusions`).

If the client is killed (SIGKILL included), the child dies with it: it holds the read end of a pipe whose only
writer is the client. What a worker leaves behind when it dies (a Megatron checkpoint's writer processes, say) Ray's
raylet would kill, as it adopts a dead worker's children; here they are adopted by the server instead (a subreaper),
which kills them. A child's `/proc/PID/environ` is the server's (the test session's marker included, so
tests/_procs.py finds it); its `os.environ` is the client's. Standard library only in the client: it runs with
`python -S`.
"""

import contextlib
import json
import os
import select
import shlex
import signal
import socket
import struct
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests._zygote import _recv, _send, flush_stdio, run_as_main  # noqa: E402

# what every worker or server imports on first use: torch's optimizers import torch._dynamo (0.75 s), the controller
# and servers transformers' auto classes (0.6 s) and aiohttp (0.5 s, with requests), measured on the 2-core machine
PRELOAD = (
    "slime",
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "transformers",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "megatron.core",
    "megatron.core.models.gpt",
    "aiohttp",
    "requests",
)
_PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _die_with(lifeline):
    """In the worker: a thread that kills this process once the client's end of `lifeline` closes."""

    def watch():
        while os.read(lifeline, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="ray-zygote-lifeline").start()


def _child(request, fds, base_path):
    """The forked child's whole life: become `python SCRIPT ARGS` or `python -m MODULE ARGS` with the client's
    environment, directory and stdio, then exit as the interpreter would, the exit code sent to the client first."""
    import atexit

    *stdio, lifeline, status = fds
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server reaps its children; a child waits for its own
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)
            os.close(fd)
        _die_with(lifeline)
        code = run_as_main(request, base_path)
        atexit._run_exitfuncs()  # as the interpreter does at exit (Ray's own shutdown among them)
    finally:
        flush_stdio()
        os.write(status, str(code).encode())
        os._exit(code)


def _gone(pid):
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_orphans(workers):
    """Kill the server's children that it did not fork (descendants of dead workers, adopted by this subreaper) and
    the workers whose client is gone: a worker dies with its client through the lifeline thread, but one that is
    stopped (SIGSTOP, as the fault tests do to hang a server) cannot run it."""
    import psutil

    for child in psutil.Process().children():
        if child.pid not in workers or _gone(workers[child.pid]):
            # it may have exited since it was listed: an uncaught NoSuchProcess would end the server's loop
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
    alive = {c.pid for c in psutil.Process().children()}
    for pid in [p for p in workers if p not in alive]:
        del workers[pid]


def serve(path):
    """The server: import PRELOAD, then fork one worker per connection on the unix socket `path` (never waiting on
    one: they live as long as Ray keeps them)."""
    import ctypes
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, "the zygote must fork from a single thread"
    # the preloaded objects (~400,000) leave the cyclic collector's sight in every child: each child's collections,
    # slime's start-up gc.collect() among them (0.25 s), scan only what the child made
    gc.collect()
    gc.freeze()
    pythonpath = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    base_path = [p for p in sys.path[1:] if p not in pythonpath]
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they exit
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    workers = {}  # pid of each child it forked -> pid of the client it stands in for
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    server.settimeout(1.0)
    print("ready", flush=True)
    while True:
        _kill_orphans(workers)
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        with conn:
            try:
                request, fds = _recv(conn, maxfds=5)
            except (ConnectionError, OSError, ValueError):
                continue
            if len(fds) != 5:
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _child(request, fds, base_path)
            workers[pid] = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            for fd in fds:
                os.close(fd)
            try:
                _send(conn, {"pid": pid})
            except OSError:  # the client is gone: its worker dies with the lifeline
                pass


def client(path, argv):
    """Run `argv` (`SCRIPT ARGS` or `-m MODULE ARGS`) in a child of the server and stand in for it until it exits;
    without a server, run the real interpreter."""
    lifeline_r, lifeline_w = os.pipe()
    status_r, status_w = os.pipe()
    if argv[0] == "-m":
        request = {"module": argv[1], "args": argv[2:]}
    else:
        request = {"script": os.path.abspath(argv[0]), "args": argv[1:]}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            request.update(cwd=os.getcwd(), env=dict(os.environ))
            _send(conn, request, fds=(0, 1, 2, lifeline_r, status_w))
            reply, _ = _recv(conn)
    except (ConnectionError, FileNotFoundError, OSError, ValueError):
        os.execv(sys.executable, [sys.executable, *argv])
    os.close(lifeline_r)
    os.close(status_w)
    pid = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _frame: os.kill(pid, s))
    with contextlib.suppress(ProcessLookupError):  # else it is gone already
        child = os.pidfd_open(pid)
        while True:
            try:
                if select.select([child], [], [])[0]:
                    break
            except InterruptedError:
                continue
    os.set_blocking(status_r, False)
    try:
        code = int(os.read(status_r, 16))
    except (BlockingIOError, ValueError):  # it wrote no code: a signal killed it
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)


def command(sock):
    """The interpreter command that runs a program through the server on `sock` (its arguments follow)."""
    return [sys.executable, "-S", os.path.abspath(__file__), sock]


_shared = contextlib.ExitStack()
_server = None


def shared():
    """(process, socket) of this test process's server, started on first use (stopped by `stop_shared`)."""
    global _server
    if _server is None:
        from tests._procs import preimporting_server

        process, _, sock = _shared.enter_context(preimporting_server("the fork server", "tests._ray_zygote", "serve"))
        _server = process, sock
    return _server


def job_env():
    """Environment for a train.py the test runs as a subprocess: the job config that `ray job submit` hands a driver
    (Ray merges its runtime env into the driver's `ray.init`), so that the run's Ray workers and CPU servers start
    through this process's server too."""
    launcher = command(shared()[1])
    runtime_env = {"py_executable": " ".join(launcher), "env_vars": {"SLIME_SERVER_PYTHON": shlex.join(launcher)}}
    return {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": runtime_env})}  # the variable's name is itself


def stop_shared():
    global _server
    _shared.close()
    _server = None


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[1], sys.argv[2:])
