"""Ray helpers the driver and its actors share: the env that lets GPU actors see every device of their node, and the
Lock that keeps weight updates from overlapping. The driver-side pieces (cleanup, watchdog, run recorder) live in
`slime.ray.driver` and are re-exported here, so their `slime.ray.utils` paths keep working."""

import json
import os

import ray
from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

from slime.ray.driver import (  # noqa: F401  (re-exported)
    CLEANUP_STEP_TIMEOUT_S,
    RunRecorder,
    Watchdog,
    cleanup_on_exit,
    register_cleanup,
)

NOSET_VISIBLE_DEVICES_ENV_VARS_LIST = [
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
]


def noset_visible_devices_env() -> dict:
    """Env vars that stop Ray from narrowing CUDA_VISIBLE_DEVICES: an actor sees every GPU of its node."""
    return {name: "1" for name in NOSET_VISIBLE_DEVICES_ENV_VARS_LIST}


def driver_import_path() -> str:
    """PYTHONPATH for every actor: the driver's PYTHONPATH entries and current directory (absolute), then the worker's
    own PYTHONPATH (Ray expands `${PYTHONPATH}` in each worker). Ray itself passes only the script's directory and the
    current directory, so a plugin found through the user's PYTHONPATH would pass the driver's start-up check and
    then fail to import in an actor of a cluster started elsewhere (`ray start`)."""
    entries = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    entries.append(os.getcwd())
    return os.pathsep.join([*dict.fromkeys(entries), "${PYTHONPATH}"])


def driver_runtime_env(env_vars: dict) -> dict:
    """`ray.init`'s runtime env: `env_vars` less those a submitted job's runtime env (`ray job submit
    --runtime-env-json`) already sets, which win (Ray refuses to merge one variable from both)."""
    job = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
    job_env = (job.get("runtime_env") or {}).get("env_vars") or {}
    return {"env_vars": {k: v for k, v in env_vars.items() if k not in job_env}}


@ray.remote(num_cpus=0)
class Lock:
    """Non-blocking lock: no weight broadcast into the engines while another source rank holds them."""

    def __init__(self):
        self.locked = False

    def acquire(self) -> bool:
        if self.locked:
            return False
        self.locked = True
        return True

    def release(self) -> None:
        assert self.locked, "Lock.release() called while the lock is not held"
        self.locked = False
