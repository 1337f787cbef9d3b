"""The tracker file `{save}/latest_checkpointed_iteration.txt`: the one place that says which checkpoint is complete.

Kept free of torch/megatron imports so the driver and start-up checks can read and write it.

A checkpoint is complete once every part of it is on disk: the trainers' `iter_XXXXXXX/` directory, the rollout
data source's position (`rollout/global_dataset_state_dict_X.pt`) and any other driver-side state. The tracker is
replaced atomically *after* all of them (see `slime.ray.checkpoint.save`), so a run killed at any moment of a save
resumes from the previous complete checkpoint and never picks up a half-written one. Every part is fsynced before it
is published (`replace_durably`), so the same holds after a power loss, not only after a killed process.
"""

import os

TRACKER = "latest_checkpointed_iteration.txt"


def checkpoint_dir(root, iteration):
    return os.path.join(root, "release" if iteration == "release" else f"iter_{int(iteration):07d}")


def read_tracker(root):
    """The iteration recorded in `{root}/latest_checkpointed_iteration.txt` (int or "release"), None if absent."""
    path = os.path.join(root, TRACKER)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{path}: expected an iteration number or 'release', found {text!r}") from None


def fsync_path(path):
    """Flush a file's data, or a directory's entries (a rename or a new file in it), to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root):
    """fsync every file and directory under `root` (a checkpoint part written by a library that does not)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def replace_durably(tmp, path):
    """Publish the finished file or directory `tmp` as `path`: its contents reach the disk before the rename, and the
    rename itself before this returns, so after a power loss `path` is either absent or complete."""
    fsync_tree(tmp) if os.path.isdir(tmp) else fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_tracker(root, iteration):
    """Durably record `iteration` as the latest complete checkpoint under `root` (write, fsync, rename, fsync dir)."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f"{TRACKER}.tmp.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
    replace_durably(tmp, os.path.join(root, TRACKER))
