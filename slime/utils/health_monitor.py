"""`RolloutHealthMonitor`: a driver-side thread that watches the inference engines and the router.

Every `--rollout-health-check-interval` seconds (after `--rollout-health-check-first-wait` on each resume) it asks
each engine for `/health_generate` (a real one-token generation, as SGLang serves it) with
`--rollout-health-check-timeout`; an engine whose server died, hangs (e.g. a stopped process) or answers an error
fails. The router process is checked every tick (about a second). A failure goes to the `RolloutManager`:
with `--use-fault-tolerance` it removes the engine (it is replaced at the next weight update) or restarts the
router; without it the run stops with a one-line error naming the part.

Checks run only while resumed: during rollouts and evaluation. Weight updates and offload pause them (an engine
cannot answer a generation while its memory is released).
"""

import logging
import threading
import time

logger = logging.getLogger(__name__)

TICK_S = 0.5


class RolloutHealthMonitor:
    def __init__(self, rollout_manager, args):
        self.manager, self.args = rollout_manager, args
        self.interval = args.rollout_health_check_interval
        self.timeout = args.rollout_health_check_timeout
        self.first_wait = args.rollout_health_check_first_wait
        self._stop, self._paused = threading.Event(), threading.Event()
        self._paused.set()
        self._next_round = None  # monotonic time of the next engine round; None while paused
        self._thread = None

    def start(self) -> bool:
        """Start the thread, paused. False if there is nothing to watch."""
        if not self.manager.rollout_engines and self.manager.router_process is None:
            return False
        self._thread = threading.Thread(target=self._loop, name="rollout-health-monitor", daemon=True)
        self._thread.start()
        return True

    def pause(self):
        self._paused.set()
        self._next_round = None

    def resume(self):
        if self._paused.is_set():
            self._next_round = time.monotonic() + self.first_wait
            self._paused.clear()

    def is_checking_enabled(self) -> bool:
        return self._thread is not None and not self._paused.is_set() and not self._stop.is_set()

    def stop(self):
        self._stop.set()
        self._paused.clear()
        if self._thread is not None:
            self._thread.join(self.timeout + self.interval + 5)

    def _loop(self):
        while not self._stop.wait(TICK_S):
            try:
                self.manager.check_router()  # watched even while engine checks are paused
                next_round = self._next_round
                if self._paused.is_set() or next_round is None or time.monotonic() < next_round:
                    continue
                self.check_engines()
                if self._next_round is not None:  # not paused meanwhile
                    self._next_round = time.monotonic() + self.interval
            except Exception as e:  # the monitor itself must keep running; a broken check is reported, not fatal
                logger.exception("health monitor: check failed: %s", e)

    def check_engines(self):
        """One round: /health_generate on every engine of each group at once (`EngineGroup.failed_engines`); each
        failure goes to the manager."""
        self.manager.check_engines(self.timeout, halted=lambda: self._paused.is_set() or self._stop.is_set())
