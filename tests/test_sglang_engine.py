"""SGLangEngine as a Ray actor: launches slime's CPU server, registers with the real router, admin calls, cleanup."""

import os
import re
import sys
import time

import pytest

from slime.backends.sglang_utils.router import list_workers, router_url, start_router, stop_router
from slime.backends.sglang_utils.server_launch import server_command
from tests._args import make_args
from tests.test_cpu_server import PROMPTS, SESSION

pytestmark = pytest.mark.timeout(300)


def _args(model_dir, **kw):
    fields = dict(
        seed=3,
        rollout_num_gpus=2,
        rollout_num_gpus_per_engine=1,
        rollout_num_gpus_per_node=4,
        actor_num_gpus_per_node=2,
        actor_num_nodes=1,
        colocate=False,
        offload=False,
        sglang_router_ip=None,
        sglang_router_port=None,
        sglang_router_request_timeout_secs=600,
        sglang_max_running_requests=8,
        sglang_context_length=None,
        sglang_mem_fraction_static=0.7,
    )
    fields.update(kw)  # a test's own router address etc. replace the defaults above
    return make_args("--inference-server", "cpu", hf_checkpoint=model_dir, **fields)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def _wait_dead(pid, timeout=30):
    deadline = time.time() + timeout
    while _alive(pid):
        assert time.time() < deadline, f"server process {pid} still alive {timeout}s after its engine went away"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def router():
    args = make_args("--sglang-router-request-timeout-secs", "600")
    proc = start_router(args)
    yield args
    stop_router(proc)


def _engine(ray, args, rank, port=None):
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine

    engine = ray.remote(SGLangEngine).options(num_cpus=0.2, num_gpus=0.2).remote(args, rank)
    addr, free = ray.get(engine._get_current_node_ip_and_free_port.remote(consecutive=4))
    port = port or free
    try:
        ray.get(engine.init.remote(dist_init_addr=f"{addr}:{free + 3}", port=port, nccl_port=free + 1), timeout=180)
    except Exception:
        ray.kill(engine)
        raise
    return engine


def test_server_command_picks_cpu_server(tiny_kit, monkeypatch):
    a = _args(tiny_kit[0])
    assert a.inference_server == "cpu"  # server_command reads the choice parse_args made (auto resolved there)
    kind, cmd = server_command(a, 1, "127.0.0.1", 1234, 1235, "127.0.0.1:1240")
    assert kind == "cpu" and cmd[1:3] == ["-m", "slime.backends.cpu_server"]
    assert cmd[cmd.index("--random-seed") + 1] == "4" and cmd[cmd.index("--max-running-requests") + 1] == "8"
    assert "--mem-fraction-static" not in cmd  # GPU-only knobs are not passed to the CPU server
    a.inference_server = "sglang"
    a.sglang_disable_cuda_graph, a.sglang_tokenizer_mode, a.sglang_bogus_option = True, "auto", 1
    kind, cmd = server_command(a, 1, "127.0.0.1", 1234, 1235, "127.0.0.1:1240")
    assert kind == "sglang" and cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--base-gpu-id") + 1] == "3" and cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
    assert cmd[cmd.index("--tp-size") + 1] == "1" and cmd[cmd.index("--random-seed") + 1] == "4"
    assert "--skip-server-warmup" in cmd and "--disable-cuda-graph" in cmd
    # only options changed from SGLang's defaults are passed; unknown ones are dropped
    assert "--tokenizer-mode" not in cmd and "--bogus-option" not in cmd and "--max-running-requests" in cmd
    assert cmd[0] == sys.executable
    # SLIME_SERVER_PYTHON: another interpreter (or a launcher with its own arguments) runs either server
    monkeypatch.setenv("SLIME_SERVER_PYTHON", "'/opt/sglang venv/bin/python' -S")
    for kind in ("sglang", "cpu"):
        a.inference_server = kind
        assert server_command(a, 1, "127.0.0.1", 1234, 1235, "127.0.0.1:1240")[1][:3] == [
            "/opt/sglang venv/bin/python",
            "-S",
            "-m",
        ]


def test_engine_lifecycle(ray_session, router, tiny_kit):
    ray = ray_session
    from slime.utils.tensor_serialization import MultiprocessingSerializer, set_shared_authkey

    args = _args(tiny_kit[0], sglang_router_ip=router.sglang_router_ip, sglang_router_port=router.sglang_router_port)
    engine = _engine(ray, args, 0)
    url = ray.get(engine.get_url.remote())
    pid = ray.get(engine.get_server_pid.remote())
    rurl = router_url(router)
    assert url in list_workers(rurl)
    sp = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}}
    first = SESSION.post(rurl + "/generate", json=sp, timeout=60).json()
    assert first["meta_info"]["completion_tokens"] == 5

    def checksums():
        return ray.get(engine.check_weights.remote("checksum"))["ranks"][0]["checksums"]

    sums = checksums()
    assert "model.layers.0.self_attn.qkv_proj.weight" in sums  # SGLang's fused parameter, as its checker reports
    ray.get(engine.pause_generation.remote())
    ray.get(engine.continue_generation.remote())
    ray.get(engine.flush_cache.remote())
    ray.get(engine.release_memory_occupation.remote())
    assert SESSION.post(url + "/generate", json=sp).status_code == 503
    ray.get(engine.resume_memory_occupation.remote(tags=["weights"]))
    ray.get(engine.resume_memory_occupation.remote(tags=["kv_cache", "cuda_graph"]))
    assert SESSION.post(url + "/generate", json=sp).json()["output_ids"] == first["output_ids"]

    # colocated-style update through the actor, in one weight-update session: zero the last layer's MLP down proj
    set_shared_authkey()
    import torch

    name = "model.layers.3.mlp.down_proj.weight"
    payload = MultiprocessingSerializer.serialize([(name, torch.zeros(128, 512))], output_str=True)
    with pytest.raises(ray.exceptions.RayTaskError, match="must run between begin_weight_update"):
        ray.get(engine.update_weights_from_tensor.remote([payload], weight_version="42"))
    ray.get(engine.begin_weight_update.remote())
    payload = MultiprocessingSerializer.serialize([(name, torch.zeros(128, 512))], output_str=True)
    ray.get(engine.update_weights_from_tensor.remote([payload], weight_version="42"))
    ray.get(engine.end_weight_update.remote())
    new_sums = checksums()
    import hashlib

    assert (
        new_sums["model.layers.3.mlp.down_proj.weight"] == hashlib.sha256(bytes(128 * 512 * 4)).hexdigest()[:16]
        and new_sums != sums
    )
    assert ray.get(engine.get_weight_version.remote()) == "42"
    ray.get(engine.update_weights_from_disk.remote(tiny_kit[0]))
    assert checksums() == sums

    log = ray.get(engine.__ray_call__.remote(lambda self: self.log_path))
    assert os.path.exists(log)
    ray.get(engine.shutdown.remote())
    _wait_dead(pid)
    assert url not in list_workers(rurl)
    assert not os.path.exists(log)  # a server stopped by its engine leaves no log behind; one that died keeps it
    ray.kill(engine)


def test_ray_kill_leaves_no_server(ray_session, tiny_kit):
    ray = ray_session
    engine = _engine(ray, _args(tiny_kit[0]), 1)
    pid = ray.get(engine.get_server_pid.remote())
    assert _alive(pid)
    ray.kill(engine)
    _wait_dead(pid)


def test_startup_failure_reports_log_tail(ray_session, tiny_kit, tmp_path):
    ray = ray_session
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    args = _args(tiny_kit[0])
    args.hf_checkpoint = str(bad)  # parse_args would refuse it; the engine must report the server's own failure
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        _engine(ray, args, 2)
    assert "exited with code" in str(e.value) and "config.json" in str(e.value)
    log = re.search(r"Last log lines \((/\S+\.log)\)", str(e.value)).group(1)
    assert "config.json" in open(log).read()  # kept: the error names it
    os.remove(log)


def test_engine_refuses_a_server_of_another_run_on_its_port(ray_session, tiny_kit):
    """Run B's engine is handed a port where run A's server already answers (a port race between two runs on one
    machine): B must refuse it before registering it or sending weights, naming the URL and both identities."""
    ray = ray_session
    engine_a = _engine(ray, _args(tiny_kit[0], sglang_served_model_name="slime-run-a"), 0)
    url_a = ray.get(engine_a.get_url.remote())
    port_a = int(url_a.rsplit(":", 1)[1])
    sums = ray.get(engine_a.check_weights.remote("checksum"))["per_engine_checksum"]
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as exc:
            _engine(ray, _args(tiny_kit[0], sglang_served_model_name="slime-run-b"), 1, port=port_a)
        assert (
            f"engine 1: the server answering at {url_a} is not this run's engine (served_model_name "
            f"'slime-run-a', expected 'slime-run-b'); another process holds port {port_a}"
        ) in str(exc.value)
        assert ray.get(engine_a.check_weights.remote("checksum"))["per_engine_checksum"] == sums  # A untouched
    finally:
        ray.get(engine_a.shutdown.remote())
        ray.kill(engine_a)


class _ProbedEngine:
    """An engine actor's handle as `allocate_ports` probes it: each `_get_current_node_ip_and_free_port.remote()`
    answers the next scripted (addr, port) (the test's `ray.get` returns it) and records the `consecutive` asked."""

    def __init__(self, answers=()):
        self.answers, self.asked = list(answers), []
        self._get_current_node_ip_and_free_port = type("Method", (), {"remote": self._probe})()

    def _probe(self, consecutive=1):
        self.asked.append(consecutive)
        return self.answers.pop(0)


def _port_args(**layout):
    return make_args(sglang_dp_size=None, **layout)


def _ranges(ports):
    """Each engine's ports as ranges: port, nccl_port, and the 7 of its rendezvous (6 + dp size 1)."""
    rendezvous = int(ports["dist_init_addr"].rsplit(":", 1)[1])
    return [{ports["port"]}, {ports["nccl_port"]}, set(range(rendezvous, rendezvous + 7))]


def test_allocate_ports_hands_out_disjoint_ports_per_node_and_skips_repeats(monkeypatch):
    """docs/qa.md: each engine needs several consecutive ports, allocated per node: a probed port (or range) that
    overlaps one already handed out on the node is probed again, never given twice; another node may reuse it."""
    from types import SimpleNamespace

    from slime.ray import engines as engines_module

    monkeypatch.setattr(engines_module, "ray", SimpleNamespace(get=lambda ref: ref))
    script = [
        ("node", 30000),  # engine A: port
        ("node", 30000),  # a repeat: skipped
        ("node", 30001),  # nccl_port
        ("node", 29995),  # 29995..30001 overlaps both: skipped
        ("node", 40000),  # dist_init_addr 40000..40006
        ("node", 40003),  # engine B: inside that range, skipped
        ("node", 30002),  # port
        ("node", 30002),  # a repeat: skipped
        ("node", 30003),  # nccl_port
        ("node", 40006),  # overlaps 40006: skipped
        ("node", 40007),  # dist_init_addr 40007..40013
    ]
    probes = [_ProbedEngine([(f"{a}0", p) for a, p in script]), _ProbedEngine()]
    probes += [_ProbedEngine([(f"{a}1", p) for a, p in script]), _ProbedEngine()]
    args = _port_args(rollout_num_gpus=4, rollout_num_gpus_per_node=2, rollout_num_gpus_per_engine=1)
    ports = engines_module.allocate_ports(args, probes)
    for node in (0, 1):  # the same ports on both nodes: each node's free ports are its own
        a, b = ports[2 * node], ports[2 * node + 1]
        assert a == {"port": 30000, "nccl_port": 30001, "dist_init_addr": f"node{node}:40000"}
        assert b == {"port": 30002, "nccl_port": 30003, "dist_init_addr": f"node{node}:40007"}
        held = _ranges(a) + _ranges(b)
        assert all(not (x & y) for i, x in enumerate(held) for y in held[i + 1 :])  # pairwise disjoint on the node
        assert probes[2 * node].asked == [1, 1, 1, 7, 7, 1, 1, 1, 1, 7, 7] and probes[2 * node].answers == []
        assert probes[2 * node + 1].asked == []  # one probe per node

    # replacing engine 3 only: only its node is probed (engine 2, maybe removed, is not), on engine 3
    probes = [_ProbedEngine(), _ProbedEngine(), _ProbedEngine(), _ProbedEngine([("node1", p) for _, p in script])]
    ports = engines_module.allocate_ports(args, probes, ranks=[3])
    assert ports[:2] == [{}, {}] and [p.asked for p in probes[:3]] == [[], [], []]
    assert ports[3] == {"port": 30002, "nccl_port": 30003, "dist_init_addr": "node1:40007"}


def test_a_multi_node_engine_shares_its_first_nodes_rendezvous_address(monkeypatch):
    from types import SimpleNamespace

    from slime.ray import engines as engines_module

    monkeypatch.setattr(engines_module, "ray", SimpleNamespace(get=lambda ref: ref))
    args = _port_args(rollout_num_gpus=4, rollout_num_gpus_per_node=2, rollout_num_gpus_per_engine=4)
    for ranks in (None, [0, 1]):  # start-up, and a replacement (every node of the engine, as EngineGroup.replace)
        first = _ProbedEngine([("node0", 30000), ("node0", 30001), ("node0", 40000)])
        second = _ProbedEngine([("node1", 30000), ("node1", 30001)])
        ports = engines_module.allocate_ports(args, [first, second], ranks)
        assert ports == [
            {"port": 30000, "nccl_port": 30001, "dist_init_addr": "node0:40000"},
            {"port": 30000, "nccl_port": 30001, "dist_init_addr": "node0:40000"},
        ]
        assert (first.asked, second.asked) == ([1, 1, 7], [1, 1])
