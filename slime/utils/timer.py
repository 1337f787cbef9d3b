"""Upstream slime's import path of the timer (`from slime.utils.timer import Timer, timer`); the code lives in
`slime.observability.timer`."""

from slime.observability.timer import Timer, timer  # noqa: F401
