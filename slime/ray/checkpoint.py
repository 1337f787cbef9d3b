"""Driver side of a checkpoint: every part first, the tracker last.

A run's checkpoint `rollout_id` has several parts written by different processes: the trainers' Megatron state
(`iter_XXXXXXX/`), the rollout data source's position and buffer (`rollout/global_dataset_state_dict_X.pt`), and
whatever other driver-side state a training loop keeps (e.g. a queue of generated groups). Only when all of them are
on disk does the driver replace `latest_checkpointed_iteration.txt`, so a run killed at any moment of a save resumes
from the previous complete checkpoint: the trainers load what the tracker names, and the data source must then find
its state for that iteration (a resume without it is an error, see `RolloutDataSource.load`).
"""

from slime.utils.checkpoint_tracker import write_tracker


def save(args, rollout_id, actor_model, rollout_manager, get, extra_savers=()):
    """Save checkpoint `rollout_id` and mark it complete.

    `get` is the driver's `ray.get` (the Watchdog's); `extra_savers` are callables `fn(rollout_id)` for more
    driver-side state, each of which must have written its part durably when it returns."""
    get(actor_model.async_save_model(rollout_id, commit=False))
    if args.rollout_global_dataset:
        get(rollout_manager.async_save(rollout_id))
    for saver in extra_savers:
        saver(rollout_id)
    if not args.debug_rollout_only:  # no trainer state was written: nothing to resume from
        write_tracker(args.save, rollout_id)
