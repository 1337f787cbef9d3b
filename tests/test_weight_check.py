"""`RolloutManager.check_weight_fingerprints` on Ray, the check the driver runs after every push: SGLang engines held
to the change-set rule (also one engine alone), and an engine that dies between the push and the check (a failed
engine: the run stops naming it, or with --use-fault-tolerance it is removed and the others are still checked)."""

import logging
import os
import signal
import threading
import time

import pytest
import ray

from slime.rollout.weight_fingerprints import WeightFingerprintError
from tests.test_sglang_change_set import CHANGED, checksums, trainer
from tests.test_weight_sync import _args, start_engines, stop


class FakeSGLangEngine:
    """What the manager asks of an SGLang engine after a push (a GPU SGLang is not on this machine): no HF-named
    fingerprint, the `/weights_checker checksum` response the test sets."""

    def __init__(self):
        self.body, self.server_dead, self.checksum_error = None, False, None

    def set_checksums(self, body):
        self.body = body

    def fail_checksums(self, message):
        self.checksum_error = message  # SGLang's /weights_checker checksum fails (None: it answers again)

    def hang(self, seconds):
        time.sleep(seconds)  # a call the driver waits on

    def kill_server(self):
        self.server_dead = True

    def get_weights_fingerprint(self, timeout=300, algorithm="tiles32"):
        return None  # SGLangEngine's answer for kind "sglang"

    def check_weights(self, action):
        assert action == "checksum"
        if self.server_dead:  # as SGLangEngine's request fails on a closed port
            raise RuntimeError("POST /weights_checker failed: Connection refused")
        if self.checksum_error:
            raise RuntimeError(self.checksum_error)
        return self.body

    def check_alive(self):
        if self.server_dead:  # SGLangEngine.check_alive's message
            raise RuntimeError(
                "inference server of engine 1 at http://127.0.2.2:30000 exited with code -9. Last log "
                "lines (/tmp/x.log):\n..."
            )
        return "alive"


def manager_of(args, engines, urls):
    """The manager's check and fault path on these engines (no router, no controller)."""
    from slime.ray.engine_group import EngineGroup
    from slime.ray.rollout import RolloutManager

    manager = RolloutManager.__new__(RolloutManager)
    manager.args, manager.policy = args, EngineGroup(None, args, (None, list(range(8))))
    manager.policy._add_block(args, 0, list(engines), 1)
    manager.policy.urls = list(urls)
    manager.trainer_tensor_hashes, manager._sglang_checksums, manager._warned = {}, {}, set()
    manager._lock, manager._closing, manager.failure, manager.fault_events = threading.RLock(), False, None, []
    return manager


def push(version, hashes):
    return [
        {
            "update_weights/weight_version": version,
            "update_weights/tensor_hashes": dict(hashes),
            "update_weights/tensor_hash_algorithm": "tiles32",
        }
    ]


@pytest.fixture
def fake_sglang(ray_session):
    started = []

    def start(n):
        started.extend(ray.remote(num_cpus=0)(FakeSGLangEngine).remote() for _ in range(n))
        return started[-n:]

    yield start
    for a in started:
        ray.kill(a)


def test_one_sglang_engine_is_held_to_the_change_set_rule(fake_sglang, caplog):
    """One SGLang engine (no peer to agree with): the first push is the baseline, a correct push passes, a push the
    engine did not receive stops the run naming the engine, the version, a tensor and the opt-out."""
    caplog.set_level(logging.INFO, logger="slime.ray.weight_checks")
    args = _args_sglang()
    (engine,) = fake_sglang(1)
    manager = manager_of(args, [engine], ["http://127.0.2.1:30000"])
    v0, v1, v2 = trainer(0), trainer(1, CHANGED), trainer(2, CHANGED)
    for version, hashes in ((1, v0), (2, v1)):
        ray.get(engine.set_checksums.remote(checksums(hashes)))
        manager.check_weight_fingerprints(push(version, hashes))
    assert sum("change-set rule starts at the next push" in r.getMessage() for r in caplog.records) == 1
    # version 3: the trainer changed again, the engine still serves version 2's weights
    with pytest.raises(WeightFingerprintError) as err:
        manager.check_weight_fingerprints(push(3, v2))
    assert str(err.value) == (
        "inference engine 0 (http://127.0.2.1:30000): the trainer changed 3 tensor(s) for weight version 3 (e.g. "
        "'model.layers.0.self_attn.q_proj.weight') but none of the engine's parameter checksums changed: the update "
        "did not reach it; stopping before any sample of that version is trained (--no-check-weight-fingerprints "
        "skips this check)"
    )


def test_a_failed_sglang_checksum_is_skipped_with_one_warning_and_the_next_push_is_a_new_baseline(fake_sglang, caplog):
    """docs/consistency.md: a /weights_checker checksum that fails skips the check (one warning however often), and the
    next push that answers is the change-set rule's baseline again; the push after it is held to the rule."""
    caplog.set_level(logging.INFO, logger="slime.ray.weight_checks")
    args = _args_sglang()
    (engine,) = fake_sglang(1)
    manager = manager_of(args, [engine], ["http://127.0.2.1:30000"])
    v = [trainer(0)] + [trainer(k, CHANGED) for k in range(1, 6)]
    for version in (1, 2):  # baseline, then a correct push
        ray.get(engine.set_checksums.remote(checksums(v[version - 1])))
        manager.check_weight_fingerprints(push(version, v[version - 1]))
    ray.get(engine.fail_checksums.remote("layer 7: cannot checksum a quantized weight"))
    for version in (3, 4):  # skipped, not an error
        manager.check_weight_fingerprints(push(version, v[version - 1]))
    ray.get(engine.fail_checksums.remote(None))
    # version 5: the engine still serves version 2's checksums; against the last baseline (version 2) that is a push
    # that did not reach it, but after the failed checks it is the new baseline
    manager.check_weight_fingerprints(push(5, v[4]))
    warnings = [
        r.getMessage() for r in caplog.records if r.name == "slime.ray.weight_checks" and r.levelno >= logging.WARNING
    ]
    assert warnings == [
        "weight version 3: SGLang /weights_checker checksum failed (layer 7: cannot checksum a quantized weight); "
        "the SGLang engines' weights are not checked"
    ]
    assert sum("change-set rule starts at the next push" in r.getMessage() for r in caplog.records) == 2
    infos = [r.getMessage() for r in caplog.records if "SGLang engine(s) checked" in r.getMessage()]
    assert [m.split(": ", 1)[1] for m in infos] == [
        f"0 CPU-server engine(s) serve what the trainers pushed (fingerprints match); {n} of 1 SGLang engine(s) "
        "checked (agreement and change set)"
        for n in (1, 1, 0, 0, 1)
    ]
    # version 6, still not received: held to the rule again
    with pytest.raises(WeightFingerprintError, match=r"^inference engine 0 .* the update did not reach it"):
        manager.check_weight_fingerprints(push(6, v[5]))


def test_without_fault_tolerance_a_dead_engine_stops_the_drivers_wait(fake_sglang):
    """docs/fault_tolerance.md: the driver's wait (`Watchdog.get`) checks the engines every few seconds; a dead one
    (its server exited) stops the run in one line naming it, instead of waiting on what will never come."""
    from slime.ray.driver import Watchdog

    engine, busy = fake_sglang(2)  # `busy` (no engine of the manager) runs the call the driver waits on
    manager = manager_of(_args_sglang(use_fault_tolerance=False), [engine], ["http://127.0.2.2:30000"])
    ray.get(engine.kill_server.remote())
    why = (
        "inference engine 0 (http://127.0.2.2:30000) died: inference server of engine 1 at http://127.0.2.2:30000 "
        "exited with code -9."
    )
    with pytest.raises(RuntimeError) as err:
        manager.check_engines_alive()
    assert str(err.value).startswith(why)
    with pytest.raises(RuntimeError) as err:
        Watchdog(manager, poll_s=0.05, engine_check_s=0.2).get(busy.hang.remote(30))
    assert str(err.value).startswith(why)


def _args_sglang(**kw):
    from tests._args import make_args

    args = make_args()
    args.model_name, args.update_weight_timeout = "qwen3moeconfig", 60
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("fault_tolerance", [False, True])
@pytest.mark.parametrize("dead", ["actor", "server"])
def test_an_sglang_engine_dead_at_the_check_is_a_failed_engine(fake_sglang, fault_tolerance, dead):
    """Its actor or its server died after the push: a failed engine (before, Ray's error stopped the run, or the SGLang
    check skipped itself with a warning)."""
    args = _args_sglang(use_fault_tolerance=fault_tolerance)
    engines = fake_sglang(2)
    urls = ["http://127.0.2.1:30000", "http://127.0.2.2:30000"]
    manager = manager_of(args, engines, urls)
    v0, v1 = trainer(0), trainer(1, CHANGED)
    ray.get([e.set_checksums.remote(checksums(v0)) for e in engines])
    manager.check_weight_fingerprints(push(1, v0))
    ray.get([e.set_checksums.remote(checksums(v1)) for e in engines])
    # after the push of version 2, before its check
    if dead == "server":
        ray.get(engines[1].kill_server.remote())
    else:
        ray.kill(engines[1])
    if not fault_tolerance:
        with pytest.raises(RuntimeError) as err:
            manager.check_weight_fingerprints(push(2, v1))
        why = (
            "its engine actor died"
            if dead == "actor"
            else f"inference server of engine 1 at {urls[1]} exited with code -9."
        )
        assert str(err.value) == f"inference engine 1 ({urls[1]}) died during the weight check of version 2 ({why})"
        return
    manager.check_weight_fingerprints(push(2, v1))
    assert manager.rollout_engines == [engines[0], None]  # removed; `recover` replaces it before the next push
    assert [e["kind"] for e in manager.fault_events] == ["engine_failed", "engine_removed"]
    # the survivor is still held to the rule: version 3 it did not receive stops the run
    with pytest.raises(WeightFingerprintError, match=r"^inference engine 0 .* the update did not reach it"):
        manager.check_weight_fingerprints(push(3, trainer(3, CHANGED)))


def test_a_cpu_server_killed_between_the_push_and_the_check(ray_session, tiny_kit):
    """Two real CPU servers; engine 1's server is SIGKILLed after the push. Without --use-fault-tolerance the run
    stops in one line saying it died; with it (the same engines), it is removed and engine 0's fingerprint is still
    checked."""
    args = _args(tiny_kit[0], 1)
    engines = start_engines(args, 2)
    try:
        urls = ray.get([e.get_url.remote() for e in engines])
        served = ray.get(engines[0].get_weights_fingerprint.remote(), timeout=120)  # what the "trainer" pushed
        version = served["weight_version"]
        os.kill(ray.get(engines[1].get_server_pid.remote()), signal.SIGKILL)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                ray.get(engines[1].check_alive.remote(), timeout=30)
                time.sleep(0.2)
            except Exception:  # noqa: BLE001  (the server is gone)
                break
        with pytest.raises(RuntimeError) as err:
            manager_of(args, engines, urls).check_weight_fingerprints(push(version, served["tensor_hashes"]))
        assert str(err.value) == (
            f"inference engine 1 ({urls[1]}) died during the weight check of version {version} (inference "
            f"server of engine 1 at {urls[1]} exited with code -9.)"
        )
        args.use_fault_tolerance = True
        manager = manager_of(args, engines, urls)
        manager.check_weight_fingerprints(push(version, served["tensor_hashes"]))
        assert manager.rollout_engines == [engines[0], None]
        assert [e["kind"] for e in manager.fault_events] == ["engine_failed", "engine_removed"]
        # engine 0 was checked: a wrong hash on it still stops the run
        bad = dict(served["tensor_hashes"], **{"model.embed_tokens.weight": "0" * 16})
        with pytest.raises(WeightFingerprintError, match=r"^inference engine 0 .* first differing tensor"):
            manager.check_weight_fingerprints(push(version, bad))
    finally:
        stop([e for e in engines])
