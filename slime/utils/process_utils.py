"""Tie a child process's life to its parent's, so no server or router outlives a run killed with SIGKILL."""

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; a no-op elsewhere).

    Call it in the child (a `preexec_fn`, or first thing in a `multiprocessing` target). The kernel ties the signal to
    the parent *thread* that created the child, so start such children from a thread that lives as long as the run.
    With `parent_pid`, exit at once if that parent already died before the call (the race prctl leaves open)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except OSError:
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
