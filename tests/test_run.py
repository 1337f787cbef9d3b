"""`slime.ray.run`: the run's derived arguments are final before any actor copies them, and the order of a weight
push around engine replacement. The order tests record the calls `Run.push_weights` makes on stand-ins for the two
groups: what they guard (GPU memory held by trainers and a new engine at once, an engine serving --hf-checkpoint's
weights behind the router) cannot be observed on a CPU machine; the end-to-end fault tests run the same code for real."""

import pytest

from slime.ray.run import Run, finish_args, resume_rollout_id
from tests._args import BASE, make_args

NO_NUM_ROLLOUT = [t for i, t in enumerate(BASE) if "--num-rollout" not in BASE[max(0, i - 1) : i + 1]]


def test_finish_args_sets_num_rollout_and_the_resumed_rollout_before_any_actor(tiny_kit, tmp_path):
    # TINY_PROMPTS holds 4 prompts: two rollouts of 2 per epoch
    args = make_args(
        "--num-epoch",
        "3",
        "--rollout-batch-size",
        "2",
        "--global-batch-size",
        "4",
        base=NO_NUM_ROLLOUT,
        hf_checkpoint=tiny_kit[0],
    )
    assert finish_args(args) == 2 and (args.num_rollout, args.start_rollout_id) == (6, 0)

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    resumed = make_args(load=str(tmp_path), finetune=False, start_rollout_id=None)
    assert finish_args(resumed) is None and resumed.start_rollout_id == 5  # the trainers resume after iteration 4
    assert resume_rollout_id(make_args(load=str(tmp_path), finetune=False, ckpt_step=2)) == 3
    assert resume_rollout_id(make_args(load=str(tmp_path), finetune=True)) == 0  # weights only: from rollout 0
    assert resume_rollout_id(make_args(load=str(tmp_path / "absent"), finetune=False)) == 0
    explicit = make_args(load=str(tmp_path), finetune=False, start_rollout_id=2)
    finish_args(explicit)
    assert explicit.start_rollout_id == 2  # --start-rollout-id wins, as in slime


def test_finish_args_names_an_epoch_shorter_than_a_rollout(tiny_kit):
    args = make_args(
        "--num-epoch",
        "1",
        "--rollout-batch-size",
        "8",
        "--global-batch-size",
        "16",
        base=NO_NUM_ROLLOUT,
        hf_checkpoint=tiny_kit[0],
    )
    with pytest.raises(ValueError, match="nothing to train: --num-rollout 0"):
        finish_args(args)


class Recorder:
    """Stand-in for RayTrainGroup and RolloutManager: logs each call, answers like them."""

    def __init__(self, log, lost_engines=(), dead=()):
        self.log, self.lost, self.dead = log, list(lost_engines), list(dead)
        self.rollout_engines, self.rollout_engine_lock = ["engine0", "engine1"], "lock"

    def __getattr__(self, name):
        return lambda *a, **kw: self.log.append((name, *a)) or []

    def async_update_weights(self, version=None):
        self.log.append(("async_update_weights", version))
        return [{"update_weights/weight_version": version or 7}]

    def recover(self, get, resume_tags=None):
        self.log.append(("recover", resume_tags))
        dead, self.dead = self.dead, []
        return dead

    def remove_lost(self, metrics):
        lost, self.lost = self.lost, []
        self.log.append(("remove_lost", lost))
        self.dead += lost  # removed: the next `recover` replaces them
        return lost


def run_with(args, dead=(), lost_engines=()):
    run = Run.__new__(Run)  # the groups only: no placement, no actors
    log = []
    run.args, run.get = args, lambda refs: refs
    run.actor_model = Recorder(log)
    run.rollout_manager = Recorder(log, lost_engines=lost_engines, dead=dead)
    run._trainers_offloaded, run._pushes, run._unchecked, run._async_commits = False, 1, None, None
    return run, log


class WritingGroup:
    """A trainer group of two ranks whose --async-save write of checkpoint 7 ends after `polls_to_finish` polls."""

    def __init__(self, polls_to_finish):
        self.polls, self.polls_to_finish = 0, polls_to_finish

    def async_finalize_save(self, blocking):
        self.polls += 1
        return [7 if blocking or self.polls >= self.polls_to_finish else None] * 2


def test_async_save_names_a_checkpoint_once_every_trainer_group_has_written_it(tmp_path):
    from slime.ray.checkpoint import AsyncCommits
    from slime.utils.checkpoint_tracker import read_tracker

    commits = AsyncCommits(make_args("--async-save", "--save", str(tmp_path)), get=lambda refs: refs)
    actor, critic = WritingGroup(1), WritingGroup(3)
    commits.poll(blocking=True)  # nothing in flight: nothing asked, nothing named
    commits.started(7, [actor, critic])
    commits.poll()  # the actor's write has ended, the critic's has not
    assert read_tracker(str(tmp_path)) is None and (actor.polls, critic.polls) == (1, 1)
    commits.poll()
    assert read_tracker(str(tmp_path)) is None and (actor.polls, critic.polls) == (1, 2)  # a finished group rests
    commits.poll(blocking=True)  # the next save, --release-train or the run's end waits for it
    assert read_tracker(str(tmp_path)) == 7 and (actor.polls, critic.polls) == (1, 3)
    commits.poll(blocking=True)
    assert (actor.polls, critic.polls) == (1, 3)


def test_colocated_push_starts_a_replacement_engine_only_after_the_trainers_released_the_gpu():
    run, log = run_with(make_args("--colocate", "--use-fault-tolerance"), dead=[0])
    run.push_weights()
    calls = [c[0] for c in log]
    assert calls.index("async_offload") < calls.index("recover")  # the trainers' memory is free first
    assert calls.index("recover") < calls.index("async_init_weight_update_connections") < calls.index("async_onload")
    assert calls.index("async_onload") < calls.index("async_update_weights")


def test_a_replacement_joins_the_router_only_once_it_serves_the_pushed_weights():
    run, log = run_with(make_args("--use-fault-tolerance"), dead=[1])
    run.push_weights(5)
    calls = [c[0] for c in log]
    assert "async_offload" not in calls and "async_onload" not in calls  # disaggregated
    order = ["recover", "async_update_weights", "check_weight_versions", "join_router"]
    assert [c for c in calls if c in order] == order
    assert ("join_router", [1]) in log


def test_an_engine_lost_during_the_push_is_replaced_and_given_the_same_version_before_joining():
    run, log = run_with(make_args("--use-fault-tolerance"), lost_engines=[0])
    run.push_weights(4)
    pushes = [c for c in log if c[0] == "async_update_weights"]
    assert pushes == [("async_update_weights", 4), ("async_update_weights", 4)]
    calls = [c[0] for c in log]
    assert calls.index("remove_lost") < calls.index("async_init_weight_update_connections")
    assert calls[-2:] == ["check_weight_versions", "join_router"]


def test_the_fingerprint_check_runs_before_the_versions_samples_train_not_inside_the_push(monkeypatch):
    """A push returns while the trainers still hash what they sent; `Run` checks the engines against those hashes
    (merged into each rank's push metrics) before the next training step (before colocated engines release their
    weights), before the next push when nothing trained, and at the end of the run, each push once."""
    from slime.ray import run as run_module

    run, log = run_with(make_args("--colocate"))
    hashes = {
        "update_weights/tensor_hashes": {"w": "0123456789abcdef"},
        "update_weights/tensor_hash_algorithm": "xxh3",
    }
    run.actor_model.async_sent_weight_hashes = lambda: log.append(("async_sent_weight_hashes",)) or [hashes]
    run.actor_model.released, run.critic_model = False, None
    monkeypatch.setattr(run_module.critic, "train_step", lambda *a: log.append(("train_step",)))

    run.push_weights(3)
    calls = [c[0] for c in log]
    assert "check_weight_fingerprints" not in calls and "async_sent_weight_hashes" not in calls
    assert ("set_weight_version", 3) in log  # the version is recorded; its samples train only after the check
    del log[:]
    run.train(0, "rollout-ref")
    calls = [c[0] for c in log]
    assert calls[:2] == ["async_sent_weight_hashes", "check_weight_fingerprints"]
    assert calls.index("check_weight_fingerprints") < calls.index("async_offload") < calls.index("train_step")
    assert log[1][1] == [{"update_weights/weight_version": 3, **hashes}]
    run.train(1, "rollout-ref")  # checked once
    run.push_weights(4)
    run.push_weights(5)  # nothing trained on 4: checked before 5 is pushed
    checks = [c[1][0]["update_weights/weight_version"] for c in log if c[0] == "check_weight_fingerprints"]
    assert checks == [3, 4]
    run.recorder = type("Recorder", (), {"finish": lambda self: log.append(("finish",))})()
    run.finish()
    # then the trainer's and the rollout controller's W&B sides close before the driver's
    assert [c[0] for c in log][-5:] == [
        "async_sent_weight_hashes",
        "check_weight_fingerprints",
        "async_finish_tracking",
        "async_finish_tracking",
        "finish",
    ]
    assert log[-4][1][0]["update_weights/weight_version"] == 5


class _VersionedEngine:
    """An engine actor's handle as `check_weight_versions` calls it: `get_weight_version.remote()` answers the version
    (the test's `ray.get` returns what it is given)."""

    def __init__(self, version):
        self.get_weight_version = type("Method", (), {"remote": staticmethod(lambda: version)})()


def _manager_serving(monkeypatch, versions):
    from types import SimpleNamespace

    from slime.ray import weight_checks
    from tests.test_weight_check import manager_of

    monkeypatch.setattr(weight_checks, "ray", SimpleNamespace(get=lambda refs: refs))
    urls = [f"http://127.0.0.1:{30000 + i}" for i in range(len(versions))]
    return manager_of(make_args("--use-fault-tolerance"), [_VersionedEngine(v) for v in versions], urls)


def test_check_weight_versions_names_an_engine_that_serves_another_version(monkeypatch):
    """docs/architecture.md: a replacement joins the router only once it reports the pushed version; one that
    reports another is named with both versions, and only the engines asked about are checked."""
    manager = _manager_serving(monkeypatch, ["5", 4])
    metrics = [None, {"update_weights/weight_version": 5}]  # ranks without metrics are skipped
    with pytest.raises(RuntimeError) as err:
        manager.check_weight_versions(metrics, [1])
    assert str(err.value) == (
        "inference engine 1 (http://127.0.0.1:30001) serves weight version 4 after the update, expected 5"
    )
    with pytest.raises(RuntimeError, match="inference engine 1 .* version 4 .* expected 5"):
        manager.check_weight_versions(metrics)  # all engines: engine 0 serves "5" (compared as text)
    assert manager.check_weight_versions(metrics, [0]) == ["5"]


def test_a_replacement_serving_the_wrong_version_never_joins_the_router(monkeypatch):
    manager = _manager_serving(monkeypatch, [7, 6])
    run, log = run_with(make_args("--use-fault-tolerance"), dead=[1])
    run.rollout_manager.check_weight_versions = manager.check_weight_versions  # the real check, on stand-in engines
    with pytest.raises(
        RuntimeError, match="inference engine 1 .* serves weight version 6 after the update, expected 7"
    ):
        run.push_weights()  # the stand-in trainers push version 7
    calls = [c[0] for c in log]
    assert "recover" in calls and "join_router" not in calls
