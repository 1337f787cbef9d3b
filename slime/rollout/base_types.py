"""What a rollout function (`--rollout-function-path`, `--eval-function-path`) returns, and how it is called.

A rollout function is `fn(args, rollout_id, data_source, evaluation=False)`. For training it returns
`RolloutFnTrainOutput(samples, metrics)` (or, as slime v0.1.0 functions do, the bare `list[list[Sample]]`); for
eval `RolloutFnEvalOutput(data={name: {"rewards", "truncated", "samples"}}, metrics)` (or the bare dict).
`metrics` are logged with the rollout's own metrics.
"""

import functools
from dataclasses import dataclass
from typing import Any, Optional

_MISSING = object()


@dataclass
class RolloutFnTrainOutput:
    samples: list  # list[list[Sample]]; deeper nesting (fan-out) is flattened by the rollout manager
    metrics: Optional[dict[str, Any]] = None


@dataclass
class RolloutFnEvalOutput:
    data: dict  # {dataset_name: {"rewards": [...], "truncated": [...], "samples": [...]}}
    metrics: Optional[dict[str, Any]] = None


def call_rollout_fn(fn, *args, evaluation, **kwargs):
    """`fn(*args, evaluation=evaluation, **kwargs)`, with a bare return value wrapped in the output type."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        return output
    if evaluation:
        return RolloutFnEvalOutput(data=output)
    # slime.rollout.RolloutSamples is a list that carries its own metrics
    return RolloutFnTrainOutput(samples=output, metrics=getattr(output, "metrics", None))


def accepts_data_buffer(fn):
    """Let a rollout function also be called with slime v0.1.0's keyword `data_buffer=` for `data_source`.

    The wrapper keeps `fn`'s signature for `inspect.signature`, so the declared parameters stay
    `(args, rollout_id, data_source, evaluation=False)`."""

    @functools.wraps(fn)
    def wrapper(*args, data_buffer=_MISSING, **kwargs):
        if data_buffer is not _MISSING:
            if "data_source" in kwargs or len(args) >= 3:
                raise TypeError(f"{fn.__qualname__}() got both data_source and data_buffer (its old name); pass one")
            kwargs["data_source"] = data_buffer
        return fn(*args, **kwargs)

    return wrapper
