"""Test-session environment: offline HF, loopback-only Ray, one torch thread, one Ray session, one tiny kit."""

import os
import tempfile
import uuid

_HF_HOME = tempfile.mkdtemp(prefix="slime-hf-home-")
for k, v in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HOME": _HF_HOME,
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # must precede `import ray`: binds every Ray listener to 127.0.0.1
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "offline",
    "SLIME_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
}.items():
    os.environ.setdefault(k, v)
# Marks every process this session starts (tests/_procs.py): set before any of them, never inherited from a caller.
os.environ["SLIME_TEST_SESSION"] = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import _procs  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running():
    """After the last test (and every other fixture's teardown, this one being set up first): no process that this
    session started is still running — Ray's daemons and workers, routers, inference servers and subprocess runs
    included, wherever they were reparented. Those found are killed, and the session fails naming them."""
    yield
    key, value = _procs.SESSION_KEY, os.environ[_procs.SESSION_KEY]
    left = _procs.wait_none_carrying(key, value, timeout=60, include_interpreter_helpers=False)
    described = _procs.describe(left)
    _procs.kill(left)
    assert not described, "processes started by this test session still ran after it:\n" + "\n".join(described)


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory):
    """(model_dir, data_dir) of the tiny offline Qwen3 kit, built once per test session."""
    from tools.build_tiny_kit import build_data, build_model

    root = tmp_path_factory.mktemp("tiny_kit")
    model_dir, data_dir = str(root / "qwen3-tiny"), str(root / "addition")
    build_model(model_dir)
    build_data(data_dir)
    return model_dir, data_dir


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray with 4 logical GPUs for the whole test session."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=8,
            num_gpus=4,
            include_dashboard=False,
            object_store_memory=1 << 30,
            log_to_driver=True,
            _temp_dir=tempfile.mkdtemp(prefix="ray", dir="/tmp"),
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def mpu_world1(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    assert not dist.is_initialized(), "another test left torch.distributed initialised in this process"
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    yield
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
