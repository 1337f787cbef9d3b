"""RolloutManager: the driver-side owner of the router, the inference engines, the weight-update lock and the
RolloutController actor that turns rollouts into training data."""
import logging

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.backends.sglang_utils.router import start_router, stop_router
from slime.backends.sglang_utils.sglang_engine import SGLangEngine
from slime.ray.buffer import RolloutController
from slime.ray.utils import Lock, noset_visible_devices_env, register_cleanup

logger = logging.getLogger(__name__)


def _start_router(args):
    """Start sglang-router unless --sglang-router-ip points at an external one. Returns the process (or None)."""
    if args.sglang_router_ip is not None or args.debug_train_only:
        return None
    return start_router(args)


def create_rollout_engines(args, pg):
    if args.debug_train_only:
        return []
    num_gpu_per_engine = min(args.rollout_num_gpus_per_engine, args.rollout_num_gpus_per_node)
    num_engines = args.rollout_num_gpus // num_gpu_per_engine
    pg, reordered_bundle_indices = pg
    engine_cls = ray.remote(SGLangEngine)
    engines = [
        engine_cls.options(
            num_cpus=0.2, num_gpus=0.2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_capture_child_tasks=True,
                placement_group_bundle_index=reordered_bundle_indices[i * num_gpu_per_engine]),
            runtime_env={"env_vars": noset_visible_devices_env()},
        ).remote(args, rank=i)
        for i in range(num_engines)
    ]
    ray.get([e.init.remote(**ports) for e, ports in zip(engines, _allocate_ports(args, engines))])
    return engines


def _allocate_ports(args, engines):
    """Per node, starting at 10000: `port`, `nccl_port` and a `dist_init_addr` per engine (shared by a multi-node engine)."""
    gpus_per_engine = args.rollout_num_gpus_per_engine
    nodes_per_engine = max(1, gpus_per_engine // args.rollout_num_gpus_per_node)
    engines_per_node = max(1, min(args.rollout_num_gpus_per_node, args.rollout_num_gpus) // gpus_per_engine)
    addr_and_ports = [{} for _ in engines]
    dp_size = args.sglang_dp_size or 1
    for node_start in range(0, len(engines), engines_per_node):
        cursor = 10000
        node_engines = range(node_start, min(node_start + engines_per_node, len(engines)))

        def take(consecutive=1):
            nonlocal cursor
            addr, port = ray.get(engines[node_start]._get_current_node_ip_and_free_port.remote(start_port=cursor, consecutive=consecutive))
            cursor = port + consecutive
            return addr, port

        for i in node_engines:
            addr_and_ports[i]["port"] = take()[1]
            addr_and_ports[i]["nccl_port"] = take()[1]
            if i % nodes_per_engine == 0:  # the first node of an engine owns its rendezvous address
                addr, port = take(6 + dp_size)
                for j in range(i, min(i + nodes_per_engine, len(engines))):
                    addr_and_ports[j]["dist_init_addr"] = f"{addr}:{port}"
    for i, ports in enumerate(addr_and_ports):
        assert {"port", "nccl_port", "dist_init_addr"} <= ports.keys(), f"engine {i} got incomplete ports {ports}"
    return addr_and_ports


class RolloutManager:
    def __init__(self, args, pg, wandb_run_id=None):
        self.args = args
        self.router_process, self.all_rollout_engines, self.controller, self.rollout_engine_lock = None, [], None, None
        register_cleanup(self.shutdown)
        self.router_process = _start_router(args)
        self.controller = RolloutController.options(num_cpus=1, num_gpus=0).remote(args, wandb_run_id)
        self.all_rollout_engines = create_rollout_engines(args, pg)
        nodes_per_engine = max(1, args.rollout_num_gpus_per_engine // args.rollout_num_gpus_per_node)
        # Only the node-0 process of a multi-node engine receives requests and admin calls.
        self.rollout_engines = self.all_rollout_engines[::nodes_per_engine]
        self.rollout_engine_lock = Lock.options(num_cpus=0, num_gpus=0).remote()
        if args.offload and self.rollout_engines:
            ray.get([e.release_memory_occupation.remote() for e in self.rollout_engines])

    def async_generate(self, rollout_id):
        return self.controller.generate.remote(rollout_id)

    def async_eval(self, rollout_id):
        return self.controller.eval.remote(rollout_id)

    def async_offload(self):
        return [e.release_memory_occupation.remote() for e in self.rollout_engines]

    def async_onload(self, tags=None):
        return [e.resume_memory_occupation.remote(tags=tags) for e in self.rollout_engines]

    def shutdown(self):
        """Stop engines (each removes itself from the router and kills its server), the controller and the router."""
        try:
            ray.get([e.shutdown.remote() for e in self.all_rollout_engines], timeout=60)
        except Exception as e:  # an engine that already died has nothing left to stop
            logger.warning(f"engine shutdown: {e}")
        for actor in [*self.all_rollout_engines, self.controller, self.rollout_engine_lock]:
            if actor is not None:
                ray.kill(actor)
        self.all_rollout_engines, self.rollout_engines, self.controller, self.rollout_engine_lock = [], [], None, None
        stop_router(self.router_process)
        self.router_process = None
