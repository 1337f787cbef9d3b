"""The one console format for metrics (trainer, rollout controller, driver): `title | name value | name value`."""


def metrics_line(title: str, metrics: dict, short_names: bool = True) -> str:
    """Numeric entries of `metrics` to 4 significant digits, in order; others (lists, strings) are left to the
    JSONL record and W&B. With `short_names`, a key's family prefix (`train/`, `rollout/`) is dropped."""
    parts = [title]
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{key.split('/', 1)[-1] if short_names else key} {value:.4g}")
    return " | ".join(parts)
