"""A plugin the driver imports through the user's PYTHONPATH is importable in every actor, also when the run joins a
Ray cluster started separately (`ray start --head`, then `RAY_ADDRESS=... python train.py`, as slime's launch scripts
do), whose workers inherit the cluster's environment, not the driver's."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from slime.ray.utils import driver_import_path, driver_runtime_env
from slime.utils.http_utils import free_port
from tests import _procs
from tests.test_e2e import read_metrics, train_py_argv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_driver_import_path_lists_pythonpath_entries_then_cwd_then_the_workers_own(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"rel{os.pathsep}/abs/one{os.pathsep}{os.pathsep}/abs/one")
    assert driver_import_path() == os.pathsep.join([f"{tmp_path}/rel", "/abs/one", str(tmp_path), "${PYTHONPATH}"])


def test_a_submitted_jobs_own_env_vars_win(monkeypatch):
    """Under `ray job submit --runtime-env-json`, Ray refuses a variable set both there and in ray.init."""
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"env_vars": {"PYTHONPATH": "/x"}}}))
    assert driver_runtime_env({"PYTHONPATH": "/y", "RAY_DEDUP_LOGS": "0"}) == {"env_vars": {"RAY_DEDUP_LOGS": "0"}}
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert driver_runtime_env({"PYTHONPATH": "/y"}) == {"env_vars": {"PYTHONPATH": "/y"}}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_plugin_on_the_drivers_pythonpath_runs_in_the_trainer_and_rollout_actors_of_a_joined_cluster(
    tiny_kit, tmp_path
):
    plugins = tmp_path / "plugins"  # neither the repo nor the driver's cwd
    plugins.mkdir()
    marks = tmp_path / "marks"
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
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short (unix socket paths)
    port = free_port()
    env = _procs.run_env(tmp_path)  # the cluster's processes and the run's carry it
    cluster_env = dict(env, PYTHONPATH=REPO)  # the cluster's workers find slime, not the plugin
    proc = None
    try:
        subprocess.run(
            [ray_bin, "start", "--head", f"--port={port}", "--num-gpus=2", "--num-cpus=8",
             "--include-dashboard=false", f"--temp-dir={temp_dir}", "--disable-usage-stats"],
            env=cluster_env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        argv = train_py_argv(
            tiny_kit, 1,
            "--custom-megatron-before-train-step-hook-path", "my_site_hooks.before_train_step",
            "--custom-rm-path", "my_site_hooks.reward", "--metrics-path", str(tmp_path / "metrics.jsonl"),
        )  # fmt: skip
        proc = subprocess.Popen(
            [sys.executable, "train.py", *argv],
            cwd=REPO,
            env=dict(env, RAY_ADDRESS=f"127.0.0.1:{port}", PYTHONPATH=f"{REPO}{os.pathsep}{plugins}"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out, _ = proc.communicate(timeout=360)  # inside the test's own timeout, so the cluster is always stopped
        assert proc.returncode == 0, out[-5000:]
        assert "Connected to Ray cluster" in out  # joined, did not start its own
        assert len(read_metrics(tmp_path)) == 1
        pids = {name.split("-")[1] for name in os.listdir(marks)}
        kinds = {name.split("-")[0] for name in os.listdir(marks)}
        assert kinds == {"train", "reward"}
        assert str(proc.pid) not in pids  # called in the actors, not in the driver
    finally:
        _procs.stop_run(proc, tmp_path, timeout=0)  # the cluster, by pid: never `ray stop`, which stops every Ray
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert _procs.wait_none_carrying(_procs.RUN_KEY, str(tmp_path), 30) == []
