"""Upstream slime's import path of the W&B helpers (`slime.utils.wandb_utils.init_wandb_primary`, ...); the code lives
in `slime.observability.wandb_utils`. Patch that module, not this one: these names are copies of its attributes."""

from slime.observability.wandb_utils import (  # noqa: F401
    METRIC_AXES,
    STEP_KEYS,
    _config,
    _define_metric_axes,
    _login_and_dir,
    _resolve_mode,
    _settings,
    finish_secondary,
    get_step,
    init_wandb_primary,
    init_wandb_secondary,
    log,
)
