"""Dynamic-sampling filters: `fn(args, samples, **kwargs) -> bool`, called per finished group; False drops the group."""
import torch

from slime.utils.types import Sample

__all__ = ["check_reward_nonzero_std"]

# float64 and a tolerance (as slime HEAD) so a group of equal float rewards never passes on rounding noise.
_STD_EPS = 1e-6


def check_reward_nonzero_std(args, samples: list[Sample], **kwargs) -> bool:
    """Keep a group only if its rewards (`--reward-key` aware) differ; an all-equal group has zero GRPO advantage.

    A one-sample group has an undefined std and is dropped.
    """
    rewards = torch.tensor([sample.get_reward_value(args) for sample in samples], dtype=torch.float64)
    return bool(rewards.std() > _STD_EPS) if rewards.numel() > 1 else False
