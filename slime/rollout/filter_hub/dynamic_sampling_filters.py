"""Dynamic-sampling filters: `fn(args, samples, **kwargs) -> DynamicFilterOutput`, called per finished group."""

import torch

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]

# float64 and a tolerance (as slime HEAD) so a group of equal float rewards never passes on rounding noise.
_STD_EPS = 1e-6


def check_reward_nonzero_std(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """Keep a group only if its rewards (`--reward-key` aware) differ; an all-equal group has zero GRPO advantage.

    A one-sample group has an undefined std and is dropped. A dropped group's reason is `zero_std_<reward>`
    (its common reward, rounded to 0.1, written as current slime writes it: `zero_std_1` for an int reward 1,
    `zero_std_1.0` for a float one).
    """
    rewards = [sample.get_reward_value(args) for sample in samples]
    values = torch.tensor(rewards, dtype=torch.float64)
    keep = bool(values.std() > _STD_EPS) if values.numel() > 1 else False
    first = rewards[0] if isinstance(rewards[0], (int, float)) else float(rewards[0])  # a tensor or numpy scalar
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(first, 1)}")


def check_reward_nonzero_std_with_fallback(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    """`check_reward_nonzero_std`, but a zero-std group is kept when dropping it would need another sampling round."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output
