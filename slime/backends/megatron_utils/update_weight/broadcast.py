"""Weight sync by collective broadcast (NCCL on GPU, gloo on CPU): the transport of a disaggregated run unless shared
memory serves (see `choose.py`).

Each pipeline stage's source rank (dp 0, tp 0) owns a dedicated group `slime-pp_{pp_rank}` = itself (rank 0) + every
engine rank, separate from the training groups. Per bucket: tell every engine what arrives (names, dtypes, shapes),
broadcast, wait for the engines. The session around it (`UpdateWeightFromDistributed`) takes the lock, and drops dead
engines: then `regroup` builds a group of the survivors under a new name.
"""

import logging
import threading

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.utils.device import dist_backend
from slime.utils.distributed_utils import init_process_group, rendezvous_socket, seconds, tcp_store
from slime.utils.http_utils import get_host_info

from .common import WeightUpdateError, wait_engines

logger = logging.getLogger(__name__)


def gloo_safe(t: torch.Tensor, group=None) -> torch.Tensor:
    """gloo cannot broadcast float8 ("Invalid scalar type"): over gloo an FP8 tensor travels as its uint8 view (the
    same bytes; the engine receives into the same view of its buffer). NCCL takes FP8 as it is."""
    if t.dtype == torch.float8_e4m3fn and dist.get_backend(group) == "gloo":
        return t.view(torch.uint8)
    return t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class BroadcastTransport:
    name = "broadcast"

    def __init__(self, session):
        self.session = session  # the UpdateWeightFromDistributed: its args, engines, URLs, weight version
        self.group, self.group_name = None, None
        self.connections = 0  # groups built so far (one more after each engine replacement or regroup)

    @property
    def via(self) -> str:
        return self.group_name

    @property
    def connected(self) -> bool:
        return self.group is not None

    def connect(self, timeout):
        """Build a group, under a new name, of this trainer and every engine of the session."""
        self._rename()
        self._join(timeout)

    def _rename(self):
        """`slime-pp_{pp_rank}`, then `-2`, `-3`, ...: each new group gets a name of its own."""
        self.connections += 1
        self.group_name = f"slime-pp_{mpu.get_pipeline_model_parallel_rank()}" + (
            f"-{self.connections}" if self.connections > 1 else ""
        )

    def _join(self, timeout):
        """Build the group `self.group_name`: this trainer (rank 0) and every rank of the session's engines."""
        engines = self.session.rollout_engines
        gpus_per_engine = self.session.args.rollout_num_gpus_per_engine
        world_size = len(engines) * gpus_per_engine + 1
        master_address = get_host_info()[1]
        held = rendezvous_socket(master_address)  # bound before the engines learn its port: no one else can take it
        master_port = held.getsockname()[1]
        backend = dist_backend()
        refs = [
            engine.init_process_group.remote(
                master_address, master_port, i * gpus_per_engine + 1, world_size, self.group_name, backend=backend
            )
            for i, engine in enumerate(engines)
        ]
        # The trainer's side blocks until every engine rank joined; run it aside so a failing engine is reported at once.
        joined = {}

        def join():
            try:
                store = tcp_store(master_address, master_port, world_size, True, seconds(timeout), sock=held)
                joined["group"] = init_process_group(
                    backend=backend,
                    store=store,
                    world_size=world_size,
                    rank=0,
                    group_name=self.group_name,
                    timeout=seconds(timeout),
                )
            except Exception as e:  # reported by the waiting thread below
                joined["error"] = e

        thread = threading.Thread(target=join, name=f"{self.group_name}-init", daemon=True)
        thread.start()
        what = f"joining weight-update group {self.group_name} at {master_address}:{master_port}"
        wait_engines(refs, [self.session.url_of(e) for e in engines], what, timeout)
        thread.join(timeout)
        if "error" in joined or thread.is_alive():
            raise WeightUpdateError(f"{what}: the trainer side failed: {joined.get('error', 'timed out')}")
        self.group = joined["group"]

    def leave(self, old_engines, old_urls, timeout):
        """Before connecting to a new set of engines: destroy the group on the engines that stay and on this trainer."""
        if self.group is None:
            return
        current = {e._actor_id for e in self.session.rollout_engines}
        stay = [(e, u) for e, u in zip(old_engines, old_urls) if e._actor_id in current]
        refs = [e.destroy_weights_update_group.remote(self.group_name) for e, _ in stay]
        wait_engines(refs, [u for _, u in stay], f"destroy_weights_update_group {self.group_name}", timeout)
        self._destroy_own_side()

    def regroup(self, timeout):
        """A bucket failed with a dead member in the group: drop the old group and build one of the survivors."""
        self._destroy_own_side()
        survivors = list(self.session.rollout_engines)
        # the session's wait: an engine found dead meanwhile is dropped, and left out of the new group
        self.session.wait(
            [(e, e.destroy_weights_update_group.remote(self.group_name)) for e in survivors],
            f"destroy_weights_update_group {self.group_name}",
            timeout,
        )
        self._rename()
        if self.session.rollout_engines:
            self._join(timeout)

    def _destroy_own_side(self):
        try:
            dist.destroy_process_group(self.group)
        except Exception as e:  # noqa: BLE001  (a group whose peers died may fail to tear down; it is dropped anyway)
            logger.warning("destroying weight-update group %s on the trainer: %s", self.group_name, e)
        self.group = None

    def send_bucket(self, named_tensors, what, timeout, close=False) -> bool:
        """Broadcast one bucket to every engine rank. The engines' weight-update session is never closed here
        (`close` is not taken): returns False, the session ends it after the last bucket."""
        session = self.session
        refs = [
            engine.update_weights_from_distributed.remote(
                names=[n for n, _ in named_tensors],
                dtypes=[_dtype_name(t.dtype) for _, t in named_tensors],
                shapes=[list(t.shape) for _, t in named_tensors],
                group_name=self.group_name,
                weight_version=str(session.weight_version),
            )
            for engine in session.rollout_engines
        ]
        works = [
            dist.broadcast(gloo_safe(t, self.group), 0, group=self.group, async_op=True) for _, t in named_tensors
        ]

        def check_broadcast(all_works=False):
            # a peer that vanished mid-transfer fails the work; name the engine that died if it says so in time
            for w in works:
                if all_works or w.is_completed():
                    try:
                        w.wait()
                    except Exception as e:
                        wait_engines(refs, session.urls, what, timeout=5)
                        raise WeightUpdateError(f"{what}: broadcast to engines {session.urls} failed: {e}") from e

        wait_engines(refs, session.urls, what, timeout, on_poll=check_broadcast)
        check_broadcast(all_works=True)
        return False

    def after_update(self):
        """Nothing to do: the group serves the next update."""
