"""The fork server the test session's Ray workers and CPU inference servers come from (tests/_ray_zygote.py): its
client must stand in for the program exactly, or a test would read a wrong exit status or leave a process behind."""

import signal
import subprocess

import psutil

from tests import _ray_zygote

PROGRAM = "import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(float(sys.argv[1]))\nsys.exit(int(sys.argv[2]))\n"


def _start(tmp_path, *argv):
    (tmp_path / "prog.py").write_text(PROGRAM)
    server, sock = _ray_zygote.shared()
    client = subprocess.Popen(
        [*_ray_zygote.command(sock), *argv], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = client.stdout.readline()
    assert line, f"the program did not start: {client.stderr.read()}"
    child = psutil.Process(int(line))
    assert child.pid != client.pid and child.ppid() == server.pid  # forked by the server, not run by the client
    return client, child


def test_the_client_exits_with_the_programs_code_as_a_script_and_as_a_module(tmp_path):
    for argv in (["prog.py"], ["-m", "prog"]):
        client, _ = _start(tmp_path, *argv, "0", "3")
        assert client.wait(60) == 3, client.stderr.read()


def test_a_child_killed_by_a_signal_is_reported_as_killed(tmp_path):
    client, child = _start(tmp_path, "prog.py", "60", "0")
    child.kill()
    assert client.wait(60) == -signal.SIGKILL


def test_signals_reach_the_child_and_a_killed_client_takes_the_child_with_it(tmp_path):
    client, child = _start(tmp_path, "prog.py", "60", "0")
    client.send_signal(signal.SIGTERM)  # passed on: the program dies of it
    assert client.wait(60) == -signal.SIGKILL and not child.is_running()
    client, child = _start(tmp_path, "prog.py", "60", "0")
    client.kill()
    client.wait(60)
    child.wait(30)  # psutil.TimeoutExpired if the child outlives its client


def test_a_stopped_child_dies_with_its_client(tmp_path):
    """A stopped child cannot run its lifeline thread (the fault tests stop a server to hang it): the server kills
    it once its client is gone."""
    client, child = _start(tmp_path, "prog.py", "60", "0")
    child.send_signal(signal.SIGSTOP)
    client.kill()
    client.wait(60)
    child.wait(30)  # psutil.TimeoutExpired if the child outlives its client


def test_a_child_that_exits_while_orphans_are_swept_does_not_stop_the_server(monkeypatch):
    """The server lists its children, then kills the orphans among them: one that exits in between (a run's servers
    dying together) must not end its loop, or every later client would find no server and run the program itself."""
    import psutil

    proc = subprocess.Popen(["sleep", "60"])
    gone = psutil.Process(proc.pid)
    proc.kill()
    proc.wait()  # reaped: killing it now raises NoSuchProcess, as for a child that exited after the listing
    monkeypatch.setattr(psutil.Process, "children", lambda self, recursive=False: [gone])
    workers = {}
    _ray_zygote._kill_orphans(workers)
    assert workers == {}
