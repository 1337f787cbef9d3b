"""Colocated offload under torch_memory_saver follows what the saver needs (as slime does): cached blocks returned and
process groups torn down before the pause, rebuilt after the resume, and a weight push made while asleep runs outside
the saver's region (`disable()`) with the groups up. torch_memory_saver needs CUDA and its LD_PRELOAD hook, so a
recorder with its API stands in for it; the actor's own sleep / wake_up / update_weights run for real."""

import contextlib

import pytest

from tests._args import make_args


class RecordingSaver:
    """torch_memory_saver's interface (pause, resume, disable), recording the order of calls."""

    def __init__(self, events):
        self.events, self.disabled = events, False

    def pause(self):
        self.events.append("pause")

    def resume(self):
        self.events.append("resume")

    @contextlib.contextmanager
    def disable(self):
        self.events.append("disable")
        self.disabled = True
        try:
            yield
        finally:
            self.disabled = False
            self.events.append("enable")


@pytest.fixture
def asleep_actor(monkeypatch):
    from slime.backends.megatron_utils import actor as actor_mod

    events = []
    saver = RecordingSaver(events)
    monkeypatch.setattr(actor_mod, "_memory_saver", lambda: saver)
    monkeypatch.setattr(actor_mod.device, "clear_memory", lambda: events.append("clear_memory"))
    monkeypatch.setattr(
        actor_mod.mpu, "destroy_process_groups", lambda: events.append("destroy_groups"), raising=False
    )
    monkeypatch.setattr(actor_mod.mpu, "reload_process_groups", lambda: events.append("reload_groups"), raising=False)
    monkeypatch.setattr(actor_mod.dist, "barrier", lambda group=None: None)
    monkeypatch.setattr(actor_mod.megatron_init, "get_gloo_group", lambda: None)

    class Updater:
        def update_weights(self, weight_version=None):
            events.append("update (saver disabled)" if saver.disabled else "update (inside the saver region)")
            return {"ok": 1}

    actor = object.__new__(actor_mod.MegatronTrainRayActor)
    actor.args, actor._offload_backup, actor.weight_updator = make_args("--colocate"), None, Updater()
    return actor, events


def test_sleep_update_wake_order_under_torch_memory_saver(asleep_actor):
    actor, events = asleep_actor
    actor.sleep(("model",))
    assert events == ["clear_memory", "destroy_groups", "pause"]
    events.clear()
    assert actor.update_weights() == {"ok": 1}
    assert events == ["reload_groups", "disable", "update (saver disabled)", "enable", "destroy_groups"]
    events.clear()
    actor.wake_up(("model",))
    assert events == ["resume", "clear_memory", "reload_groups"]
    events.clear()
    actor.update_weights()  # awake: the saver is not involved
    assert events == ["update (inside the saver region)"]
