"""Coverage in processes that end without running atexit (installed by scripts/coverage.sh, never imported by slime).

coverage.py writes a process's data at exit, on SIGTERM and (with `patch = _exit`) before `os._exit`. Ray ends its
workers without any of these, so a trainer's or a rollout controller's lines would never be counted. This module,
loaded at every interpreter start by a `.pth` file, saves the data every two seconds in Ray workers: those Ray execs
(`default_worker.py`) and those the tests' Ray zygote forks. Saves are serialised with coverage's own, and a fork
waits for a save in progress: a child forked mid-save would inherit coverage's data lock held by a thread it does not
have, and hang at its own exit save (seen in Megatron's async checkpoint writer). The child gets a fresh lock."""

import os
import sys

if os.getenv("COVERAGE_PROCESS_START"):
    import threading
    import time

    import coverage

    _lock = threading.RLock()

    def _fresh_lock():
        global _lock
        _lock = threading.RLock()

    os.register_at_fork(
        before=lambda: _lock.acquire(), after_in_parent=lambda: _lock.release(), after_in_child=_fresh_lock
    )

    def _serialised(cov):
        if cov is not None and not getattr(cov, "_slime_serialised", False):
            save = cov.save

            def locked_save():
                with _lock:
                    save()

            cov.save, cov._slime_serialised = locked_save, True
        return cov

    def _save_every_two_seconds(pid):
        while os.getpid() == pid:
            time.sleep(2)
            try:
                cov = _serialised(coverage.Coverage.current())
                if cov is not None:
                    cov.save()
            except Exception:  # a save that fails is retried two seconds later
                pass

    def _start():
        _serialised(coverage.Coverage.current())
        threading.Thread(
            target=_save_every_two_seconds, args=(os.getpid(),), daemon=True, name="coverage-saver"
        ).start()

    if any(arg.endswith("default_worker.py") for arg in sys.orig_argv):
        _start()
    if "tests._ray_zygote" in sys.orig_argv:
        os.register_at_fork(after_in_child=_start)
