"""A real two-node Ray cluster on one machine: the head node on 127.0.0.2 (trainers and the driver), a second node on
127.0.0.3 (the inference engine), every address a loopback one. The whole loop runs across the two nodes: placement,
per-node ports, the router reaching the engine by its node IP, weight sync over the broadcast group (shared memory is
never chosen across nodes), and both nodes stop cleanly afterwards. The run joins the cluster as slime's launch
scripts do (`ray start`, then `RAY_ADDRESS=... python train.py`), so its actors inherit the cluster's environment, not
the driver's: a plugin the driver imports through the user's PYTHONPATH must still load in the trainer and rollout
actors."""

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from slime.utils.http_utils import find_available_port
from tests import _procs
from tests.test_e2e import train_py_argv

pytestmark = pytest.mark.slow  # tier: cluster (tests/conftest.py)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"


def _can_bind(ip):
    with socket.socket() as s:
        try:
            s.bind((ip, 0))
            return True
        except OSError:
            return False


def _tree(markers):
    """Processes whose command line names one of `markers` (a node's temp dir or address), with their descendants."""
    roots = [
        p for p in psutil.process_iter(["cmdline"]) if any(m in " ".join(p.info["cmdline"] or []) for m in markers)
    ]
    found = {}
    for p in roots:
        for q in [p, *p.children(recursive=True)]:
            found[q.pid] = q
    return list(found.values())


def _listeners(procs):
    """(pid, name, ip, port) of every listening TCP socket of `procs`."""
    pids = {p.pid: p for p in procs}
    out = []
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid in pids:
            try:
                name = pids[c.pid].name()
            except psutil.Error:
                name = "?"
            out.append((c.pid, name, c.laddr.ip, c.laddr.port))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux's 127.0.0.0/8 loopback")
@pytest.mark.timeout(900)  # above its inner waits (2 x 120 s to start the nodes, 480 s for the run)
def test_two_node_cluster_trainers_on_one_node_engines_on_the_other(tiny_kit, tmp_path):
    if not (_can_bind(HEAD_IP) and _can_bind(WORKER_IP)):
        pytest.skip(f"cannot bind {HEAD_IP} / {WORKER_IP} on this machine's loopback")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head_dir = tempfile.mkdtemp(prefix="rayA", dir="/tmp")
    env = {k: v for k, v in _procs.run_env(tmp_path).items() if k != "SLIME_HOST_IP"}  # both nodes carry the marker
    # multi-node Ray on one Linux machine: the node IPs are given explicitly, so none is resolved to the interface
    env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_AUTH_MODE="disabled", GLOO_SOCKET_IFNAME="lo")
    # Ray's dashboard agent serves its Prometheus metrics on every interface unless the node IP is 127.0.0.1 exactly
    # (an HTTP server besides its gRPC one); with metrics collection off it opens no such listener
    env["RAY_enable_metrics_collection"] = "0"
    port = find_available_port(32000)
    markers = [head_dir, f"{HEAD_IP}:{port}", WORKER_IP]  # in the command line of every process of the two nodes
    common = ["--num-gpus=1", "--num-cpus=4", "--disable-usage-stats", "--object-store-memory=500000000"]
    model = shutil.copytree(tiny_kit[0], tmp_path / "model")
    plugins, marks = tmp_path / "plugins", tmp_path / "marks"  # the plugin: neither in the repo nor the driver's cwd
    plugins.mkdir()
    marks.mkdir()
    (plugins / "my_site_hooks.py").write_text(
        textwrap.dedent(f"""
        import os

        def before_train_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
            open(os.path.join({str(marks)!r}, f"train-{{os.getpid()}}"), "w").close()

        async def reward(args, sample, **kwargs):
            open(os.path.join({str(marks)!r}, f"reward-{{os.getpid()}}"), "w").close()
            return 0.0
        """)
    )
    env["PYTHONPATH"] = ROOT  # the cluster's workers find slime, not the plugin
    driver = None
    try:
        subprocess.run(
            [
                ray_bin,
                "start",
                "--head",
                f"--node-ip-address={HEAD_IP}",
                f"--port={port}",
                "--include-dashboard=false",
                f"--temp-dir={head_dir}",
                *common,
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        subprocess.run(
            [ray_bin, "start", f"--address={HEAD_IP}:{port}", f"--node-ip-address={WORKER_IP}", *common],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        argv = train_py_argv(
            tiny_kit, 2, "--metrics-path", str(tmp_path / "metrics.jsonl"),
            "--custom-megatron-before-train-step-hook-path", "my_site_hooks.before_train_step",
            "--custom-rm-path", "my_site_hooks.reward", hf_checkpoint=str(model),
        )  # fmt: skip
        driver = subprocess.Popen(
            [sys.executable, "train.py", *argv],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(
                env, RAY_ADDRESS=f"{HEAD_IP}:{port}", SLIME_HOST_IP=HEAD_IP, PYTHONPATH=f"{ROOT}{os.pathsep}{plugins}"
            ),
        )
        listeners, lines = set(), []
        deadline = time.time() + 480  # inside the test's own timeout, so the cleanup below always runs
        while driver.poll() is None:
            assert time.time() < deadline, "the run did not end in time: " + "".join(lines)[-3000:]
            line = driver.stdout.readline()
            lines.append(line)
            procs = _tree(markers) + [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]
            listeners |= set(_listeners(procs))
        lines += driver.stdout.readlines()
        out = "".join(lines)
        assert driver.returncode == 0, out[-4000:]
        assert sum(1 for _ in open(tmp_path / "metrics.jsonl")) == 2
        assert "Connected to Ray cluster" in out  # joined, did not start its own
        # the plugin ran in the trainer and in the rollout actor, not in the driver
        assert {name.split("-")[0] for name in os.listdir(marks)} == {"train", "reward"}
        assert str(driver.pid) not in {name.split("-")[1] for name in os.listdir(marks)}
        # the engine runs on the second node, behind a router on the head node, and gets weights by broadcast
        assert f"inference engines ['http://{WORKER_IP}:" in out and f"sglang-router http://{HEAD_IP}:" in out, out[
            -3000:
        ]
        assert f"weight sync from {HEAD_IP} to ['http://{WORKER_IP}:" in out and ": broadcast" in out, out[-3000:]
        # no listener of either node or of the driver on a non-loopback address
        specific = [
            (pid, name, ip)
            for pid, name, ip, _ in listeners
            if ip not in ("0.0.0.0", "::") and not ipaddress.ip_address(ip.replace("::ffff:", "")).is_loopback
        ]
        assert not specific, f"listening on a non-loopback address: {specific}"
        # nor on the wildcard address, but for what Ray does not let us change: its gRPC servers (GCS, raylet,
        # dashboard agent, and the core-worker server inside every Ray worker and driver process) listen on the
        # wildcard address whenever the node IP is not 127.0.0.1 exactly. So a wildcard listener may only be a Ray
        # daemon's or the one core-worker server of a worker/driver process; torch's own TCPStore (trainers'
        # rendezvous, weight-update group) would be a second one in the trainer
        ray_daemons = {"gcs_server", "raylet", "ray::DashboardAgent"}
        wildcard, names = {}, {}
        for pid, name, ip, port in listeners:
            names.setdefault(pid, set()).add(name)
            if ip in ("0.0.0.0", "::", "::ffff:0.0.0.0"):
                wildcard.setdefault(pid, set()).add(port)
        extra = {
            pid: (sorted(names[pid]), sorted(ports))
            for pid, ports in wildcard.items()
            if len(ports) > 1 and not names[pid] & ray_daemons
        }
        assert not extra, f"more than Ray's own listener on every interface: {extra}"
        assert any(ip == WORKER_IP for _, _, ip, _ in listeners) and any(ip == HEAD_IP for _, _, ip, _ in listeners)
        # the run exited cleanly on both nodes while the cluster itself stays up: its servers and forked router (their
        # command lines name the model copy) and its actors (Ray workers of the two nodes) are gone
        actors = ("MegatronTrainRayActor", "SGLangEngine", "RolloutController", "Lock")

        def of_the_run():
            return [
                c[:160]
                for c in map(_procs.cmdline, _procs.carrying(_procs.RUN_KEY, str(tmp_path)))
                if str(model) in c or any(f"ray::{a}" in c for a in actors)
            ]

        # Ray ends a finished job's workers on its own, shortly after the driver exits: seconds, but more on a loaded
        # machine (the wait ends as soon as none is left)
        gone_by = time.time() + 90
        while of_the_run() and time.time() < gone_by:
            time.sleep(0.5)
        assert not of_the_run(), f"processes of the run left behind: {of_the_run()}"
    finally:
        if driver is not None and driver.poll() is None:
            driver.kill()
        _stop_cluster(markers)
        _procs.stop_run(None, tmp_path, timeout=0)  # whatever of the two nodes _stop_cluster did not find, by pid
        shutil.rmtree(head_dir, ignore_errors=True)


def _stop_cluster(markers):
    """Stop this test's two Ray nodes only (never `ray stop`, which would stop every Ray on the machine)."""
    procs = {p.pid: p for p in _tree(markers)}
    for p in procs.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    # a few seconds, not more: with its raylets gone, the GCS server and Ray's monitor wait out their own shutdown
    # timeouts on SIGTERM (15 s and more)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=3)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
