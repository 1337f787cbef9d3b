"""The real sglang-router in front of two real CPU inference servers: registration, routing, abort fan-out, dead workers."""

import asyncio
import threading
import time

import pytest
import requests

from slime.backends.sglang_utils.router import (
    abort_all,
    add_worker,
    list_workers,
    remove_worker,
    router_url,
    start_router,
    stop_router,
)
from tests._args import make_args
from tests.test_cpu_server import PROMPTS, SESSION, start_cpu_server, stop_cpu_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def router():
    args = make_args("--sglang-router-request-timeout-secs", "600")
    proc = start_router(args)
    assert args.sglang_router_ip == "127.0.0.1" and args.sglang_router_port
    yield router_url(args), proc
    stop_router(proc)
    assert not proc.is_alive()


@pytest.fixture(scope="module")
def servers(tiny_kit):
    procs = [start_cpu_server(tiny_kit[0], "--random-seed", str(i)) for i in range(2)]
    yield procs
    for p, _ in procs:
        stop_cpu_server(p)


def registered_only(router_url, urls):
    """Make `urls` the router's workers, exactly: each test starts from the state it needs, whatever ran before."""
    for u in set(list_workers(router_url)) - set(urls):
        remove_worker(router_url, u)
    for u in urls:
        add_worker(router_url, u)
    deadline = time.time() + 10
    while sorted(list_workers(router_url)) != sorted(urls):
        assert time.time() < deadline, f"the router did not come to list exactly {urls}"
        time.sleep(0.1)


@pytest.fixture()
def workers(router, servers):
    """The two module servers, and only they, registered with the router for this test."""
    registered_only(router[0], [u for _, u in servers])
    return servers


def test_external_router_is_not_started():
    args = make_args("--sglang-router-ip", "127.0.2.1", "--sglang-router-port", "3000")
    assert start_router(args) is None and args.sglang_router_ip == "127.0.2.1"


def test_register_and_route(router, servers):
    url, _ = router
    urls = [u for _, u in servers]
    registered_only(url, [])
    for u in urls:
        add_worker(url, u)
    assert sorted(list_workers(url)) == sorted(urls)
    add_worker(url, urls[0])  # idempotent
    assert len(list_workers(url)) == 2
    direct = SESSION.post(
        urls[0] + "/generate",
        json={"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}},
    ).json()
    r = SESSION.post(
        url + "/generate",
        json={
            "input_ids": PROMPTS[0],
            "return_logprob": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True},
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == direct["output_ids"] and len(out["meta_info"]["output_token_logprobs"]) == 6
    batch = SESSION.post(
        url + "/generate",
        json={"input_ids": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": 3}},
        timeout=60,
    ).json()
    assert isinstance(batch, list) and len(batch) == 3
    # many concurrent requests: all answered (balance_abs_threshold=0 spreads them over both workers)
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                SESSION.post(
                    url + "/generate",
                    json={"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 4}},
                    timeout=60,
                ).status_code
            )
        )
        for _ in range(16)
    ]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert results == [200] * 16


def test_abort_all_fans_out(router, workers):
    url, _ = router
    results = []

    def long_request():
        results.append(
            SESSION.post(
                url + "/generate",
                json={"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 480, "ignore_eos": True}},
                timeout=120,
            ).json()
        )

    threads = [threading.Thread(target=long_request) for _ in range(4)]
    [t.start() for t in threads]
    deadline = time.time() + 30
    while sum(SESSION.get(u + "/get_load").json()[0]["num_reqs"] for _, u in workers) < 4:
        assert time.time() < deadline, "requests never started running"
        time.sleep(0.02)
    acked = asyncio.run(abort_all(url))
    assert sorted(acked) == sorted(u for _, u in workers)
    [t.join(30) for t in threads]
    assert len(results) == 4 and all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)


def test_dead_worker_tolerated_then_removed(router, workers, tiny_kit):
    url, _ = router
    proc, dead_url = start_cpu_server(tiny_kit[0])
    add_worker(url, dead_url)
    stop_cpu_server(proc)
    assert dead_url in list_workers(url)  # the router keeps dead workers listed
    t0 = time.time()
    acked = asyncio.run(abort_all(url, timeout=5))
    assert dead_url not in acked and len(acked) == 2 and time.time() - t0 < 10
    remove_worker(url, dead_url)
    deadline = time.time() + 10
    while dead_url in list_workers(url):
        assert time.time() < deadline, "router did not drop the removed worker"
        time.sleep(0.1)
    for _ in range(6):
        r = SESSION.post(
            url + "/generate", json={"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 2}}, timeout=60
        )
        assert r.status_code == 200


def test_api_key_passed_to_workers_through_the_router(router, workers, tiny_kit):
    """--sglang-api-key: the server enforces SGLang's auth, so a routed /generate succeeds only because the
    registration gave the router the key; the abort fan-out sends the (admin) key too."""
    url, _ = router
    proc, worker = start_cpu_server(tiny_kit[0], "--api-key", "k-123", "--admin-api-key", "adm-9")
    sp = {"input_ids": PROMPTS[0], "sampling_params": {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}}
    try:
        assert SESSION.post(worker + "/generate", json=sp, timeout=60).status_code == 401  # the key is enforced
        with_key = {"Authorization": "Bearer k-123"}
        direct = SESSION.post(worker + "/generate", json=sp, headers=with_key, timeout=60).json()
        add_worker(url, worker, api_key="k-123")
        others = [u for u in list_workers(url) if u != worker]
        for u in others:  # route only to the keyed worker
            remove_worker(url, u)
        routed = SESSION.post(url + "/generate", json=sp, timeout=60)
        assert routed.status_code == 200, routed.text
        assert routed.json()["output_ids"] == direct["output_ids"]
        assert worker not in asyncio.run(abort_all(url, timeout=5))  # /abort_request without the admin key: refused
        assert worker in asyncio.run(abort_all(url, timeout=5, admin_key="adm-9"))
    finally:
        remove_worker(url, worker)
        stop_cpu_server(proc)


def test_router_health(router):
    url, proc = router
    assert proc.is_alive()
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_router_refuses_a_port_another_router_answers_on(router):
    """A second run whose router port is taken must not adopt the first run's router (its engines would then serve
    the other run): the router it started is not the one listening, and start-up says so."""
    url, _ = router
    port = int(url.rsplit(":", 1)[1])
    args = make_args("--sglang-router-port", str(port))
    with pytest.raises(RuntimeError, match=rf"sglang-router .*{port}"):
        start_router(args)
    assert args.sglang_router_ip is None  # nothing adopted
    assert requests.get(url + "/health", timeout=5).status_code == 200  # the first run's router is untouched


def test_a_port_taken_after_it_was_chosen_is_chosen_again(monkeypatch):
    """Another process can bind the free port slime chose before the router binds it (the router then exits): slime
    chooses new ports and starts it there, rather than failing the run."""
    import socket

    from slime.backends.sglang_utils import router as router_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        chosen = iter([busy])
        real = router_module.free_port
        monkeypatch.setattr(router_module, "free_port", lambda *a, **k: next(chosen, None) or real(*a, **k))
        args = make_args()
        proc = start_router(args)
    try:
        assert args.sglang_router_port not in (None, busy)
        assert requests.get(router_url(args) + "/health", timeout=5).status_code == 200
    finally:
        stop_router(proc)


def test_a_router_that_exits_while_its_port_is_checked_is_reported_as_exited(monkeypatch):
    """The router can exit (its port was taken) between the liveness check and the look at its sockets: start-up
    must still say it exited, a RuntimeError its caller retries on other ports, not psutil's NoSuchProcess."""
    import multiprocessing

    from slime.backends.sglang_utils import router as router_module

    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    process.start()
    process.join(30)
    answers = iter([True])  # alive when checked, gone when its sockets are read
    real = router_module._alive
    monkeypatch.setattr(router_module, "_alive", lambda p: next(answers, None) or real(p))
    with pytest.raises(RuntimeError, match="sglang-router exited \\(code 0\\): port 1 is taken"):
        router_module._check_listener(process, 1, "sglang-router")


def test_consistent_hashing_sends_every_turn_of_a_session_to_one_engine(tiny_kit):
    """`--router-policy consistent_hashing` (current slime's session affinity) on the real router: the requests of
    one session key (`Sample.session_id`, sent as the routing-key header) all reach the same engine, and the keys
    spread over both. Each engine reports its own weight version, which tells them apart."""
    from slime.rollout.sglang_rollout import routing_headers
    from slime.utils.types import Sample

    args = make_args("--router-policy", "consistent_hashing")
    assert routing_headers(args, Sample(session_id="s1")) == {"X-SMG-Routing-Key": "s1"}
    assert routing_headers(args, Sample()) is None and routing_headers(make_args(), Sample(session_id="s1")) is None
    engines = [start_cpu_server(tiny_kit[0], "--weight-version", name) for name in ("a", "b")]
    proc = start_router(args)
    try:
        url = router_url(args)
        registered_only(url, [u for _, u in engines])
        served = {}
        for key in [f"session-{i}" for i in range(16)]:
            for turn in range(3):
                r = SESSION.post(
                    url + "/generate",
                    json={"input_ids": PROMPTS[turn], "sampling_params": {"max_new_tokens": 2}},
                    headers=routing_headers(args, Sample(session_id=key)),
                    timeout=60,
                )
                assert r.status_code == 200, r.text
                served.setdefault(key, set()).add(r.json()["meta_info"]["weight_version"])
    finally:
        stop_router(proc)
        for p, _ in engines:
            stop_cpu_server(p)
    assert all(len(engines_of_key) == 1 for engines_of_key in served.values()), served
    assert set.union(*served.values()) == {"a", "b"}, served
