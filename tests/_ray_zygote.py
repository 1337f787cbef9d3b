"""Ray's Python workers forked from a pre-imported interpreter, for the test session's in-process runs.

Every run starts a handful of Ray actors (a trainer per rank, the rollout controller, one actor per engine), each a
fresh interpreter that spends seconds importing torch, transformers and Megatron before it does anything: on the
2-core test machine most of a short run's CPU. Here one server imports them once (PRELOAD), and the test session's
Ray starts every worker through `py_executable` (a runtime-env field Ray reads for exactly this: how to run a worker)
as this file's client. The client sends its arguments (Ray's own `default_worker.py ...`), environment, working
directory and stdin/stdout/stderr to the server, which forks a child that runs the worker with them; the client stays
as the process Ray started, passes signals on, and exits when the worker does. The worker itself runs unchanged: only
the interpreter's start is shared. Ray is not pre-imported, so nothing it reads from the worker's environment at
import time comes from the server's.

If the client is killed (SIGKILL included), the worker dies with it: it holds the read end of a pipe whose only
writer is the client. What a worker leaves behind when it dies (a Megatron checkpoint's writer processes, say) Ray's
raylet would kill, as it adopts a dead worker's children; here they are adopted by the server instead (a subreaper),
which kills them. A worker's `/proc/PID/environ` is the server's (the test session's marker included, so
tests/_procs.py finds it); its `os.environ` is the client's. Standard library only in the client: Ray runs it with
`python -S`.
"""

import os
import select
import signal
import socket
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests._zygote import _recv, _send  # noqa: E402

PRELOAD = ("torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt")
_PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _die_with(lifeline):
    """In the worker: a thread that kills this process once the client's end of `lifeline` closes."""

    def watch():
        while os.read(lifeline, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="ray-zygote-lifeline").start()


def _run_worker(request, fds, base_path):
    """In the forked child: become `python SCRIPT ARGS` with the client's environment, directory and stdio."""
    import runpy

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server reaps its children; a worker waits for its own
    *stdio, lifeline = fds
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    _die_with(lifeline)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(request["script"]), *extra, *base_path]
    sys.argv = [request["script"], *request["args"]]
    try:
        runpy.run_path(request["script"], run_name="__main__")
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()


def _kill_orphans(workers):
    """Kill the server's children that it did not fork: descendants of dead workers, adopted by this subreaper."""
    import psutil

    for child in psutil.Process().children():
        if child.pid not in workers:
            child.kill()
    workers.intersection_update(c.pid for c in psutil.Process().children())


def serve(path):
    """The server: import PRELOAD, then fork one worker per connection on the unix socket `path` (never waiting on
    one: they live as long as Ray keeps them)."""
    import ctypes
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, "the zygote must fork from a single thread"
    pythonpath = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    base_path = [p for p in sys.path[1:] if p not in pythonpath]
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they exit
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)
    workers = set()
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
                request, fds = _recv(conn, maxfds=4)
            except (ConnectionError, OSError, ValueError):
                continue
            if len(fds) != 4:
                for fd in fds:
                    os.close(fd)
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                code = 1
                try:
                    _run_worker(request, fds, base_path)
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                except BaseException:  # noqa: BLE001  (reported as the interpreter would)
                    import traceback

                    traceback.print_exc()
                import atexit

                atexit._run_exitfuncs()  # as the interpreter does at exit (Ray's own shutdown among them)
                os._exit(code)
            workers.add(pid)
            for fd in fds:
                os.close(fd)
            try:
                _send(conn, {"pid": pid})
            except OSError:  # the client is gone: its worker dies with the lifeline
                pass


def client(path, argv):
    """Ray's worker command: have the server fork the worker, then stand in for it until it exits; without a
    server, run the real interpreter."""
    lifeline_r, lifeline_w = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(path)
            request = {
                "script": os.path.abspath(argv[0]),
                "args": argv[1:],
                "cwd": os.getcwd(),
                "env": dict(os.environ),
            }
            _send(conn, request, fds=(0, 1, 2, lifeline_r))
            reply, _ = _recv(conn)
    except (ConnectionError, FileNotFoundError, OSError, ValueError):
        os.execv(sys.executable, [sys.executable, *argv])
    os.close(lifeline_r)
    pid = reply["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _frame: os.kill(pid, s))
    try:
        worker = os.pidfd_open(pid)
    except ProcessLookupError:  # it is already gone
        os._exit(0)
    while True:
        try:
            if select.select([worker], [], [])[0]:
                break
        except InterruptedError:
            continue
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        client(sys.argv[1], sys.argv[2:])
