"""Current slime's path of slime's timer."""

from slime.utils.timer import Timer, timer  # noqa: F401
