"""Ray helpers the driver and its actors share: the env that lets GPU actors see every device of their node, and the
Lock that keeps weight updates from overlapping. The driver-side pieces (cleanup, watchdog, run recorder) live in
`slime.ray.driver` and are re-exported here, so their `slime.ray.utils` paths keep working."""

import ray

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
