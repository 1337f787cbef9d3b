"""Driver side of a checkpoint: every part first, the tracker last.

A run's checkpoint `rollout_id` has several parts written by different processes: the trainers' Megatron state
(`iter_XXXXXXX/`), the rollout data source's position and buffer (`rollout/global_dataset_state_dict_X.pt`), and
whatever other driver-side state a training loop keeps (e.g. a queue of generated groups). Only when all of them are
on disk does the driver replace `latest_checkpointed_iteration.txt`, so a run killed at any moment of a save resumes
from the previous complete checkpoint: the trainers load what the tracker names, and the data source must then find
its state for that iteration (a resume without it is an error, see `RolloutDataSource.load`).

With --async-save the trainers' part is still being written when `save` returns; `AsyncCommits` names the checkpoint
in the tracker once every trainer group has finished its write (found after each rollout, and waited for before the
next save, before --release-train's trainers go, and at the end of the run). A run killed meanwhile resumes from the
checkpoint before it.
"""

from slime.utils.checkpoint_tracker import write_tracker


def save(args, rollout_id, actor_model, rollout_manager, get, extra_savers=(), commit=True):
    """Save checkpoint `rollout_id` and, with `commit`, mark it complete.

    `get` is the driver's `ray.get` (the Watchdog's); `extra_savers` are callables `fn(rollout_id)` for more
    driver-side state, each of which must have written its part durably when it returns."""
    get(actor_model.async_save_model(rollout_id, commit=False))
    if args.rollout_global_dataset:
        get(rollout_manager.async_save(rollout_id))
    for saver in extra_savers:
        saver(rollout_id)
    if commit and not args.debug_rollout_only:  # no trainer state was written: nothing to resume from
        write_tracker(args.save, rollout_id)


class AsyncCommits:
    """--async-save: the checkpoint whose trainer writes are in flight, and the trainer groups still writing it."""

    def __init__(self, args, get):
        self.args, self.get = args, get
        self.rollout_id, self.writing = None, []

    def started(self, rollout_id, groups):
        self.rollout_id, self.writing = rollout_id, list(groups)

    def poll(self, blocking=False):
        """Finish the groups' writes that are done (`blocking`: wait for them); once none is left, name the
        checkpoint in the tracker."""
        if self.rollout_id is None:
            return
        self.writing = [g for g in self.writing if None in self.get(g.async_finalize_save(blocking))]
        if not self.writing:
            write_tracker(self.args.save, self.rollout_id)
            self.rollout_id = None
