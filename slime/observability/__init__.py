"""Logging, metrics, timing and profiling: W&B (`wandb_utils`), TensorBoard (`tensorboard_utils`), the wall-clock
timers (`timer`) and the trainers' profiler (`profile_utils`).

This package is their one home; it may use `slime.utils` (helpers, device) but nothing above it. Upstream slime's
paths `slime.utils.timer` and `slime.utils.wandb_utils` stay importable as re-exports of the modules here."""
