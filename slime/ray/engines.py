"""Inference engine actors in the rollout placement group, for the policy's engines and the frozen models' alike
(`slime.ray.engine_group.EngineGroup` holds them). An engine's slot is its index in the placement group's engine
order; a replacement lands in the same slot, hence the same bundle."""

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.backends.sglang_utils.sglang_config import policy_num_gpus
from slime.backends.sglang_utils.sglang_engine import SGLangEngine
from slime.ray.utils import noset_visible_devices_env


def engine_layout(args):
    """(GPUs per engine on one node, number of engines, nodes per engine)."""
    num_gpu_per_engine = min(args.rollout_num_gpus_per_engine, args.rollout_num_gpus_per_node)
    return (
        num_gpu_per_engine,
        policy_num_gpus(args) // num_gpu_per_engine,
        max(1, args.rollout_num_gpus_per_engine // args.rollout_num_gpus_per_node),
    )


def new_engine(args, pg, rank):
    """The engine actor of slot `rank`, in its placement-group bundle (a replacement lands in the same one)."""
    num_gpu_per_engine, _, _ = engine_layout(args)
    pg, reordered_bundle_indices = pg
    return (
        ray.remote(SGLangEngine)
        .options(
            num_cpus=0.2,
            num_gpus=0.2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_capture_child_tasks=True,
                placement_group_bundle_index=reordered_bundle_indices[rank * num_gpu_per_engine],
            ),
            runtime_env={"env_vars": noset_visible_devices_env()},
        )
        .remote(args, rank=rank)
    )


def start_engines(args, engines, ranks, join_router=True):
    """Start the servers of `engines[r]` for r in `ranks` (ports per node, as at start-up); each joins the router
    unless `join_router` is False."""
    ports = allocate_ports(args, engines, ranks)
    ray.get([engines[r].init.remote(**ports[r], join_router=join_router) for r in ranks])


def attach_external_engines(args):
    """One engine actor per --rollout-external-engine-addrs server (no GPU, no bundle: the server has its own),
    attached to it rather than starting one."""
    engines = [
        ray.remote(SGLangEngine).options(num_cpus=0.2, num_gpus=0).remote(args, rank=i)
        for i in range(len(args.rollout_external_engine_infos))
    ]
    ray.get([e.attach.remote(info["url"]) for e, info in zip(engines, args.rollout_external_engine_infos)])
    return engines


def allocate_ports(args, engines, ranks=None):
    """Per node: `port`, `nccl_port` and a `dist_init_addr` per engine (shared by a multi-node engine), from
    `free_port` and distinct within the node; only for the nodes of `ranks` (default all), probed on one of them
    (the others may be removed engines)."""
    gpus_per_engine = args.rollout_num_gpus_per_engine
    nodes_per_engine = max(1, gpus_per_engine // args.rollout_num_gpus_per_node)
    engines_per_node = max(1, min(args.rollout_num_gpus_per_node, policy_num_gpus(args)) // gpus_per_engine)
    ranks = set(range(len(engines)) if ranks is None else ranks)
    addr_and_ports = [{} for _ in engines]
    dp_size = args.sglang_dp_size or 1
    for node_start in range(0, len(engines), engines_per_node):
        taken = set()
        node_engines = range(node_start, min(node_start + engines_per_node, len(engines)))
        probe = next((engines[i] for i in node_engines if i in ranks), None)
        if probe is None:
            continue

        def take(consecutive=1):
            while True:  # a probed port stays free until a server binds it: never hand one out twice
                addr, port = ray.get(probe._get_current_node_ip_and_free_port.remote(consecutive=consecutive))
                ports = set(range(port, port + consecutive))
                if not ports & taken:
                    taken.update(ports)
                    return addr, port

        for i in node_engines:
            addr_and_ports[i]["port"] = take()[1]
            addr_and_ports[i]["nccl_port"] = take()[1]
            if i % nodes_per_engine == 0:  # the first node of an engine owns its rendezvous address
                addr, port = take(6 + dp_size)
                for j in range(i, min(i + nodes_per_engine, len(engines))):
                    addr_and_ports[j]["dist_init_addr"] = f"{addr}:{port}"
    for i in ranks:
        ports = addr_and_ports[i]
        assert {"port", "nccl_port", "dist_init_addr"} <= ports.keys(), f"engine {i} got incomplete ports {ports}"
    return addr_and_ports
