"""`python3 -m MODULE ...` from a pre-imported interpreter, for the scripts a test runs only to validate arguments.

Each dry run of a launch script starts a fresh interpreter that spends seconds importing torch, Megatron and slime
to parse one command line. Here a server process imports them once (PRELOAD); a `python3` shim placed first on the
script's PATH sends each `python3 -m MODULE ...` call (and `python3 SCRIPT ...` for SCRIPTS) with its arguments,
environment, working directory and stdin/stdout/stderr to the server, which forks a child that runs the module as
`__main__` with them, and the shim exits with the child's status. Any other call, or any call when no server
answers, runs the real interpreter. The script itself runs unchanged: only the interpreter's start is shared.

Standard library only: the shim imports this file with `python -S`.
"""

import json
import os
import socket
import struct
import sys

MODULES = ("slime.utils.arguments",)  # what `-m` the server runs
SCRIPTS = ("tools/plot_metrics.py",)  # and which of the repository's scripts
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what it imports first: MODULES and what parsing imports on first use (HF configs, the router's flags, reward models)
PRELOAD = (
    "slime.utils.arguments",
    "slime.rollout.rm_hub",
    "sglang_router.router_args",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
    "slime.utils.data",
    "slime.backends.megatron_utils.megatron_to_hf",  # megatron-core, which the weight-sync checks import
    "matplotlib.pyplot",  # under Agg, the backend plot_metrics.py selects
)
ENV_KEY = "SLIME_TEST_ZYGOTE"  # the server's socket path, in the environment of the scripts a test runs


def _send(conn, payload, fds=()):
    data = json.dumps(payload).encode()
    socket.send_fds(conn, [struct.pack("!I", len(data))], list(fds))
    conn.sendall(data)


def _recv(conn, maxfds=0):
    head, fds, _, _ = socket.recv_fds(conn, 4, maxfds)
    (size,) = struct.unpack("!I", head)
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("zygote: connection closed mid-message")
        data += chunk
    return json.loads(data), fds


def run_as_main(request, base_path):
    """Run the request's `script` or `module` as `__main__` in this (forked) process, with its arguments, working
    directory and environment, as a fresh interpreter would; returns the exit code that interpreter would give."""
    import runpy
    import traceback

    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # as a fresh `python -m` sees it: the working directory, then PYTHONPATH, then the installed packages
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        if "script" in request:  # `python3 path/to/script.py`: the script's directory comes first
            sys.path[:] = [os.path.dirname(request["script"]), *extra, *base_path]
            sys.argv = [request["script"], *request["args"]]
            runpy.run_path(request["script"], run_name="__main__")
        else:  # `python3 -m module`: the working directory comes first
            sys.path[:] = [request["cwd"], *extra, *base_path]
            sys.argv = [request["module"], *request["args"]]
            # a fresh interpreter has not imported the module it runs as __main__ (runpy warns when it finds it)
            sys.modules.pop(request["module"], None)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (reported as the interpreter would, then exit 1)
        traceback.print_exc()
        return 1


def flush_stdio():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


def _run_child(request, fds, base_path):
    """In the forked child: become `python3 -m MODULE ARGS` run in CWD with ENV and the caller's stdio; never returns."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        code = run_as_main(request, base_path)
    finally:
        flush_stdio()
        os._exit(code)


def serve(path):
    """The server: import PRELOAD, listen on the unix socket `path`, run one call at a time in a forked child."""
    import importlib

    os.environ["MPLBACKEND"] = "Agg"
    for name in PRELOAD:
        importlib.import_module(name)
    pythonpath = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    base_path = [p for p in sys.path[1:] if p not in pythonpath]
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            try:
                request, fds = _recv(conn, maxfds=3)
            except (ConnectionError, OSError, ValueError):
                continue
            if (request.get("module") not in MODULES and request.get("script") not in _scripts()) or len(fds) != 3:
                for fd in fds:
                    os.close(fd)
                _send(conn, {"served": False})
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _run_child(request, fds, base_path)
            for fd in fds:
                os.close(fd)
            _, status = os.waitpid(pid, 0)
            name = request.get("module") or os.path.relpath(request["script"], ROOT)
            print(f"served {name} {os.waitstatus_to_exitcode(status)}", flush=True)
            try:
                _send(conn, {"served": True, "status": os.waitstatus_to_exitcode(status)})
            except OSError:  # the caller is gone (killed on its timeout): nothing to answer
                pass


def _scripts():
    return {os.path.join(ROOT, s) for s in SCRIPTS}


def shim(real_python, argv):
    """The `python3` shim: serve `-m MODULE ...` or `SCRIPT ...` through the server when it answers, else exec the
    real interpreter."""
    path, request = os.environ.get(ENV_KEY), None
    if len(argv) >= 2 and argv[0] == "-m" and argv[1] in MODULES:
        request = {"module": argv[1], "args": argv[2:]}
    elif argv and os.path.realpath(argv[0]) in _scripts():
        request = {"script": os.path.realpath(argv[0]), "args": argv[1:]}
    if path and request:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(path)
                request.update(cwd=os.getcwd(), env=dict(os.environ))
                _send(conn, request, fds=(0, 1, 2))
                reply, _ = _recv(conn)
            if reply["served"]:
                status = reply["status"]
                sys.exit(status if status >= 0 else 128 - status)
        except (ConnectionError, FileNotFoundError, OSError, ValueError):
            pass  # no server: the real interpreter below
    os.execv(real_python, [real_python, *argv])


SHIM = """#!{python} -S
import sys
sys.path.insert(0, {root!r})
from tests._zygote import shim
shim({python!r}, sys.argv[1:])
"""


def write_shim(bin_dir, python=sys.executable):
    """Write the `python3` (and `python`) shim into `bin_dir`; returns `bin_dir`."""
    os.makedirs(bin_dir, exist_ok=True)
    for name in ("python3", "python"):
        shim_path = os.path.join(bin_dir, name)
        with open(shim_path, "w") as f:
            f.write(SHIM.format(python=python, root=ROOT))
        os.chmod(shim_path, 0o755)
    return bin_dir


if __name__ == "__main__":
    serve(sys.argv[1])
