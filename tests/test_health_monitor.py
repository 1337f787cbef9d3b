"""RolloutHealthMonitor's schedule: the router every tick, the engines only while resumed, first after
--rollout-health-check-first-wait and then every --rollout-health-check-interval."""

import threading
import time

from slime.utils import health_monitor
from tests._args import make_args


class Manager:
    """Records the monitor's calls, as the RolloutManager receives them."""

    rollout_engines, router_process = ["engine"], None

    def __init__(self):
        self.router_checks, self.engine_rounds = 0, threading.Semaphore(0)

    def check_router(self):
        self.router_checks += 1

    def check_engines(self, timeout, halted):
        self.engine_rounds.release()


def test_engines_are_checked_after_the_first_wait_on_each_resume_and_never_while_paused(monkeypatch):
    monkeypatch.setattr(health_monitor, "TICK_S", 0.01)
    args = make_args(
        "--rollout-health-check-first-wait", "1.5", "--rollout-health-check-interval", "0.05",
        "--rollout-health-check-timeout", "1",
    )  # fmt: skip
    manager = Manager()
    monitor = health_monitor.RolloutHealthMonitor(manager, args)
    assert monitor.start()
    try:
        time.sleep(0.3)
        assert manager.router_checks > 0, "the router is watched while paused"
        assert not manager.engine_rounds.acquire(timeout=0), "no engine round while paused"
        monitor.resume()
        assert not manager.engine_rounds.acquire(timeout=0.5), "an engine round before the first wait"
        assert manager.engine_rounds.acquire(timeout=10), "no engine round 10 s after the first wait"
        assert manager.engine_rounds.acquire(timeout=5), "no second round at the interval"
        monitor.pause()
        while manager.engine_rounds.acquire(timeout=0.1):  # a round already under way when paused
            pass
        assert not manager.engine_rounds.acquire(timeout=0.3), "an engine round while paused"
        monitor.resume()  # the first wait again, from this resume
        assert not manager.engine_rounds.acquire(timeout=0.5), "an engine round before the first wait after a resume"
        assert manager.engine_rounds.acquire(timeout=10)
    finally:
        monitor.stop()
