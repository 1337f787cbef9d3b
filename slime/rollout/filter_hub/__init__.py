"""Ready-made sample filters: `--dynamic-sampling-filter-path slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std`
and `--over-sampling-filter-path slime.rollout.filter_hub.over_sampling_filters.sort_by_reward_std`."""
