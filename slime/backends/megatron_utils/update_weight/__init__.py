"""Weight sync Megatron -> inference engines: broadcast (disaggregated) or tensor handles (colocated)."""

from .common import WeightUpdateError
from .update_weight_from_distributed import UpdateWeightFromDistributed
from .update_weight_from_tensor import UpdateWeightFromTensor, get_param_info_buckets

__all__ = ["UpdateWeightFromDistributed", "UpdateWeightFromTensor", "WeightUpdateError", "get_param_info_buckets"]
