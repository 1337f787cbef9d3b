"""Disk weight sync (`--update-weight-transport disk`) when its writer dies: the trainer is killed (SIGKILL) while it
writes a version for an external engine (a CPU server the test started, so it outlives the run). The torn version is
never published nor loaded, and the run resumed with `--load` publishes its first version in full (delta mode: the
engine's local checkpoint is not assumed to hold any base), then goes on to the end with deltas on it.

The trainer's weights come from `--save-hf` copies (one per rollout): version V is the policy after rollout V - 2
(version 1 is the initial push, after rollout r comes version r + 2)."""

import json
import os
import signal
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

import train as sync_driver
from slime.utils import disk_delta
from tests.test_cpu_server import start_cpu_server, stop_cpu_server
from tests.test_e2e import make_args, read_metrics
from tests.test_fault_tolerance import trainer_pids

pytestmark = pytest.mark.slow  # tier: cluster (tests/conftest.py)

PARAM = "model.layers.0.mlp.down_proj.weight"
NUM_ROLLOUT = 5  # versions 1..6


def hf_tensors(path) -> dict:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def served(url, name, numel) -> torch.Tensor:
    """The engine's current tensor `name` (flattened), as it serves it."""
    r = requests.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": numel}, timeout=30)
    return torch.tensor(r.json(), dtype=torch.float32)


def index_metadata(root, version) -> dict:
    with open(root / disk_delta.version_name(version) / disk_delta.INDEX) as f:
        return json.load(f)["metadata"]


def assert_engine_holds(url, trainer_weights, version):
    assert requests.get(f"{url}/model_info", timeout=10).json()["weight_version"] == str(version)
    expected = trainer_weights[PARAM].reshape(-1)
    assert torch.equal(served(url, PARAM, expected.numel()), expected)


def kill_trainer_mid_version(root, first_version, last_version, run_over, caught):
    """SIGKILL the trainers while `.weight_vN.partial` exists and `weight_vN` does not (N in the given range). The
    trainers are stopped (SIGSTOP) the moment the partial directory shows, then checked: a version that got published
    meanwhile is let go (SIGCONT) and the next one is tried."""
    tried, pids = set(), []
    while not run_over.is_set():
        for partial in root.glob(".weight_v*.partial") if root.is_dir() else ():
            # the trainers are looked up at the first version they write (version 1, before the range): scanning
            # every process's environment takes longer on a loaded machine than writing a tiny version, so doing it
            # once a target partial shows would let it be published before the SIGSTOP, every time
            pids = pids or trainer_pids()
            version = int(partial.name[len(".weight_v") : -len(".partial")])
            if version in tried or not first_version <= version <= last_version:
                continue
            tried.add(version)
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            if partial.is_dir() and not (root / disk_delta.version_name(version)).exists():
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                caught["version"] = version
                return
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.001)


@pytest.mark.parametrize("mode", ["delta", "full"])
def test_writer_killed_mid_version_torn_version_never_loaded_and_resumed_run_starts_full(
    ray_session, tiny_kit, tmp_path, mode
):
    proc, url = start_cpu_server(tiny_kit[0])
    try:
        _run_killed_then_resumed(tiny_kit, tmp_path, mode, proc, url)
    finally:
        stop_cpu_server(proc)


def _run_killed_then_resumed(tiny_kit, tmp_path, mode, proc, url):
    root, local, ckpt, hf = tmp_path / "versions", tmp_path / "local", tmp_path / "ckpt", tmp_path / "hf"
    local_flags = ["--update-weight-local-checkpoint-dir", str(local)] if mode == "delta" else []
    common = [
        *["--rollout-num-gpus", "0", "--rollout-external-engine-addrs", url.split("//")[1]],
        *["--update-weight-transport", "disk", "--update-weight-disk-dir", str(root), "--update-weight-mode", mode],
        *local_flags,
        *["--update-weight-disk-keep-files", "--save", str(ckpt), "--save-interval", "1"],
        *["--save-hf", str(hf / "iter_{rollout_id}")],
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()

    # run 1: killed while writing version N (3 <= N <= 5: at least one delta loaded before, one rollout after)
    caught, run_over = {}, threading.Event()
    killer = threading.Thread(target=kill_trainer_mid_version, args=(root, 3, 5, run_over, caught), daemon=True)
    killer.start()
    try:
        with pytest.raises(RuntimeError, match="trainer rank 0 died"):
            sync_driver.train(make_args(tiny_kit, first, *common, num_rollout=NUM_ROLLOUT))
    finally:
        run_over.set()
        killer.join(5)
    assert "version" in caught, "the trainer was not caught writing a version"
    torn = caught["version"]
    # the torn version exists only as its partial directory; the engine still serves the one before it
    names = [disk_delta.version_name(v) for v in range(1, torn)]
    assert sorted(os.listdir(root)) == [f".{disk_delta.version_name(torn)}.partial", *names]
    assert_engine_holds(url, hf_tensors(hf / f"iter_{torn - 3}"), torn - 1)
    if mode == "delta":
        assert disk_delta.held_version(str(local)) == torn - 1
    # checkpoint N - 2 was saved before version N's push: the resumed run starts at rollout N - 1
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(torn - 2)

    # run 2: resumed; its first push is version N again, in full, then deltas (delta mode) to the end
    sync_driver.train(make_args(tiny_kit, second, *common, "--load", str(ckpt), num_rollout=NUM_ROLLOUT))
    rows = read_metrics(second)
    assert [r["rollout_id"] for r in rows] == list(range(torn - 1, NUM_ROLLOUT))
    assert [int(r["rollout/weight_version"]) for r in rows] == list(range(torn, NUM_ROLLOUT + 1))
    last = NUM_ROLLOUT + 1
    assert sorted(os.listdir(root)) == [disk_delta.version_name(v) for v in range(1, last + 1)]
    full_versions = {1, torn} if mode == "delta" else set(range(1, last + 1))
    for v in range(1, last + 1):
        meta = index_metadata(root, v)
        if v in full_versions:
            assert "delta_encoding" not in meta, (v, meta)
        else:
            assert meta["delta_encoding"] == "xor" and meta["base_version"] == f"{v - 1:06d}", (v, meta)
    final = hf_tensors(hf / f"iter_{NUM_ROLLOUT - 1}")
    assert_engine_holds(url, final, last)
    if mode == "delta":
        assert disk_delta.held_version(str(local)) == last
        got = hf_tensors(local)
        assert sorted(got) == sorted(final)
        assert all(torch.equal(got[n], final[n]) for n in final)
    assert proc.poll() is None, "slime stopped a server it did not start"
