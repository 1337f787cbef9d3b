"""Driver-side handle over the N training actors; every `async_*` returns a list of ObjectRefs (one per rank)."""

import logging
import os

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.ray.driver import register_cleanup
from slime.ray.utils import driver_import_path, noset_visible_devices_env
from slime.utils.device import allocator_hook_possible, trainer_env

logger = logging.getLogger(__name__)


class RayTrainGroup:
    def __init__(
        self,
        args,
        num_nodes,
        num_gpus_per_node,
        pg,
        wandb_run_id=None,
        num_gpus_per_actor=1,
        resources=None,
        num_resources_per_node=None,
    ):
        # `resources` / `num_resources_per_node`: slime's signature; slime does not use them either (placement
        # is the bundles of `pg`), so callers written for slime keep working.
        self.args = args
        self._num_nodes, self._num_gpus_per_node = num_nodes, num_gpus_per_node
        self._pg, self._num_gpus_per_actor = pg, num_gpus_per_actor
        self.wandb_run_id = wandb_run_id
        register_cleanup(self.kill)
        self._allocate_gpus_for_actor(pg, num_gpus_per_actor, wandb_run_id)

    def _allocate_gpus_for_actor(self, pg, num_gpus_per_actor, wandb_run_id):
        from slime.backends.megatron_utils.actor import MegatronTrainRayActor  # heavy: Megatron

        world_size = self._num_nodes * self._num_gpus_per_node
        pg, reordered_bundle_indices = pg
        env = {"NCCL_CUMEM_ENABLE": "0", **noset_visible_devices_env(), **trainer_env(), **self.args.train_env_vars}
        if "PYTHONPATH" in self.args.train_env_vars:  # the user's entries first, then the driver's import path
            env["PYTHONPATH"] = os.pathsep.join([self.args.train_env_vars["PYTHONPATH"], driver_import_path()])
        if self.args.offload_train and allocator_hook_possible():
            env.update(_torch_memory_saver_env())
        actor_cls = ray.remote(num_gpus=1, runtime_env={"env_vars": env})(MegatronTrainRayActor)
        self._actor_handlers = []
        master_addr, master_port = None, None
        for rank in range(world_size):
            actor = actor_cls.options(
                num_cpus=num_gpus_per_actor,
                num_gpus=num_gpus_per_actor,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=reordered_bundle_indices[rank]
                ),
            ).remote(world_size, rank, master_addr, master_port, wandb_run_id)
            if rank == 0:
                master_addr, master_port = ray.get(actor.get_master_addr_and_port.remote(), timeout=300)
            self._actor_handlers.append(actor)

    @property
    def actors(self):
        return self._actor_handlers

    # --release-train: the group outlives its processes (the driver and the watchdog keep this handle)
    @property
    def released(self):
        return not self._actor_handlers

    def create(self):
        """New trainer processes in the bundles of the ones `kill` shut down (call `async_init` next)."""
        self._allocate_gpus_for_actor(self._pg, self._num_gpus_per_actor, self.wandb_run_id)

    def async_continue_weight_version(self, version):
        """New trainers take over the weight versions where the released ones stopped (the engines hold `version`)."""
        return [a.continue_weight_version.remote(version) for a in self._actor_handlers]

    def async_init(self, args, role, with_ref=False):
        return [a.init.remote(args, role, self.wandb_run_id, with_ref=with_ref) for a in self._actor_handlers]

    def async_init_weight_update_connections(self, rollout):
        """Connect every rank to `rollout`'s engines (a RolloutManager: its engines and weight-update lock)."""
        return [
            a.connect_rollout_engines.remote(rollout.rollout_engines, rollout.rollout_engine_lock)
            for a in self._actor_handlers
        ]

    def async_train(self, rollout_id, rollout_data_ref, values_ref=None):
        if values_ref is None:  # the call every trainer has, custom ones included
            return [a.train.remote(rollout_id, rollout_data_ref) for a in self._actor_handlers]
        return [a.train.remote(rollout_id, rollout_data_ref, values_ref) for a in self._actor_handlers]

    def async_save_model(self, step_id, commit=True):
        return [a.save_model.remote(step_id, commit=commit) for a in self._actor_handlers]

    def async_finalize_save(self, blocking=True):
        return [a.finalize_save.remote(blocking) for a in self._actor_handlers]

    def async_update_weights(self, weight_version=None):
        return [a.update_weights.remote(weight_version) for a in self._actor_handlers]

    def async_sent_weight_hashes(self):
        return [a.sent_weight_hashes.remote() for a in self._actor_handlers]

    def async_finish_tracking(self):
        return [a.finish_tracking.remote() for a in self._actor_handlers]

    def async_offload(self):
        return [a.sleep.remote(("model",)) for a in self._actor_handlers]

    def kill(self):
        # Ask the actors to exit first (quietly, after their current call); force-kill whatever is still alive.
        ray.wait(
            [a.__ray_terminate__.remote() for a in self._actor_handlers],
            num_returns=len(self._actor_handlers),
            timeout=10,
        )
        for a in self._actor_handlers:
            ray.kill(a)
        self._actor_handlers = []


def _torch_memory_saver_env() -> dict:
    """Preload torch_memory_saver's hook in GPU trainers with --offload so `sleep` can pause every allocation (with a
    CPU backup). Without the package the trainers move their storages to pinned memory themselves."""
    try:
        from torch_memory_saver.utils import get_binary_path_from_package  # optional: the [sglang] GPU extra
    except ImportError:
        logger.info("--offload: torch_memory_saver is not installed; trainers offload by copying to pinned memory")
        return {}
    path = str(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))
    return {"LD_PRELOAD": path, "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
