"""`EngineGroup`: one sglang-router and the inference engines behind it, the policy's or a frozen model's
(--sglang-config). `RolloutManager` holds one of each and decides what a failure means (fail the run, take the
engine out, replace it); the group does the lifecycle: start, health checks, removal, replacement in the same
placement-group bundle, memory release and resume, router restart, shutdown."""

import logging
import time

import ray

from slime.backends.sglang_utils.router import add_worker, launch_router, remove_worker, stop_router
from slime.ray.engines import engine_layout, new_engine, start_engines

logger = logging.getLogger(__name__)


class EngineGroup:
    """The engines of one model behind one router. An engine is addressed by its node-0 actor (the one that takes
    requests and admin calls): `engines[j]` and `urls[j]`; `engines[j]` is None while engine j is removed, until
    `replace` starts a new one in its placement-group slot."""

    def __init__(self, name, args, pg, router_ip=None, router_port=None, router_process=None):
        self.name = name  # the frozen model's; None for the policy
        # how messages name one engine
        self.what = "inference engine" if name is None else f"frozen model {name!r} engine"
        self.args, self.pg = args, pg  # the run's args: router flags, API key
        self.router_ip, self.router_port, self.router_process = router_ip, router_port, router_process
        self.blocks = []  # (engine args, first slot, [actor per node]) per set of engines started together
        self.engines, self.urls = [], []
        self.slots = []  # per engine: (block, position of its node-0 actor in the block, nodes per engine)

    @property
    def router_url(self) -> str:
        return f"http://{self.router_ip}:{self.router_port}"

    @property
    def actors(self) -> list:
        """Every engine actor, one per node of each engine, in slot order (None while removed)."""
        return [a for _, _, actors in self.blocks for a in actors]

    def live(self, indices=None) -> list:
        """The node-0 actors of the engines in `indices` (default all) that are in service."""
        indices = range(len(self.engines)) if indices is None else indices
        return [self.engines[j] for j in indices if self.engines[j] is not None]

    # ------------------------------------------------------------------ start
    def start(self, blocks):
        """Start the engines of `blocks`, [(engine args, first placement-group slot)]: a block's engines fill its
        slots in order (ports by position within the block) and join the router."""
        for a, first in blocks:
            _, count, nodes = engine_layout(a)
            actors = [new_engine(a, self.pg, first + i) for i in range(count)]
            start_engines(a, actors, range(count))
            self._add_block(a, first, actors, nodes)
        self.urls = ray.get([e.get_url.remote() for e in self.engines])

    def attach(self, actors):
        """Engines slime did not start (--rollout-external-engine-addrs), one actor each, already attached: they have
        no slot, so they are never replaced."""
        self._add_block(self.args, None, actors, 1)
        self.urls = ray.get([e.get_url.remote() for e in self.engines])

    def _add_block(self, a, first, actors, nodes):
        b = len(self.blocks)
        self.blocks.append((a, first, actors))
        self.engines += actors[::nodes]
        self.slots += [(b, i, nodes) for i in range(0, len(actors), nodes)]

    def bundle(self, j) -> int:
        """The placement-group bundle of engine j's first GPU (where a replacement lands too)."""
        b, i, _ = self.slots[j]
        a, first, _ = self.blocks[b]
        return self.pg[1][(first + i) * engine_layout(a)[0]]

    # ------------------------------------------------------------------ faults
    def failed_engines(self, timeout: float, halted=lambda: False):
        """Yield (index, why) of each engine in service that does not answer /health_generate within `timeout`
        seconds; all are asked at once. Stops, saying nothing more, once `halted()` (a paused check: an engine busy
        receiving weights or with its memory released refuses to generate)."""
        refs = {j: e.health_generate.remote(timeout=timeout) for j, e in enumerate(self.engines) if e is not None}
        # the Ray-level deadline covers an engine actor that is itself stuck; the HTTP timeout is the engine's own
        deadline = time.monotonic() + timeout + 10
        for j, ref in refs.items():
            if halted():
                return
            try:
                ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                continue
            except ray.exceptions.GetTimeoutError:
                why = f"did not answer /health_generate within {timeout:g}s (hung?)"
            except ray.exceptions.RayActorError as e:
                why = f"engine actor died ({type(e).__name__})"
            except Exception as e:  # noqa: BLE001  (an HTTP error or timeout raised by the engine, or its server died)
                why = str(getattr(e, "cause", None) or e).splitlines()[0][:300]
            if halted():  # a check that overlapped a pause (a weight update refuses generation with 503) says nothing
                return
            yield j, why

    def remove(self, j):
        """Take engine j out of service: off the router first (no new request goes there), then its actors killed
        (a server slime started dies with its actor; an external one is left alone). Its slot stays for `replace`."""
        try:
            remove_worker(self.router_url, self.urls[j])
        except Exception as e:  # noqa: BLE001  (the router may not list it any more; a dead one is restarted apart)
            logger.warning("could not remove %s %s from its router: %s", self.what, self.urls[j], e)
        b, i, nodes = self.slots[j]
        actors = self.blocks[b][2]
        for k in range(i, i + nodes):
            if actors[k] is not None:
                ray.kill(actors[k])
                actors[k] = None
        self.engines[j] = None

    def replace(self, indices, join_router=True):
        """Start a new engine in the slots of each engine in `indices` (one still in service is removed first); each
        joins the router unless `join_router` is False. Their new URLs are in `urls`."""
        for j in indices:
            if self.engines[j] is not None:
                self.remove(j)
        by_block = {}
        for j in indices:
            b, i, nodes = self.slots[j]
            by_block.setdefault(b, []).extend(range(i, i + nodes))
        for b, positions in by_block.items():
            a, first, actors = self.blocks[b]
            for k in positions:
                actors[k] = new_engine(a, self.pg, first + k)
            start_engines(a, actors, positions, join_router=join_router)
        for j in indices:
            b, i, _ = self.slots[j]
            self.engines[j] = self.blocks[b][2][i]
            self.urls[j] = ray.get(self.engines[j].get_url.remote())

    def compact(self) -> bool:
        """Forget removed engines for good (external ones, never replaced), so the indices are those of the engines
        left. True if any was removed."""
        keep = [j for j, e in enumerate(self.engines) if e is not None]
        if len(keep) == len(self.engines):
            return False
        self.engines = [self.engines[j] for j in keep]
        self.urls = [self.urls[j] for j in keep]
        self.blocks = [(self.args, None, list(self.engines))]
        self.slots = [(0, j, 1) for j in range(len(self.engines))]
        return True

    def restart_router(self, keep_off=()):
        """A new router on the same address (every client's URL stays valid), with every engine in service except
        those in `keep_off`."""
        self.router_process = launch_router(self.args, self.router_ip, self.router_port)
        for j, url in enumerate(self.urls):
            if self.engines[j] is not None and j not in keep_off:
                add_worker(self.router_url, url, api_key=self.args.sglang_api_key)

    # ------------------------------------------------------------------ memory and shutdown
    def release_memory(self, indices=None) -> list:
        return [e.release_memory_occupation.remote() for e in self.live(indices)]

    def resume_memory(self, tags=None, indices=None) -> list:
        return [e.resume_memory_occupation.remote(tags=tags) for e in self.live(indices)]

    def shutdown(self):
        """Stop the engines (each removes itself from the router and kills its server), then the router."""
        actors = [a for a in self.actors if a is not None]
        try:
            ray.get([a.shutdown.remote() for a in actors], timeout=60)
        except Exception as e:  # noqa: BLE001  (an engine that already died has nothing left to stop)
            logger.warning("%s shutdown: %s", self.what, e)
        for a in actors:
            ray.kill(a)
        self.blocks, self.engines, self.urls, self.slots = [], [], [], []
        stop_router(self.router_process)
        self.router_process = None
