"""Over-sampling filters: `fn(args, groups, **kwargs) -> groups` in priority order; the rollout keeps the first
`rollout_batch_size` of them."""

import torch

from slime.utils.types import Sample

__all__ = ["sort_by_reward_std"]


def _reward_std(args, group: list[Sample]) -> float:
    rewards = torch.tensor([sample.get_reward_value(args) for sample in group], dtype=torch.float64)
    return rewards.std().item() if rewards.numel() > 1 else 0.0  # one sample: no spread, lowest priority


def sort_by_reward_std(args, samples: list[list[Sample]], **kwargs) -> list[list[Sample]]:
    """Groups by reward std, highest first; the sort is stable, so equal-std groups keep their order."""
    return sorted(samples, key=lambda group: _reward_std(args, group), reverse=True)
