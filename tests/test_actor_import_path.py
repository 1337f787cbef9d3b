"""A plugin the driver imports through the user's PYTHONPATH is importable in every actor, also when the run joins a
Ray cluster started separately (`ray start --head`, then `RAY_ADDRESS=... python train.py`, as slime's launch scripts
do), whose workers inherit the cluster's environment, not the driver's: the runtime environment the driver passes.
The whole path, a plugin loaded in the trainer and rollout actors of a joined cluster, runs in tests/test_two_nodes.py."""

import json
import os

from slime.ray.utils import driver_import_path, driver_runtime_env


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
