"""--use-distributed-post: the rollout's posts go through Ray actors (here to a real CPU inference server) and come
back as if posted locally: outputs, HTTP errors as HTTPStatusError, each failed attempt to `on_retry`, and a poster
that died is skipped."""

import asyncio

import pytest
import ray

from slime.utils import http_utils
from tests._args import make_args
from tests.test_cpu_server import start_cpu_server, stop_cpu_server

GREEDY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}


@pytest.fixture
def server(tiny_kit):
    proc, url = start_cpu_server(tiny_kit[0])
    yield url
    stop_cpu_server(proc)


@pytest.fixture
def dispatcher(ray_session):
    http_utils.init_http_client(make_args("--use-distributed-post", "--rollout-num-gpus-per-node", "2"))
    yield http_utils._dispatcher
    for p in http_utils._dispatcher.posters:
        ray.kill(p)
    http_utils._dispatcher = None


def _tokens(output):
    return [t for _, t, _ in output["meta_info"]["output_token_logprobs"]]


def test_posts_go_round_robin_through_the_posters_and_keep_their_errors(server, dispatcher):
    assert len(dispatcher.posters) == 2  # --num-gpus-per-node on the one alive node
    local = asyncio.run(http_utils._request("POST", server + "/generate", {**GREEDY, "return_logprob": True}))

    async def four():
        payload = {**GREEDY, "return_logprob": True}
        return await asyncio.gather(*(http_utils.post(server + "/generate", payload) for _ in range(4)))

    outputs = asyncio.run(four())
    assert [_tokens(o) for o in outputs] == [_tokens(local)] * 4
    assert ray.get([p.num_sent.remote() for p in dispatcher.posters]) == [2, 2]

    # an HTTP error reaches the caller as its own type, not retried
    with pytest.raises(http_utils.HTTPStatusError) as e:
        asyncio.run(
            http_utils.post(server + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}})
        )
    assert 400 <= e.value.status < 500 and e.value.url == server + "/generate"

    # each timed-out attempt reaches the caller's on_retry, then the one-line ConnectionError
    seen = []
    slow = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with pytest.raises(ConnectionError, match=f"POST {server}/generate failed after 2 attempt"):
        asyncio.run(http_utils.post(server + "/generate", slow, max_retries=2, timeout=0.05, on_retry=seen.append))
    assert len(seen) == 2 and all(isinstance(x, asyncio.TimeoutError) for x in seen)

    # a poster that died is skipped: its turn goes to the one left
    dead = dispatcher.posters[0]
    ray.kill(dead)
    outputs = [
        asyncio.run(http_utils.post(server + "/generate", {**GREEDY, "return_logprob": True})) for _ in range(2)
    ]
    assert [_tokens(o) for o in outputs] == [_tokens(local)] * 2 and dispatcher.posters == [
        d for d in dispatcher.posters if d != dead
    ]
    assert len(dispatcher.posters) == 1
