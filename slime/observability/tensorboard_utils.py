"""TensorBoard: every metric logged to W&B is also written as a TensorBoard scalar, on the same step axis.

`--use-tensorboard` with `--tb-project-name` [`--tb-experiment-name`] writes to
`tensorboard_log/<project>/<experiment>`, or to `$TENSORBOARD_DIR` when set (current slime's rule). parse_args
resolves that directory once into `args.tb_dir` (`slime.config.observability.resolve_tb_dir`) (absolute, the experiment name defaulting to the start time), so
the trainer and the rollout controller, which log from different processes, write into one run.
"""

import logging
import os

from torch.utils.tensorboard import SummaryWriter

from slime.utils.misc import SingletonMeta

logger = logging.getLogger(__name__)


class _TensorboardAdapter(metaclass=SingletonMeta):
    """One writer per process (current slime's name and usage: `_TensorboardAdapter(args).log(data, step)`)."""

    def __init__(self, args):
        if not args.use_tensorboard:
            raise ValueError("_TensorboardAdapter needs --use-tensorboard")
        os.makedirs(args.tb_dir, exist_ok=True)
        logger.info("Saving tensorboard log to %s", args.tb_dir)
        self._writer = SummaryWriter(args.tb_dir)

    def log(self, data, step):
        for key, value in data.items():
            if hasattr(value, "item"):  # a 0-d tensor / numpy scalar
                value = value.item()
            if isinstance(value, (int, float)):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()  # one call per rollout: cheap, and a crashed run keeps its curves

    def finish(self):
        self._writer.close()


def log(args, record, step_key):
    """Write `record` (a W&B record holding its step under `step_key`) as scalars at that step."""
    step = record[step_key]
    _TensorboardAdapter(args).log({k: v for k, v in record.items() if not k.endswith("/step")}, step)
