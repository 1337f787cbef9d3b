"""Rollout sample hooks (`--rollout-sample-hook-path`, repeatable): run on every generated sample, train and eval,
right after generation and before the reward.

A hook is `hook(args, sample, **kw)`, sync or async, where `kw` holds the keywords it declares among `rollout_id`,
`evaluation` and any other keyword the caller passes (all of them if it takes `**kwargs`). It returns None (keep the possibly mutated sample) or a
`Sample` that replaces it. On every `Sample` of a possibly nested list, one sample after another, the hooks run in
flag order.
"""

import inspect

from slime.utils.misc import accepted_kwargs, load_function
from slime.utils.types import Sample

_current_rollout_id = None


def set_current_rollout_id(rollout_id):
    """The rollout id hooks receive (set by the rollout controller before each rollout and eval)."""
    global _current_rollout_id
    _current_rollout_id = rollout_id


async def _apply_one(hook, path, args, sample, kwargs):
    if not isinstance(sample, Sample):
        raise TypeError(f"--rollout-sample-hook-path {path}: got {type(sample).__name__}, expected Sample or list")
    result = hook(args, sample, **accepted_kwargs(hook, **kwargs))
    if inspect.isawaitable(result):
        result = await result
    if result is None:
        return sample
    if not isinstance(result, Sample):
        raise TypeError(f"--rollout-sample-hook-path {path} returned {type(result).__name__}; expected Sample or None")
    return result


async def _apply(hooks, args, item, kwargs):
    """Every hook, in flag order, on one sample before the next (as current slime)."""
    if isinstance(item, list):
        return [await _apply(hooks, args, x, kwargs) for x in item]  # a new list: the shape is kept
    for path, hook in hooks:
        item = await _apply_one(hook, path, args, item, kwargs)
    return item


async def apply_rollout_sample_hooks(args, sample_or_samples, *, evaluation=False, rollout_id=None, **extra):
    """The hooks of `--rollout-sample-hook-path` applied to a `Sample` or a (nested) list of them."""
    # read leniently: user rollouts (and current slime's plugin contract tests) call generate_and_rm with their own
    # minimal args objects
    paths = getattr(args, "rollout_sample_hook_path", None) or []
    if not paths:
        return sample_or_samples
    if not isinstance(sample_or_samples, (Sample, list)):
        raise TypeError(
            f"rollout sample hooks take a Sample or a list of them, got {type(sample_or_samples).__name__}"
        )
    kwargs = {
        "rollout_id": _current_rollout_id if rollout_id is None else rollout_id,
        "evaluation": evaluation,
        **extra,
    }
    return await _apply([(path, load_function(path)) for path in paths], args, sample_or_samples, kwargs)
