import time
from contextlib import contextmanager
from functools import wraps

from slime.utils.misc import SingletonMeta


class Timer(metaclass=SingletonMeta):
    """Process-wide named wall-clock timers; `log_dict()` gives accumulated seconds per name."""

    def __init__(self):
        self.timers = {}
        self.start_time = {}

    def start(self, name):
        assert name not in self.start_time, f"timer {name!r} already started"
        self.start_time[name] = time.perf_counter()

    def end(self, name):
        assert name in self.start_time, f"timer {name!r} not started"
        self.add(name, time.perf_counter() - self.start_time.pop(name))

    def add(self, name, seconds):
        self.timers[name] = self.timers.get(name, 0.0) + seconds

    def reset(self, name=None):
        if name is None:
            self.timers.clear()
        else:
            self.timers.pop(name, None)

    def log_dict(self):
        return dict(self.timers)

    @contextmanager
    def context(self, name):
        self.start(name)
        try:
            yield
        finally:
            self.end(name)


def timer(name_or_func):
    """`@timer` (named after the function) or `with timer("name"):`."""
    if callable(name_or_func):
        func = name_or_func

        @wraps(func)
        def wrapper(*args, **kwargs):
            with Timer().context(func.__name__):
                return func(*args, **kwargs)

        return wrapper
    return Timer().context(name_or_func)
