import ray

NOSET_VISIBLE_DEVICES_ENV_VARS_LIST = [
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
]


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
