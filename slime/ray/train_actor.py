import abc
import os
from datetime import timedelta

import ray
import torch.distributed as dist

from slime.observability import wandb_utils
from slime.ray.ray_actor import RayActor
from slime.utils import device
from slime.utils.distributed_utils import rendezvous_socket, tcp_store
from slime.utils.tensor_serialization import set_shared_authkey


def process_group_settings(args):
    """The trainers' process group, as current slime: `--distributed-backend` (default nccl on GPU, gloo on CPU) and
    `--distributed-timeout-minutes` (Megatron's default 10) for every collective and the rendezvous."""
    return args.distributed_backend or device.dist_backend(), timedelta(minutes=args.distributed_timeout_minutes)


class TrainRayActor(RayActor):
    """Base of the training actors: rank bookkeeping and the training process group (NCCL on GPU, gloo on CPU)."""

    def __init__(self, world_size, rank, master_addr, master_port, wandb_run_id=None):
        self._world_size, self._rank = world_size, rank
        if master_addr:
            self.master_addr, self.master_port = master_addr, master_port
        else:  # rank 0: its rendezvous port is bound now and held until `init` listens on it
            self.master_addr = self._node_ip()
            self._store_socket = rendezvous_socket(self.master_addr)
            self.master_port = self._store_socket.getsockname()[1]
        os.environ.update(
            MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port), WORLD_SIZE=str(world_size), RANK=str(rank)
        )
        gpu_ids = ray.get_gpu_ids()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        local_rank = 0
        if gpu_ids:
            gid = str(int(gpu_ids[0]))
            local_rank = visible.split(",").index(gid) if visible and gid in visible.split(",") else int(gid)
        os.environ["LOCAL_RANK"] = str(device.local_rank(local_rank))
        set_shared_authkey()  # colocated weight sync passes shared-memory handles between actors

    def init(self, args, role, wandb_run_id=None, with_ref=False):
        self.args, self.role = args, role
        local_rank = int(os.environ["LOCAL_RANK"])
        device.set_device(local_rank)
        # the env:// rendezvous values: set in __init__ under Ray, by the launcher (torchrun, a test harness) otherwise
        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        backend, timeout = process_group_settings(args)
        held = self.__dict__.pop("_store_socket", None)
        store = tcp_store(addr, port, world_size, rank == 0, timeout, sock=held)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        args.rank, args.world_size = dist.get_rank(), dist.get_world_size()
        args.local_rank = local_rank

    def finish_tracking(self):
        """This rank's side of the W&B run, closed before the driver finishes the run and kills the actors."""
        if getattr(self, "args", None) is not None:
            wandb_utils.finish_secondary(self.args)

    @abc.abstractmethod
    def sleep(self, tags=None): ...

    @abc.abstractmethod
    def wake_up(self, tags=None): ...

    @abc.abstractmethod
    def connect_rollout_engines(self, rollout_engines, rollout_engine_lock): ...

    @abc.abstractmethod
    def train(self, rollout_id, rollout_data_ref): ...

    @abc.abstractmethod
    def save_model(self, iteration, with_optimizer=True): ...

    @abc.abstractmethod
    def update_weights(self, weight_version=None): ...

    def sent_weight_hashes(self):
        """`{"update_weights/tensor_hashes": {HF name: hash}, ...}` of what the last `update_weights` sent, for the
        driver's fingerprint check (slime.ray.weight_checks); a trainer that hashes nothing returns {}."""
        return {}
