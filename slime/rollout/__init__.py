"""Rollout functions (loaded by dotted path: `--rollout-function-path`, `--eval-function-path`) and their helpers.

A rollout function is `generate_rollout(args, rollout_id, data_source, evaluation=False)`. For training it returns
`list[list[Sample]]` (rollout_batch_size groups of n_samples_per_prompt); for eval `{name: {"rewards", "truncated"}}`.
"""


class RolloutSamples(list):
    """A `list[list[Sample]]` that also carries the rollout's own metrics (e.g. dynamic-filter drop counts).

    It is still a plain list for every caller; `RolloutController` reads `.metrics` when present and logs them.
    """

    def __init__(self, groups=(), metrics=None):
        super().__init__(groups)
        self.metrics = dict(metrics or {})

    @property
    def samples(self):
        """The groups themselves, as `RolloutFnTrainOutput.samples` of current slime."""
        return self


class EvalResults(dict):
    """`{name: {"rewards", "truncated", "samples"}}`, the default eval's result, that is also current slime's
    `RolloutFnEvalOutput` (`.data`, `.metrics`): callers written against either slime read it their way."""

    def __init__(self, results=(), metrics=None):
        super().__init__(results)
        self.metrics = dict(metrics or {})

    @property
    def data(self):
        return self
