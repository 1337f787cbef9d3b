"""Weight sync Megatron -> inference engines: broadcast (disaggregated), tensor handles (colocated) or files (disk)."""

from .common import WeightUpdateError
from .update_weight_from_disk import UpdateWeightFromDisk
from .update_weight_from_distributed import UpdateWeightFromDistributed
from .update_weight_from_tensor import UpdateWeightFromTensor, get_param_info_buckets

__all__ = [
    "UpdateWeightFromDisk",
    "UpdateWeightFromDistributed",
    "UpdateWeightFromTensor",
    "WeightUpdateError",
    "get_param_info_buckets",
]
