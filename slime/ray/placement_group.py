"""GPU reservation: one PACK placement group of {"GPU": 1, "CPU": 1} bundles, split between trainers and engines.

On a machine without GPUs the same code runs over logical GPUs (`ray.init(num_gpus=N)`); see `init_ray`.
"""

import logging
import os
import socket
import time

import ray
from ray._private.services import canonicalize_bootstrap_address
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.ray.actor_group import RayTrainGroup
from slime.ray.driver import register_cleanup
from slime.ray.rollout import RolloutManager
from slime.ray.utils import (
    driver_import_path,
    driver_runtime_env,
    noset_visible_devices_env,  # noqa: F401  (re-exported: slime's path)
)
from slime.utils.device import local_ray_resources
from slime.utils.startup_checks import check_cluster

logger = logging.getLogger(__name__)
PG_READY_TIMEOUT_S = float(os.environ.get("SLIME_PG_READY_TIMEOUT", 60))


# max_calls=0: a GPU task's worker is otherwise ended after one call (Ray's default for GPU tasks), which would start
# a new process per bundle, as an actor does
@ray.remote(num_gpus=1, num_cpus=0, max_calls=0)
def node_ip_and_gpu_id():
    """What a bundle holds: its node's IP and the GPU id Ray gives it. A task, not an actor (slime's InfoActor): it
    runs in one of Ray's pooled workers instead of starting and killing a worker process per bundle."""
    return ray.util.get_node_ip_address(), ray.get_gpu_ids()[0]


def sort_key(x):
    """Order bundles by (node IP as integers, GPU id); hostnames are resolved, unresolvable ones compared by characters."""
    _, node_identifier, gpu_id = x
    try:
        node_ip_parts = [int(p) for p in node_identifier.split(".")]
        assert len(node_ip_parts) == 4
    except (ValueError, AssertionError):
        try:
            node_ip_parts = [int(p) for p in socket.gethostbyname(node_identifier).split(".")]
        except (socket.gaierror, OSError, ValueError):
            node_ip_parts = [ord(c) for c in node_identifier]
    return node_ip_parts, int(gpu_id)


def get_placement_group_layout(args) -> tuple[int, int]:
    """(num_gpus, rollout_offset) of the single placement group for this run (docs/architecture.md, Placement)."""
    actor_total = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.debug_train_only:
        return actor_total, 0
    if args.debug_rollout_only:
        return args.rollout_num_gpus, 0
    if args.colocate:
        return max(actor_total, args.rollout_num_gpus or 0), 0
    return actor_total + args.rollout_num_gpus, actor_total


def _create_placement_group(num_gpus):
    """Reserve `num_gpus` bundles and return (pg, bundle indices reordered by node IP and physical GPU id)."""
    bundles = [{"GPU": 1, "CPU": 1} for _ in range(num_gpus)]  # check_cluster (in init_ray) proved they fit
    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=PG_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        state = placement_group_table(pg)
        remove_placement_group(pg)  # a pending PG would keep retrying and grab resources later
        raise RuntimeError(
            f"placement group of {num_gpus} GPU bundles not ready after {PG_READY_TIMEOUT_S:.0f}s "
            f"(state={state.get('state')}, {state.get('stats', {}).get('scheduling_state')}); "
            f"free resources: { {k: v for k, v in ray.available_resources().items() if '_group_' not in k} }"
        ) from None
    infos = ray.get(
        [
            node_ip_and_gpu_id.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
            ).remote()
            for i in range(num_gpus)
        ],
        timeout=PG_READY_TIMEOUT_S,
    )
    ordered = sorted(((i, ip, gpu) for i, (ip, gpu) in enumerate(infos)), key=sort_key)
    for rank, (bundle, ip, gpu) in enumerate(ordered):
        logger.info(f"placement: rank {rank} -> bundle {bundle} (node {ip}, GPU {gpu})")
    return pg, [bundle for bundle, _, _ in ordered]


def create_placement_groups(args):
    num_gpus, rollout_offset = get_placement_group_layout(args)
    pg, reordered = _create_placement_group(num_gpus)
    register_cleanup(lambda: remove_placement_group(pg))
    return {"actor": (pg, reordered), "rollout": (pg, reordered[rollout_offset:])}


def allocate_train_group(args, num_nodes, num_gpus_per_node, pg, wandb_run_id=None, num_gpus_per_actor=0.8):
    return RayTrainGroup(
        args, num_nodes, num_gpus_per_node, pg, wandb_run_id=wandb_run_id, num_gpus_per_actor=num_gpus_per_actor
    )


def create_actor_group(args, pg, wandb_run_id=None):
    # with a critic on the same bundles each trainer takes 0.4 (engines colocated there take 0.2)
    share = 0.4 if args.use_critic else 0.8
    return allocate_train_group(args, args.actor_num_nodes, args.actor_num_gpus_per_node, pg, wandb_run_id, share)


def create_rollout_manager(args, pg, wandb_run_id=None):
    return RolloutManager(args, pg, wandb_run_id=wandb_run_id)


def init_ray(args):
    """Join the cluster in RAY_ADDRESS, or the one `ray start` left running on this machine (as `ray job submit` /
    launch-script users do); otherwise start a local Ray. Then check the run fits the cluster, before any actor.

    Without GPUs the local Ray declares as many logical GPUs as the layout needs, so placement is the same code.
    """
    num_gpus, _ = get_placement_group_layout(args)
    if not ray.is_initialized():
        # the driver's import path reaches every actor, whether this driver starts Ray or joins a cluster
        runtime_env = driver_runtime_env({"RAY_DEDUP_LOGS": "0", "PYTHONPATH": driver_import_path()})
        # RAY_ADDRESS as given (ray:// too), else the address file of a `ray start` cluster; None: none to join
        address = os.environ.get("RAY_ADDRESS") or canonicalize_bootstrap_address(None)
        if address is not None:
            # its resources are the cluster's, not ours; SLIME_HOST_IP pins the driver's node address (several Ray
            # nodes on one machine, e.g. 127.0.0.2 and 127.0.0.3)
            ray.init(
                address=address,
                runtime_env=runtime_env,
                _node_ip_address=os.environ.get("SLIME_HOST_IP") or None,
            )
        else:
            kwargs = dict(include_dashboard=False, runtime_env=runtime_env, **local_ray_resources(num_gpus))
            t0 = time.time()
            ray.init(**kwargs)
            logger.info(f"started a local Ray in {time.time() - t0:.1f}s with {ray.cluster_resources()}")
    check_cluster(args, num_gpus)
