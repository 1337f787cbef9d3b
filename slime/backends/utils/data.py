"""Old location of the trainer's rollout-data helpers; they serve only the Megatron backend and now live in
`slime.backends.megatron_utils.rollout_data`."""

from slime.backends.megatron_utils.rollout_data import (  # noqa: F401
    OPTIONAL_TRAIN_DATA_KEYS,
    PARTITIONED_KEYS,
    TRAIN_DATA_KEYS,
    DataIterator,
    _add_rollout_weights,
    _balanced_dp_partitions,
    _fetch_rollout_data,
    _first_fit,
    get_micro_batch_partitions,
    get_minimum_num_micro_batch_size,
    group_by_rollout,
    process_rollout_data,
)
