"""Test-session environment: offline HF, loopback-only Ray, one torch thread, one Ray session, one tiny kit."""

import os
import tempfile

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

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


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
