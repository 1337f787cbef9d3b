"""How the drivers end on a user's mistake: one line for bad input, the user's own traceback for their code.

`StartupError`: a mistake found after parsing (the cluster is too small): `prog: error: ...`, status 2.
`UserCodeError`: an exception inside the user's function (e.g. a rollout function, which runs inside the rollout
controller actor and would otherwise reach the driver as the last line of a long Ray traceback).
`call_user_function` wraps the call, the error crosses Ray as text, the driver's `Watchdog.get` re-raises it
unwrapped, and `exit_on_user_error` prints the user's traceback and one line of slime context (status 1).
`user_function(flag, path)` loads a `--*-path` function already wrapped that way (the trainer-side hooks, the loss,
the rollout controller's converters and loggers).
"""

import contextlib
import functools
import os
import sys
import traceback

from slime.utils.misc import load_function


def one_line(text) -> str:
    return " ".join(str(text).split())


class StartupError(Exception):
    """A user mistake found after argument parsing (e.g. the cluster is too small): one line, no traceback."""


class UserCodeError(Exception):
    """`user_traceback`: the user's exception as Python prints it, from the user's frame on; `context`: one line."""

    def __init__(self, user_traceback: str, context: str):
        super().__init__(user_traceback, context)
        self.user_traceback, self.context = user_traceback, context

    def __str__(self):
        return f"{self.user_traceback.rstrip()}\n{self.context}"


# Raised through user code but not by it: torch's non-reentrant activation checkpointing stops recomputing a
# checkpointed function (the user's loss under --recompute-loss-function) once it has what the backward pass needs.
_NOT_THE_USERS = ("_StopRecomputationError",)


def call_user_function(context: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`; an exception from it becomes a `UserCodeError` whose traceback starts at `fn`."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (whatever the user's code raises is reported as theirs)
        if type(e).__name__ in _NOT_THE_USERS:
            raise
        user_tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        raise UserCodeError(user_tb, context) from None


def user_function(flag: str, path: str, where: str = ""):
    """The function at dotted `path` (given by `flag`), called through `call_user_function` with the context
    "raised by FLAG PATH" + `where`. It keeps the user function's signature (for callers that inspect it)."""
    fn = load_function(path)
    return functools.update_wrapper(functools.partial(call_user_function, f"raised by {flag} {path}{where}", fn), fn)


@contextlib.contextmanager
def exit_on_user_error():
    """The drivers' main: end on a `StartupError` (status 2) or a `UserCodeError` (status 1) without slime's
    traceback."""
    prog = os.path.basename(sys.argv[0])
    try:
        yield
    except StartupError as e:
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except UserCodeError as e:
        print(e.user_traceback.rstrip(), file=sys.stderr)
        print(f"{prog}: error: {e.context}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
