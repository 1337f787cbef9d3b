"""--use-distributed-post: the rollout's HTTP posts leave from Ray actors spread over the cluster (`--num-gpus-per-node`
on every alive node) instead of one process, so a large rollout's request/response handling (JSON of long token
lists) is not bound to the rollout controller's one core. Posts go round-robin; a poster that died is skipped and
its posts are sent from the caller's process."""

import itertools
import logging

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from slime.utils import http_utils

logger = logging.getLogger(__name__)


class HttpPoster:
    """One poster: an async actor with its own event loop and HTTP session."""

    def __init__(self):
        self.sent = 0

    async def post(self, url, payload, max_retries, timeout, headers):
        """(output, failed attempts, error): the attempts' exceptions go back to the caller's `on_retry`, and an
        error is returned rather than raised so it reaches the caller as its own type."""
        self.sent += 1
        failures = []
        try:
            output = await http_utils._request(
                "POST",
                url,
                payload,
                max_retries=max_retries,
                timeout=timeout,
                headers=headers,
                on_retry=failures.append,
            )
        except (http_utils.HTTPStatusError, ConnectionError) as e:
            return None, failures, e
        return output, failures, None

    def num_sent(self):
        return self.sent


class Dispatcher:
    def __init__(self, posters):
        self.posters = list(posters)
        self._turn = itertools.count()

    async def post(self, url, payload, max_retries, timeout, headers, on_retry):
        while self.posters:
            poster = self.posters[next(self._turn) % len(self.posters)]
            try:
                output, failures, error = await poster.post.remote(url, payload, max_retries, timeout, headers)
            except ray.exceptions.RayActorError as e:
                logger.warning("--use-distributed-post: a poster died (%s); posting without it", e)
                self.posters.remove(poster)
                continue
            for failure in failures:
                if on_retry is not None:
                    on_retry(failure)
            if error is not None:
                raise error
            return output
        return await http_utils._request(
            "POST", url, payload, max_retries=max_retries, timeout=timeout, headers=headers, on_retry=on_retry
        )


def start_posters(num_per_node: int) -> list:
    """`num_per_node` posters on every alive Ray node, owned by this process (they end with it)."""
    actor_cls = ray.remote(num_cpus=0)(HttpPoster)
    return [
        actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote()
        for node in ray.nodes()
        if node["Alive"]
        for _ in range(num_per_node)
    ]
