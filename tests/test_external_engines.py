"""--rollout-external-engine-addrs: slime drives an inference server it did not start (here slime's CPU server,
started by the test): start-up reads its shape and model, train.py pushes weights to it (broadcast or disk) and
generates with them, train_async.py drives it with delta disk updates, a router the test started is used in place of
slime's own, and the server is still running when the run ends."""

import json
import multiprocessing
import os
import shutil
import threading
import time

import pytest
import requests
import torch
from safetensors.torch import load_file

import train as sync_driver
import train_async as async_driver
from slime.backends.sglang_utils.external import engine_shape, normalize_external_engine_addr, same_model
from slime.backends.sglang_utils.router import list_workers, router_url, start_router, stop_router
from slime.config import parse_args
from slime.utils import disk_delta
from slime.utils.http_utils import find_available_port
from tests._args import make_args as unit_args
from tests.test_cpu_server import start_cpu_server, stop_cpu_server
from tests.test_e2e import TINY_MODEL_ARGS, make_args, read_metrics
from tests.test_fault_tolerance import SAMPLES_PER_ROLLOUT, events_of, faults_done, inject_faults_generate, plan_faults

PARAM = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture
def external_server(tiny_kit):
    proc, url = start_cpu_server(tiny_kit[0])
    yield proc, url
    stop_cpu_server(proc)


def _parse_error(capsys, tiny_kit, hf_checkpoint, *addrs):
    argv = TINY_MODEL_ARGS + [
        "--hf-checkpoint", hf_checkpoint, "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "0",
        "--prompt-data", f"{tiny_kit[1]}/train.jsonl", "--num-rollout", "1", "--rollout-batch-size", "4",
        "--global-batch-size", "4", "--rollout-external-engine-addrs", *addrs,
    ]  # fmt: skip
    with pytest.raises(SystemExit) as e:
        parse_args(argv=argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_shape_and_model_rules():
    assert normalize_external_engine_addr("127.0.2.1:30000") == "http://127.0.2.1:30000"
    assert normalize_external_engine_addr("http://[::1]:30000/") == "http://[::1]:30000"
    for bad in ("127.0.2.1", "https://h:1", "h:1/x"):
        with pytest.raises(ValueError, match="host:port"):
            normalize_external_engine_addr(bad)
    # tp 4 x pp 2 = 8 GPUs; absent sizes are 1; a decode worker is told apart
    assert engine_shape({"tp_size": 4, "pp_size": 2, "ep_size": 4}) == {
        "tp_size": 4, "pp_size": 2, "dp_size": 1, "ep_size": 4, "num_gpus": 8, "worker_type": "regular",
        "lora": {"enable_lora": False, "max_lora_rank": None},
    }  # fmt: skip
    assert engine_shape({"lora_paths": ["a=/x"], "max_lora_rank": 8})["lora"] == {
        "enable_lora": True,
        "max_lora_rank": 8,
    }
    assert engine_shape({"disaggregation_mode": "decode"})["worker_type"] == "decode"
    assert same_model("/models/Qwen3-4B/", "/data/Qwen3-4B") and same_model("/models/Qwen3-4B", "Qwen/Qwen3-4B")
    assert not same_model("/models/Qwen3-8B", "/models/Qwen3-4B")


def test_start_up_reads_the_engine_and_refuses_bad_addresses(capsys, tiny_kit, tmp_path, external_server):
    _, url = external_server
    addr = url.split("//")[1]
    args = make_args(tiny_kit, tmp_path, "--rollout-num-gpus", "0", "--rollout-external-engine-addrs", addr)
    assert args.rollout_external and args.rollout_num_gpus == 0 and args.rollout_num_gpus_per_engine == 1
    [info] = args.rollout_external_engine_infos
    assert info["url"] == url and info["tp_size"] == 1 and info["worker_type"] == "regular"

    dead = f"127.0.0.1:{find_available_port(25000)}"  # nothing listens there
    err = _parse_error(capsys, tiny_kit, tiny_kit[0], addr, dead)
    assert f"--rollout-external-engine-addrs {dead}: does not answer" in err

    other = shutil.copytree(tiny_kit[0], tmp_path / "another-model")  # the same files, another model to slime
    err = _parse_error(capsys, tiny_kit, str(other), addr)
    assert f"{addr} serves model {tiny_kit[0]!r}, not --hf-checkpoint {other}" in err

    err = _parse_error(capsys, tiny_kit, tiny_kit[0], addr, "--colocate")
    assert "cannot be combined with --colocate" in err

    err = _parse_error(capsys, tiny_kit, tiny_kit[0], addr, "--enable-lora", "--lora-sync", "adapter")
    assert f"{url}: --lora-sync adapter needs engines started with --enable-lora" in err


@pytest.mark.parametrize(
    "flags, what",
    [
        (["--offload"], "--offload/--offload-rollout"),
        (["--offload-rollout"], "--offload/--offload-rollout"),
        (["--debug-rollout-only"], "--debug-rollout-only"),
    ],
)
def test_external_engines_refuse_offload_and_debug_rollout_only(capsys, monkeypatch, tiny_kit, flags, what):
    """Refused at start-up, in one line, before any engine is contacted (no server runs here)."""
    import slime.config.rollout as rollout_config

    contacted = []
    monkeypatch.setattr(rollout_config, "discover_external_engines", lambda *a: contacted.append(a) or [])
    addr = f"127.0.0.1:{find_available_port(25000)}"  # nothing listens there, and nothing may try
    err = _parse_error(capsys, tiny_kit, tiny_kit[0], addr, *flags)
    assert f"--rollout-external-engine-addrs cannot be combined with {what}" in err
    assert contacted == []


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("transport", ["broadcast", "disk"])
def test_train_drives_an_engine_it_did_not_start(ray_session, tiny_kit, tmp_path, external_server, transport):
    proc, url = external_server
    before = requests.post(f"{url}/get_weights_by_name", json={"name": PARAM, "truncate_size": 64}).json()
    extra = ["--update-weight-disk-dir", str(tmp_path / "versions")] if transport == "disk" else []
    args = make_args(
        tiny_kit,
        tmp_path,
        *["--rollout-num-gpus", "0", "--rollout-external-engine-addrs", url.split("//")[1]],
        *["--update-weight-transport", transport, *extra],
    )
    sync_driver.train(args)

    rows = read_metrics(tmp_path)
    # the initial push is version 1, the one after rollout 0 version 2: each rollout was generated by the weights
    # pushed just before it, as the engine stamps them on every response
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2]
    assert proc.poll() is None, "slime stopped a server it did not start"
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    # three pushes (start, after rollout 0, after rollout 1): the served weights are the trained ones
    assert requests.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "3"
    after = requests.post(f"{url}/get_weights_by_name", json={"name": PARAM, "truncate_size": 64}).json()
    assert after != before


def _vanish_args(tiny_kit, tmp_path, urls, *extra):
    plan_faults(tmp_path, ("sigkill_engine", SAMPLES_PER_ROLLOUT))  # the first engine's server, at rollout 1
    return make_args(
        tiny_kit,
        tmp_path,
        *["--rollout-num-gpus", "0", "--rollout-external-engine-addrs", *[u.split("//")[1] for u in urls]],
        *["--update-weight-transport", "broadcast", "--rollout-health-check-interval", "1"],
        *["--custom-generate-function-path", f"{inject_faults_generate.__module__}.inject_faults_generate"],
        *extra,
        num_rollout=3,
    )


@pytest.mark.slow
@pytest.mark.e2e
def test_a_vanished_external_engine_is_named_and_fails_the_run(ray_session, tiny_kit, tmp_path, external_server):
    proc, url = external_server
    args = _vanish_args(tiny_kit, tmp_path, [url])
    with pytest.raises(RuntimeError, match=f"external inference engine .*{url}"):
        sync_driver.train(args)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_vanished_external_engine_is_dropped_under_fault_tolerance(ray_session, tiny_kit, tmp_path, external_server):
    proc, url = external_server
    other, other_url = start_cpu_server(tiny_kit[0])
    try:
        args = _vanish_args(tiny_kit, tmp_path, [url, other_url], "--use-fault-tolerance")
        sync_driver.train(args)
        rows = read_metrics(tmp_path)
        killed = faults_done(tmp_path)["sigkill_engine"]["url"]
        survivor = other_url if killed == url else url
        events = events_of(rows)
        assert [e["kind"] for e in events] == ["engine_failed", "engine_removed"], events  # never restarted
        assert "external inference engine" in events[0]["what"] and killed in events[0]["what"]
        assert [r["rollout_id"] for r in rows] == [0, 1, 2]
        assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2, 3]  # rollout 2 on the survivor alone
        assert requests.get(f"{survivor}/model_info", timeout=10).json()["weight_version"] == "4"
        assert (other if survivor == other_url else proc).poll() is None  # the survivor was left running
    finally:
        stop_cpu_server(other)


@pytest.mark.slow
@pytest.mark.e2e
def test_train_async_drives_an_external_engine_with_delta_updates(ray_session, tiny_kit, tmp_path, external_server):
    """train_async.py (one step off policy) with delta disk updates to an engine it did not start: the first version
    is full, each later one an xor delta on the one before, applied into the engine's local checkpoint; at the end the
    engine serves (and its local checkpoint holds) exactly the trainer's final weights (`--save-hf` of rollout 2)."""
    proc, url = external_server
    root, local, hf = tmp_path / "versions", tmp_path / "local", tmp_path / "hf"
    args = make_args(
        tiny_kit,
        tmp_path,
        *["--rollout-num-gpus", "0", "--rollout-external-engine-addrs", url.split("//")[1]],
        *["--update-weight-transport", "disk", "--update-weight-disk-dir", str(root), "--update-weight-mode", "delta"],
        *["--update-weight-local-checkpoint-dir", str(local), "--update-weight-disk-keep-files"],
        # one save, after the last rollout: a save would stop rollout N+1 from overlapping the training of N
        *["--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--save-hf", str(hf / "iter_{rollout_id}")],
        num_rollout=3,
    )
    async_driver.train(args)

    rows = read_metrics(tmp_path)
    # rollout 1 is generated while rollout 0 trains, with the same weights; pushes: start, after each rollout
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 1, 2]
    assert sorted(os.listdir(root)) == [disk_delta.version_name(v) for v in (1, 2, 3, 4)]
    for v in (1, 2, 3, 4):
        with open(root / disk_delta.version_name(v) / disk_delta.INDEX) as f:
            meta = json.load(f)["metadata"]
        if v == 1:
            assert "delta_encoding" not in meta
        else:
            assert meta["delta_encoding"] == "xor" and meta["base_version"] == f"{v - 1:06d}"
    assert requests.get(f"{url}/model_info", timeout=10).json()["weight_version"] == "4"
    final = {}
    for f in os.listdir(hf / "iter_2"):
        if f.endswith(".safetensors"):
            final.update(load_file(str(hf / "iter_2" / f)))
    assert disk_delta.held_version(str(local)) == 4
    held = {}
    for f in os.listdir(local):
        if f.endswith(".safetensors"):
            held.update(load_file(str(local / f)))
    assert sorted(held) == sorted(final) and all(torch.equal(held[n], final[n]) for n in final)
    expected = final[PARAM].reshape(-1)
    got = requests.post(f"{url}/get_weights_by_name", json={"name": PARAM, "truncate_size": expected.numel()}).json()
    assert torch.equal(torch.tensor(got, dtype=torch.float32), expected)
    assert proc.poll() is None, "slime stopped a server it did not start"


@pytest.mark.slow
@pytest.mark.e2e
def test_an_external_router_is_used_and_left_running(ray_session, tiny_kit, tmp_path, external_server):
    """--sglang-router-ip/--sglang-router-port name a router the test started: slime starts none, registers its
    engine there, generates through it, takes the engine off it at the end and leaves the router running."""
    proc, url = external_server
    router_args = unit_args()
    router = start_router(router_args)
    router_at = router_url(router_args)
    seen, run_over = {"workers": set(), "routers": set()}, threading.Event()

    def watch():
        while not run_over.is_set():
            seen["workers"].update(list_workers(router_at))
            seen["routers"].update(c.pid for c in multiprocessing.active_children() if c.name == "sglang-router")
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        args = make_args(
            tiny_kit,
            tmp_path,
            *["--rollout-num-gpus", "0", "--rollout-external-engine-addrs", url.split("//")[1]],
            *["--sglang-router-ip", router_args.sglang_router_ip],
            *["--sglang-router-port", str(router_args.sglang_router_port)],
            num_rollout=1,
        )
        watcher.start()
        sync_driver.train(args)
        run_over.set()
        watcher.join(5)
        rows = read_metrics(tmp_path)
        assert [int(r["rollout/weight_version"]) for r in rows] == [1]  # generated, through the only router there is
        assert seen["workers"] == {url}  # the engine was registered with the test's router
        assert seen["routers"] == {router.pid}  # slime started no router of its own
        assert router.is_alive() and list_workers(router_at) == []  # off the router at the end; the router runs on
        assert requests.get(f"{router_at}/health", timeout=10).status_code == 200
        assert proc.poll() is None
    finally:
        run_over.set()
        stop_router(router)
