"""Current slime's path of slime's W&B helpers (`init_wandb_primary`, `init_wandb_secondary`, `log`, ...)."""

from slime.utils.wandb_utils import (  # noqa: F401
    METRIC_AXES,
    STEP_KEYS,
    get_step,
    init_wandb_primary,
    init_wandb_secondary,
    log,
)
