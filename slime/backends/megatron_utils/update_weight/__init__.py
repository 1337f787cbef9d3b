"""Weight sync Megatron -> inference engines: broadcast or shared memory (disaggregated), tensor handles (colocated),
files (disk), or LoRA adapters alone (`--lora-sync adapter`); `choose.py` decides which."""

from .common import WeightUpdateError
from .update_lora_adapter import UpdateLoRAAdapter
from .update_weight_from_disk import UpdateWeightFromDisk
from .update_weight_from_distributed import UpdateWeightFromDistributed
from .update_weight_from_tensor import UpdateWeightFromTensor, get_param_info_buckets

__all__ = [
    "UpdateLoRAAdapter",
    "UpdateWeightFromDisk",
    "UpdateWeightFromDistributed",
    "UpdateWeightFromTensor",
    "WeightUpdateError",
    "get_param_info_buckets",
]
