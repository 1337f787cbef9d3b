"""What a dynamic-sampling filter (`--dynamic-sampling-filter-path`) returns, and when a rejected group is dropped.

A filter is `fn(args, samples, **kwargs)` called once per finished group. It returns a `DynamicFilterOutput`, or
(slime v0.1.0) a bare truthy/falsy value taken as `keep`.
"""

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class DynamicFilterOutput:
    keep: Any  # truthy keeps the group (the shipped filters store a 0-dim bool tensor)
    reason: Optional[str] = None  # counted as rollout/dynamic_filter/drop_<reason> when the group is dropped
    keep_when_insufficient: bool = False  # keep a rejected group rather than sample more prompts to replace it

    def __bool__(self):
        # slime v0.1.0 filters returned a bool; code that composes the shipped filters can still test the result
        return bool(self.keep)


def call_dynamic_filter(fn, *args, **kwargs) -> DynamicFilterOutput:
    """`fn(*args, **kwargs)` as a `DynamicFilterOutput`; no filter keeps everything."""
    if fn is None:
        return DynamicFilterOutput(keep=True)
    output = fn(*args, **kwargs)
    return output if isinstance(output, DynamicFilterOutput) else DynamicFilterOutput(keep=output)


def should_drop_dynamic_filter_output(
    output: DynamicFilterOutput, *, remaining_batch_size: int, target_data_size: int
) -> bool:
    """Drop a rejected group, unless it asked to be kept when dropping it would leave no more groups in flight or
    accepted (`remaining_batch_size`, counted before this group) than the target: then keeping it saves a round."""
    if output.keep:
        return False
    return not (output.keep_when_insufficient and remaining_batch_size <= target_data_size)


class MetricGatherer:
    """Counts dynamic-filter drops by reason for the rollout's metrics."""

    def __init__(self):
        self._drops = Counter()

    def on_dynamic_filter_drop(self, reason: Optional[str]):
        if reason:
            self._drops[reason] += 1

    def collect(self) -> dict:
        return {f"rollout/dynamic_filter/drop_{reason}": count for reason, count in self._drops.items()}
