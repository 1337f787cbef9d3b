import importlib
import threading


def load_function(path: str):
    """Load `pkg.mod.attr` by dotted path. Errors name the path and say whether the module or the attribute is missing."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"function path {path!r} must be a dotted path 'package.module.function'")
    module_path, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        raise ImportError(f"cannot load {path!r}: module {module_path!r} not found ({e})") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ImportError(f"cannot load {path!r}: module {module_path!r} has no attribute {attr!r}") from None


class SingletonMeta(type):
    """One instance per class; `SingletonMeta.clear_instances(cls)` drops it (tests, re-init)."""

    _instances: dict = {}
    _lock = threading.Lock()

    def __call__(cls, *args, **kwargs):
        with cls._lock:
            if cls not in cls._instances:
                cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]

    @staticmethod
    def clear_instances(cls=None):
        if cls is None:
            SingletonMeta._instances.clear()
        else:
            SingletonMeta._instances.pop(cls, None)


def should_run_periodic_action(rollout_id: int, interval, num_rollout_per_epoch=None) -> bool:
    """True after rollout `rollout_id` when `(rollout_id+1) % interval == 0` or at an epoch boundary."""
    if interval is None:
        return False
    step = rollout_id + 1
    return step % interval == 0 or (num_rollout_per_epoch is not None and step % num_rollout_per_epoch == 0)
