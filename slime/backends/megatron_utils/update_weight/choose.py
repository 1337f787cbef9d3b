"""Which weight sync a run uses, decided here only: the updater class when the trainer starts (from the flags), and
for the disaggregated updater its transport each time it connects to engines (from where the engines are)."""

from urllib.parse import urlparse

from slime.utils.device import shared_memory_handles
from slime.utils.http_utils import get_host_info

from .broadcast import BroadcastTransport
from .common import WeightUpdateError
from .shared_memory import SharedMemoryTransport
from .update_lora_adapter import UpdateLoRAAdapter
from .update_weight_from_disk import UpdateWeightFromDisk
from .update_weight_from_distributed import UpdateWeightFromDistributed
from .update_weight_from_tensor import UpdateWeightFromTensor


def updater_class(args):
    """The weight updater of this run: LoRA adapters alone (`--lora-sync adapter`), files (`--update-weight-transport
    disk`), tensor handles to colocated engines, else `UpdateWeightFromDistributed` (transport: `transport_class`)."""
    if args.enable_lora and args.lora_sync == "adapter":
        return UpdateLoRAAdapter
    if args.update_weight_transport == "disk":
        return UpdateWeightFromDisk
    return UpdateWeightFromTensor if args.colocate else UpdateWeightFromDistributed


def transport_class(args, urls):
    """`UpdateWeightFromDistributed`'s transport to the engines at `urls` (`--update-weight-transport
    auto|shm|broadcast`): shared memory when every engine is on this host and the device allows it (CPU), else
    the collective broadcast."""
    wanted = args.update_weight_transport or "auto"
    host = get_host_info()[1]
    # loopback names mean this host only where this host is the loopback address: with several Ray nodes on one
    # machine (127.0.0.2, 127.0.0.3, ...) an engine on another node's address is remote and gets the broadcast
    local = {host} | ({"127.0.0.1", "localhost", "::1"} if host in ("127.0.0.1", "localhost", "::1") else set())
    shm_possible = shared_memory_handles() and all(urlparse(u).hostname in local for u in urls)
    if wanted == "auto" and args.rollout_external:
        return BroadcastTransport  # a server slime did not start may not open this run's shared-memory handles
    if wanted == "shm" and not shm_possible:
        raise WeightUpdateError(
            f"--update-weight-transport shm needs a CPU run with every engine on this host ({host}); engines: {urls}"
        )
    return SharedMemoryTransport if wanted == "shm" or (wanted == "auto" and shm_possible) else BroadcastTransport
