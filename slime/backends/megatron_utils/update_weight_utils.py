"""slime's import path for the weight updaters (the implementation lives in the `update_weight` package)."""

from slime.backends.megatron_utils.update_weight import (  # noqa: F401
    UpdateLoRAAdapter,
    UpdateWeightFromDisk,
    UpdateWeightFromDistributed,
    UpdateWeightFromTensor,
    WeightUpdateError,
    get_param_info_buckets,
)
