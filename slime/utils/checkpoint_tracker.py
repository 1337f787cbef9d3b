"""The on-disk layout of a Megatron checkpoint directory that both the trainer and start-up checks read.

Kept free of torch/megatron imports so argument validation can read a tracker before anything heavy loads.
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
