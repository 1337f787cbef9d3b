"""Core utilities: Sample/ParamInfo types, load_function, SingletonMeta, periodic actions, Timer, async loop, HTTP."""

import asyncio
import json
import os
import socket
import threading
import time

import pytest

from slime.observability.timer import Timer, timer
from slime.utils import async_utils, http_utils
from slime.utils.misc import SingletonMeta, load_function, should_run_periodic_action
from slime.utils.ray_utils import Box
from slime.utils.types import ParamInfo, Sample
from tests._args import make_args

# ---------------------------------------------------------------- types


def test_sample_round_trip_and_status_string():
    s = Sample(
        index=3,
        prompt=[{"role": "user", "content": "hi"}],
        tokens=[1, 2, 3],
        response="x",
        response_length=1,
        label="7",
        reward={"acc": 1.0},
        loss_mask=[1],
        rollout_log_probs=[-0.5],
        status=Sample.Status.TRUNCATED,
        metadata={"k": "v"},
    )
    d = s.to_dict()
    assert d["status"] == "truncated" and d["tokens"] == [1, 2, 3] and d["metadata"] == {"k": "v"}
    snapshot = dict(d)
    back = Sample.from_dict(d)
    assert d == snapshot  # the caller's dict is not mutated
    assert back == s and back.status is Sample.Status.TRUNCATED


def test_sample_defaults_are_independent_and_unknown_keys_survive():
    a, b = Sample(), Sample()
    a.tokens.append(1)
    a.metadata["x"] = 1
    assert b.tokens == [] and b.metadata == {} and b.status is Sample.Status.PENDING
    s = Sample.from_dict({"prompt": "p", "status": "completed", "future_field": 5})
    assert s.status is Sample.Status.COMPLETED and s.future_field == 5


def test_get_reward_value():
    s = Sample(index=1, reward={"acc": 0.5, "fmt": 1.0})
    assert s.get_reward_value(make_args("--reward-key", "acc")) == 0.5
    assert Sample(reward=0.25).get_reward_value(make_args()) == 0.25  # no --reward-key: the reward itself
    with pytest.raises(KeyError, match="--reward-key 'acc'"):  # a key asked of a scalar reward
        Sample(reward=0.25).get_reward_value(make_args("--reward-key", "acc"))
    with pytest.raises(KeyError, match="--reward-key 'score'"):
        s.get_reward_value(make_args("--reward-key", "score"))


@pytest.mark.parametrize(
    "reason,status", [("length", "TRUNCATED"), ("abort", "ABORTED"), ("stop", "COMPLETED"), ("weird", "PENDING")]
)
def test_apply_finish_reason(reason, status):
    s = Sample()
    s.apply_finish_reason(
        {"finish_reason": {"type": reason}, "weight_version": 4, "prompt_tokens": 3, "cached_tokens": 1}
    )
    s.apply_finish_reason({"finish_reason": {"type": reason}, "weight_version": "5", "prompt_tokens": 2})
    assert s.status is Sample.Status[status]
    assert s.weight_versions == ["4", "5"]
    assert s.spec_info == Sample.SpecInfo()  # counted only with speculative decoding
    assert (s.prefix_cache_info.total_prompt_tokens, s.prefix_cache_info.cached_tokens) == (5, 1)
    assert s.prefix_cache_info.prefix_cache_hit_rate == 0.2
    spec = Sample()
    meta = {
        "finish_reason": {"type": reason},
        "spec_accept_token_num": 6,
        "spec_draft_token_num": 8,
        "spec_verify_ct": 2,
    }
    spec.apply_finish_reason({**meta, "completion_tokens": 7}, make_args("--sglang-speculative-algorithm", "EAGLE"))
    assert (spec.spec_info.spec_accept_rate, spec.spec_info.spec_accept_length) == (0.75, 3.5)
    assert Sample.from_dict(spec.to_dict()).spec_info == spec.spec_info


def test_param_info_is_frozen():
    p = ParamInfo("w", "float32", (2, 3), {}, 24, 0)
    with pytest.raises(Exception):
        p.name = "v"
    assert p.shape == (2, 3) and p.size == 24


def test_box_keeps_its_content():
    obj = object()
    assert Box(obj).inner is obj


# ---------------------------------------------------------------- misc


def test_load_function_and_its_errors():
    import os.path

    assert load_function("os.path.join") is os.path.join
    with pytest.raises(ImportError, match=r"cannot load 'nope_pkg\.mod\.fn': module 'nope_pkg\.mod' not found"):
        load_function("nope_pkg.mod.fn")
    with pytest.raises(ImportError, match=r"module 'os\.path' has no attribute 'nope'"):
        load_function("os.path.nope")
    with pytest.raises(ValueError, match="dotted path"):
        load_function("join")


def test_singleton_meta():
    class Thing(metaclass=SingletonMeta):
        def __init__(self):
            self.n = 0

    a = Thing()
    a.n = 5
    assert Thing() is a and Thing().n == 5
    SingletonMeta.clear_instances(Thing)
    assert Thing().n == 0
    SingletonMeta.clear_instances(Thing)


def test_should_run_periodic_action():
    assert not should_run_periodic_action(4, None)
    assert [r for r in range(12) if should_run_periodic_action(r, 5)] == [4, 9]
    # epoch boundaries (every 3 rollouts) count too
    assert [r for r in range(12) if should_run_periodic_action(r, 5, 3)] == [2, 4, 5, 8, 9, 11]
    # checkpoint saves also come after the last rollout (current slime's train.py passes num_rollout for them)
    assert [r for r in range(12) if should_run_periodic_action(r, 5, None, 12)] == [4, 9, 11]
    assert [r for r in range(12) if should_run_periodic_action(r, None, None, 12)] == []


# ---------------------------------------------------------------- timer


def test_timer_accumulates_and_decorates():
    SingletonMeta.clear_instances(Timer)
    t = Timer()
    assert Timer() is t
    t.start("step")
    time.sleep(0.01)
    t.end("step")
    t.add("step", 1.0)
    assert 1.01 <= t.log_dict()["step"] < 2.0
    with pytest.raises(AssertionError, match="already started"):
        t.start("x")
        t.start("x")
    t.end("x")
    with pytest.raises(AssertionError, match="not started"):
        t.end("never")

    @timer
    def work():
        return 42

    assert work() == 42 and "work" in t.log_dict()
    with timer("ctx"):
        pass
    assert "ctx" in t.log_dict()
    t.reset("ctx")
    assert "ctx" not in t.log_dict()
    t.reset()
    assert t.log_dict() == {}
    SingletonMeta.clear_instances(Timer)


# ---------------------------------------------------------------- async loop


def test_async_run_uses_one_background_loop():
    async def loop_id(x):
        await asyncio.sleep(0)
        return id(asyncio.get_running_loop()), x * 2

    (l1, v1), (l2, v2) = async_utils.run(loop_id(1)), async_utils.run(loop_id(2))
    assert l1 == l2 == id(async_utils.get_async_loop()) and (v1, v2) == (2, 4)

    async def slow():
        await asyncio.sleep(5)

    with pytest.raises(TimeoutError, match="did not finish within 0.2s"):
        async_utils.run(slow(), timeout=0.2)

    async def times_out_itself():  # its own error, with its own message, not this wait's
        await asyncio.wait_for(asyncio.sleep(5), 0.01)

    with pytest.raises(TimeoutError) as e:
        async_utils.run(times_out_itself())
    assert "did not finish within" not in str(e.value)


# ---------------------------------------------------------------- http


def test_ports_and_host_info(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert not http_utils.is_port_available(busy)
    port = http_utils.find_available_port(20000)
    assert port >= 20100 and http_utils.is_port_available(port)
    monkeypatch.setenv("SLIME_HOST_IP", "127.0.2.123")
    assert http_utils.get_host_info()[1] == "127.0.2.123"


def test_free_ports_are_never_ones_the_os_hands_out_by_itself():
    """A probed port is bound later by another process: an ephemeral one could meanwhile become the local end of any
    connect() or a gloo listener's bind(0) (two CI failures: 'address already in use'). Nor one of Ray's worker ports."""
    ephemeral = http_utils._ephemeral_ports()
    for consecutive in [1] * 50 + [8] * 20:
        port = http_utils.free_port(consecutive)
        for p in range(port, port + consecutive):
            assert p not in ephemeral and p not in http_utils.RAY_WORKER_PORTS and http_utils.is_port_available(p, "")
    with socket.socket() as s:  # and the OS's choice is indeed in the range read
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] in ephemeral


@pytest.fixture
def http_server():
    """A tiny aiohttp server on 127.0.0.1: /echo (JSON echo), /bad (400), /flaky (500 twice, then 200)."""
    from aiohttp import web

    calls = {"flaky": 0}

    async def echo(request):
        return web.json_response({"got": await request.json() if request.can_read_body else None})

    async def bad(request):
        return web.json_response({"error": "no such model"}, status=400)

    async def flaky(request):
        calls["flaky"] += 1
        if calls["flaky"] <= 2:
            return web.Response(status=500, text="busy")
        return web.json_response({"ok": True})

    async def sse(request):  # three events, the second over 64 KiB (thousands of tokens' log-probs), then [DONE]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in (1, 30000, 3):
            await resp.write(f"data: {json.dumps({'ids': list(range(n))})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.add_routes([web.post("/echo", echo), web.get("/echo", echo), web.post("/bad", bad), web.post("/flaky", flaky)])
    app.add_routes([web.post("/sse", sse)])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", calls
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_post_stream_yields_each_event_even_a_long_one(http_server):
    url, _ = http_server

    async def collect():
        return [len(e["ids"]) async for e in http_utils.post_stream(f"{url}/sse", {})]

    assert async_utils.run(collect(), timeout=30) == [1, 30000, 3]
    with pytest.raises(http_utils.HTTPStatusError, match="/bad answered HTTP 400"):
        async_utils.run(collect_from(f"{url}/bad"), timeout=30)


async def collect_from(url):
    return [e async for e in http_utils.post_stream(url, {})]


def test_http_post_get_and_errors(http_server, monkeypatch):
    url, calls = http_server
    assert async_utils.run(http_utils.post(f"{url}/echo", {"a": 1}), timeout=30) == {"got": {"a": 1}}
    assert async_utils.run(http_utils.get(f"{url}/echo"), timeout=30) == {"got": None}
    with pytest.raises(http_utils.HTTPStatusError, match=r"/bad answered HTTP 400: .*no such model"):
        async_utils.run(http_utils.post(f"{url}/bad", {}), timeout=30)

    async def no_wait(_):  # make retries instant
        return None

    monkeypatch.setattr(http_utils.asyncio, "sleep", no_wait)
    assert async_utils.run(http_utils.post(f"{url}/flaky", {}, max_retries=5), timeout=30) == {"ok": True}
    assert calls["flaky"] == 3  # 5xx is retried
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound but not listening: connection refused
        with pytest.raises(ConnectionError, match=rf"POST http://127.0.0.1:{dead}/x failed after 2 attempt"):
            async_utils.run(http_utils.post(f"http://127.0.0.1:{dead}/x", {}, max_retries=2), timeout=30)


def test_posts_from_short_lived_loops_leave_no_session_or_socket_behind(http_server):
    """A user's synchronous function that runs `asyncio.run(http_utils.post(...))` per call: each loop's shared session
    closes with it (before: one open session and keep-alive socket per call, until the process ran out of files)."""
    url, _ = http_server

    def open_fds():
        return len(os.listdir("/proc/self/fd"))

    asyncio.run(http_utils.post(f"{url}/echo", {"warm": 1}))  # first-use imports and the like
    before, sessions = open_fds(), len(http_utils._sessions)  # the background loop's may be among them
    for i in range(20):
        assert asyncio.run(http_utils.post(f"{url}/echo", {"i": i})) == {"got": {"i": i}}
    assert open_fds() - before <= 2 and len(http_utils._sessions) == sessions


def test_cleanup_on_exit_runs_every_step_even_when_one_hangs_or_fails(monkeypatch, capsys):
    """A cleanup step stuck on a half-dead cluster is abandoned after its bound; the others still run, in reverse."""
    import threading

    from slime.ray import driver

    monkeypatch.setattr(driver, "CLEANUP_STEP_TIMEOUT_S", 0.2)
    ran, stuck = [], threading.Event()

    def fails():
        raise RuntimeError("actor already dead")

    def hangs():
        stuck.wait()  # never set: a Ray call that never returns

    with driver.cleanup_on_exit():
        driver.register_cleanup(lambda: ran.append("first registered"))
        driver.register_cleanup(fails)
        driver.register_cleanup(hangs)
        driver.register_cleanup(lambda: ran.append("last registered"))
    stuck.set()
    assert ran == ["last registered", "first registered"]
    out = capsys.readouterr().out
    assert "hangs did not finish within 0.2s" in out and "fails failed: actor already dead" in out


def test_one_console_metrics_format():
    from slime.ray.driver import RunRecorder
    from slime.utils.console import metrics_line

    # numbers to 4 significant digits; non-numbers (and bools) stay out of the console line
    assert (
        metrics_line("train/step 5", {"train/loss": 1.23456, "train/n": 7, "train/ok": True, "x": [1]})
        == "train/step 5 | loss 1.235 | n 7"
    )
    assert metrics_line("eval 2", {"eval/aime": 0.25}, short_names=False) == "eval 2 | eval/aime 0.25"
    record = {
        "rollout_id": 3,
        "rollout/raw_reward": 0.41234,
        "eval/add": 0.5,
        "eval/add_truncated_ratio": 0.1,
        "perf/step_time": 12.34,
    }
    assert RunRecorder._line(record) == "rollout 3 | reward 0.4123 | eval/add 0.5 | step_time_s 12.34"


def test_the_run_record_takes_the_training_metrics_from_the_last_pipeline_stage(tmp_path):
    """Under PP the optimizer steps' metrics are on the last stage's ranks; rank 0 (the first stage) has the rollout
    and perf sections and an empty step history. The metrics file gets every section, each from a rank that has it;
    the critic's report is its last stage's."""
    import json
    import types

    from slime.ray.critic import _critic_report as critic_report
    from slime.ray.driver import RunRecorder

    manager = types.SimpleNamespace(pop_metrics=lambda rollout_id: {"rollout/raw_reward": 0.5}, fault_events=[])
    args = make_args("--metrics-path", str(tmp_path / "m.jsonl"))
    first_stage = {"rollout": {"rollout/log_probs": -1.0}, "train": [], "perf": {"perf/tflops": 2.0}}
    last_stage = {"rollout": {"rollout/log_probs": -9.0}, "train": [{"train/pg_loss": 0.1}, {"train/pg_loss": 0.3}]}
    RunRecorder(args, manager).rollout_done(0, [first_stage, last_stage, {"train": [{"train/pg_loss": 7.0}]}])
    (record,) = [json.loads(line) for line in open(args.metrics_path)]
    assert record["train/pg_loss"] == 0.3  # the last of the rollout's steps, from the first rank that has any
    assert record["rollout/log_probs"] == -1.0 and record["perf/tflops"] == 2.0 and record["rollout/raw_reward"] == 0.5
    # the critic's report too: its ranks hand back values, the last stage's also the steps' metrics
    critic = [{"values": {0: [0.1]}, "train": []}, {"values": {}, "train": [{"train/critic-value_loss": 0.2}]}]
    assert critic_report(critic) == {"train": [{"train/critic-value_loss": 0.2}]}


# ---------------------------------------------------------------- process-group rendezvous


def _listening_ips(port):
    import psutil

    return {
        c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port
    }


def test_process_group_rendezvous_listens_on_its_host_only():
    """torch's own TCPStore server listens on every interface whatever host it is given; the store of slime's process
    groups (trainers' rendezvous, weight-update group) listens on that host alone, and the group works over it."""
    import torch
    import torch.distributed as dist

    from slime.utils.distributed_utils import init_process_group, seconds, tcp_store

    port = http_utils.find_available_port(26000)
    store = tcp_store("127.0.0.1", port, 1, True, seconds(30))
    client = tcp_store("127.0.0.1", port, 1, False, seconds(30))
    store.set("k", "v")
    assert client.get("k") == b"v"
    assert _listening_ips(port) == {"127.0.0.1"}
    del store, client

    port = http_utils.find_available_port(port + 1)
    group = init_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=1, rank=0, group_name="test-listen"
    )
    try:
        assert _listening_ips(port) == {"127.0.0.1"}
        t = torch.tensor([3.0])
        dist.broadcast(t, 0, group=group)
        assert t.item() == 3.0
    finally:
        dist.destroy_process_group(group)

    # a listener of our own holds the port (even SO_REUSEADDR cannot bind over a listening socket): one-line error
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"cannot listen on 127\.0\.0\.1:{busy} "):
            tcp_store("127.0.0.1", busy, 1, True, seconds(5))


def test_rank0_holds_its_rendezvous_port_from_announcing_it_until_its_store_listens(monkeypatch):
    """Rank 0 announces its port in `__init__` and listens on it in `init`, seconds later; a port only probed in
    between was taken by another process once in CI (`Address already in use`). Now no one can bind it meanwhile,
    and `init` forms the group on it."""
    import ray
    import torch.distributed as dist

    from slime.ray import train_actor

    monkeypatch.setattr(ray._private.services, "get_node_ip_address", lambda: "127.0.0.1")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.setattr(train_actor, "set_shared_authkey", lambda: None)
    for key in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")  # restored after the test: `__init__` sets them
    actor = object.__new__(train_actor.TrainRayActor)
    train_actor.TrainRayActor.__init__(actor, 1, 0, None, None)
    addr, port = actor.get_master_addr_and_port()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError, match="Address already in use"):
            other.bind((addr, port))
    train_actor.TrainRayActor.init(actor, make_args(), "actor")
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert _listening_ips(port) == {"127.0.0.1"}
    finally:
        dist.destroy_process_group()


def _python(code: str, device: str):
    """`python -c code` from the repository root with SLIME_DEVICE=device; its CompletedProcess (text output)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, SLIME_DEVICE=device, PYTHONPATH=root)
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_cpu_run_says_once_that_megatron_falls_back_to_torch():
    """megatron-core warns at import that Transformer Engine and Apex are missing, in every process that imports it
    (each trainer, the controller, the driver). On CPU that is the design: no such warning, and one line from the
    driver's argument check that says it is expected, however often the arguments are parsed. Its fused helpers run
    eagerly there: not wrapped by torch.compile, and TorchDynamo (4 s per process) never imported."""
    code = (
        "from tests._args import make_args; make_args(); make_args(); "
        "import slime.backends.megatron_utils.actor, megatron.core.models.gpt.gpt_layer_specs; "
        "import sys, megatron.core.jit as jit; from megatron.core.fusions.fused_bias_swiglu import bias_swiglu; "
        "from megatron.core.transformer.attention import Attention; "
        "assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser; "
        "assert type(bias_swiglu).__name__ == 'function' and type(Attention._apply_output_gate).__name__ == 'function'; "
        "assert 'torch._dynamo' not in sys.modules"
    )
    proc = _python(code, "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not installed" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("this is expected on CPU") == 1, proc.stderr[-3000:]


def test_megatron_fusions_stay_compiled_off_cpu():
    """Off CPU megatron-core's default stands: `import slime` leaves its jit fuser alone."""
    code = (
        "import sys, slime; assert not [f for f in sys.meta_path if type(f).__name__ == '_AfterImport'], sys.meta_path"
    )
    proc = _python(code, "cuda")
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------- engine lock


class _ScriptedLock:
    """A `Lock` actor handle: `acquire.remote()` answers the next scripted result (the test's `ray.get` returns it)."""

    def __init__(self, answers):
        self.answers, self.calls = list(answers), 0
        self.acquire = type("Method", (), {"remote": self._acquire})()

    def _acquire(self):
        self.calls += 1
        return self.answers.pop(0) if self.answers else False


def test_acquire_lock_gives_up_on_a_lock_that_stays_held_and_takes_a_free_one(monkeypatch):
    """README: no weight broadcast while another source rank holds the engines; a rank that cannot get the lock
    gives up after its timeout with a weight-update error instead of spinning forever."""
    from types import SimpleNamespace

    from slime.backends.megatron_utils.update_weight import common

    monkeypatch.setattr(common, "ray", SimpleNamespace(get=lambda ref, timeout=None: ref))
    held = _ScriptedLock([])
    start = time.monotonic()
    with pytest.raises(common.WeightUpdateError, match="update bucket 3: the rollout-engine lock stayed held"):
        common.acquire_lock(held, "update bucket 3", timeout=0.3)
    assert 0.3 <= time.monotonic() - start < 2 and held.calls >= 3  # it retried until the deadline, then gave up
    freed = _ScriptedLock([False, False, True])  # released by the other rank while this one waits
    assert common.acquire_lock(freed, "update bucket 3", timeout=5) is None and freed.calls == 3
    free = _ScriptedLock([True])
    common.acquire_lock(free, "update bucket 3", timeout=0.3)
    assert free.calls == 1


def test_engine_lock_is_non_blocking_and_refuses_a_second_holder():
    from slime.ray.utils import Lock

    lock = Lock.__ray_metadata__.modified_class()  # the actor's class, without a Ray cluster
    assert lock.acquire() is True
    assert lock.acquire() is False  # held: a second source rank is refused, not queued
    lock.release()
    assert lock.acquire() is True
    lock.release()
    with pytest.raises(AssertionError, match="not held"):
        lock.release()
