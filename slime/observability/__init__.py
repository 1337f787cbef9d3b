"""Current slime's import paths for its logging and metric helpers (`slime.observability.*`).

The modules here are the same objects as slime's own (`slime.utils.timer`, `slime.utils.wandb_utils`, ...), so
user log and metric code written against current slime imports unchanged; TensorBoard lives here."""
