"""The frozen models of --sglang-config (a judge, a teacher, a reference): each with its own sglang-router and its
engines in the rollout placement group, after the policy's GPUs. They never receive weights: the trainers connect
only to the policy's engines (`RolloutManager.rollout_engines`). See docs/multi_model.md."""

import argparse
import logging

import ray

from slime.backends.sglang_utils.router import launch_router, remove_worker, stop_router
from slime.backends.sglang_utils.sglang_config import frozen_models
from slime.ray.engines import new_engine, start_engines
from slime.utils.http_utils import free_port, get_host_info

logger = logging.getLogger(__name__)


def engine_args(args, model, group, router_ip, router_port):
    """The args a frozen model's engine is started with: the run's, with its model, engine size, router and
    per-group SGLang overrides."""
    a = argparse.Namespace(**vars(args))
    a.hf_checkpoint = model.model_path
    a.rollout_num_gpus = group.num_gpus
    a.rollout_num_gpus_per_engine = a.sglang_tp_size = group.num_gpus_per_engine
    a.served_models = None  # so the engine layout helpers see this group alone
    a.sglang_router_ip, a.sglang_router_port = router_ip, router_port
    a.enable_lora = False  # the policy's adapters are not this model's
    a.check_weight_update_equal = False
    if args.offload_rollout and args.inference_server == "sglang":
        # released with the policy's engines, it must get its own weights back on resume: nobody pushes them
        a.sglang_enable_weights_cpu_backup = True
    for key, value in group.overrides.items():
        setattr(a, f"sglang_{key}", value)
    return a


class FrozenModel:
    """One frozen model: its router process and engines (node-0 actors in `engines`)."""

    def __init__(self, args, model):
        self.args, self.model = args, model
        self.name = model.name
        self.router_ip, self.router_port = get_host_info()[1], free_port()
        self.router_process = launch_router(args, self.router_ip, self.router_port)
        self.groups = []  # (engine args, [engine actors]) per regular server group
        self.engines, self.engine_urls = [], []
        self.slots = []  # per engine in `engines`: (engine args, engine slot, nodes per engine)
        self.pg = None

    @property
    def router_url(self) -> str:
        return f"http://{self.router_ip}:{self.router_port}"

    def start_engines(self, pg):
        self.pg = pg
        for group in self.model.engine_groups:
            a = engine_args(self.args, self.model, group, self.router_ip, self.router_port)
            per_node = min(group.num_gpus_per_engine, a.rollout_num_gpus_per_node)
            first = group.gpu_offset // per_node  # the engine slot of the group's first GPU
            actors = [new_engine(a, pg, first + i) for i in range(group.num_gpus // per_node)]
            start_engines(a, actors, range(len(actors)))  # ports by position within the group
            nodes = max(1, group.num_gpus_per_engine // a.rollout_num_gpus_per_node)
            self.groups.append((a, actors))
            self.engines += actors[::nodes]
            self.slots += [(a, first + i, nodes) for i in range(0, len(actors), nodes)]
        self.engine_urls = ray.get([e.get_url.remote() for e in self.engines])
        print(f"frozen model {self.name!r}: engines {self.engine_urls} behind sglang-router {self.router_url}")

    def failed_engines(self, timeout: float) -> list:
        """(index, why) of each engine that does not answer /health_generate within `timeout` seconds."""
        refs = {j: e.health_generate.remote(timeout=timeout) for j, e in enumerate(self.engines)}
        failed = []
        for j, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout + 10)
            except ray.exceptions.GetTimeoutError:
                failed.append((j, f"did not answer /health_generate within {timeout:g}s (hung?)"))
            except Exception as e:  # noqa: BLE001  (its actor died, or its server did, or it answered an error)
                failed.append((j, str(getattr(e, "cause", None) or e).splitlines()[0][:300]))
        return failed

    def replace(self, j: int) -> str:
        """Kill engine `j` and start a new one in its placement-group bundle; it serves the model's own checkpoint,
        so it joins the router at once (nothing is pushed to a frozen model). Returns the new URL."""
        a, slot, nodes = self.slots[j]
        if nodes > 1:
            raise RuntimeError(f"frozen model {self.name!r}: a multi-node engine cannot be replaced")
        try:
            remove_worker(self.router_url, self.engine_urls[j])
        except Exception as e:  # noqa: BLE001  (the router may not list it any more)
            logger.warning(
                "frozen model %s: could not remove %s from its router: %s", self.name, self.engine_urls[j], e
            )
        old = self.engines[j]
        ray.kill(old)  # its server dies with it (parent-death signal)
        new = new_engine(a, self.pg, slot)
        start_engines(a, [new], [0])
        self.engines[j] = new
        self.groups = [(ga, [new if e is old else e for e in actors]) for ga, actors in self.groups]
        self.engine_urls[j] = ray.get(new.get_url.remote())
        return self.engine_urls[j]

    def shutdown(self):
        actors = [e for _, group in self.groups for e in group]
        try:
            ray.get([e.shutdown.remote() for e in actors], timeout=60)
        except Exception as e:  # noqa: BLE001  (an engine that already died has nothing left to stop)
            logger.warning("frozen model %s: engine shutdown: %s", self.name, e)
        for e in actors:
            ray.kill(e)
        self.groups, self.engines = [], []
        stop_router(self.router_process)
        self.router_process = None


def start_frozen_routers(args) -> list:
    """A router per frozen model (before the controller starts, so rollout and reward code get their addresses)."""
    return [FrozenModel(args, m) for m in frozen_models(args)]
