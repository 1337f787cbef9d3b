"""Old location of the trainer's rollout-data helpers; they serve only the Megatron backend and now live in
`slime.backends.megatron_utils.rollout_data`."""

from slime.backends.megatron_utils.rollout_data import (  # noqa: F401
    PARTITIONED_KEYS,
    DataIterator,
    get_micro_batch_partitions,
    get_minimum_num_micro_batch_size,
    process_rollout_data,
)
