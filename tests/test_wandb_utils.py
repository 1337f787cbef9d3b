"""wandb_utils: shared offline run, metric step axes, log() no-op without --use-wandb."""

import glob
import os
import pickle
import subprocess
import sys

import pytest

from slime.observability import wandb_utils
from tests._args import make_args


def _args(tmp_path, **kw):
    base = dict(
        use_wandb=True,
        wandb_mode=None,
        wandb_key=None,
        wandb_host=None,
        wandb_dir=str(tmp_path / "wb"),
        wandb_group="unit",
        wandb_project="slime-test",
        wandb_team=None,
        wandb_random_suffix=True,
        rank=0,
        rollout_batch_size=4,
        n_samples_per_prompt=8,
        global_batch_size=16,
    )
    base.update(kw)
    return make_args(**base)


def test_disabled_is_noop(monkeypatch):
    args = make_args()
    assert wandb_utils.init_wandb_primary(args) is None and args.wandb_run_id is None
    assert wandb_utils.init_wandb_secondary(args, None) is None
    # log() still validates and returns the record it would have logged, but touches no wandb run.
    rec = wandb_utils.log(args, {"rollout/raw_reward": 0.25}, "rollout/step", step=5)
    assert rec == {"rollout/raw_reward": 0.25, "rollout/step": 5}
    with pytest.raises(ValueError, match="rollout/step"):
        wandb_utils.log(args, {"rollout/raw_reward": 0.25}, "rollout/step")
    with pytest.raises(ValueError, match="bogus/step"):
        wandb_utils.log(args, {"x": 1}, "bogus/step", step=1)


def test_train_step_axis():
    args = make_args("--wandb-always-use-train-step", "--n-samples-per-prompt", "8", "--global-batch-size", "16")
    # 4 prompts * 8 samples / 16 per step = 2 optimizer steps per rollout: rollout 3 ends at train step 6.
    assert wandb_utils.get_step(args, "rollout", 3) == 6
    assert wandb_utils.get_step(args, "train", 3) == 3
    args.wandb_always_use_train_step = False
    assert wandb_utils.get_step(args, "eval", 3) == 3


def test_bad_mode_names_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(ValueError, match="--wandb-mode"):
        wandb_utils.init_wandb_primary(_args(tmp_path, wandb_mode="cloudy"))


@pytest.mark.slow  # development tier: starts wandb's offline service (tens of seconds)
def test_offline_primary_and_secondary_share_run(tmp_path, monkeypatch):
    import wandb

    monkeypatch.delenv("WANDB_MODE", raising=False)  # no key, no mode: must fall back to offline, not ask for login
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    from wandb.sdk.wandb_run import Run

    defined = []
    real_define = Run.define_metric

    def spy(self, name, *a, **kw):  # records the axes, then defines them for real
        defined.append((name, kw.get("step_metric")))
        return real_define(self, name, *a, **kw)

    monkeypatch.setattr(Run, "define_metric", spy)
    args = _args(tmp_path)
    try:
        run_id = wandb_utils.init_wandb_primary(args)
        assert run_id and args.wandb_run_id == run_id
        assert os.environ["WANDB_MODE"] == "offline"
        assert wandb.run.group.startswith("unit_") and wandb.run.name == f"{wandb.run.group}-RANK_0"
        wandb_utils.log(args, {"rollout/raw_reward": 0.5}, "rollout/step", step=3)
        wandb_utils.log(args, {"train/loss": 1.5, "train/step": 7}, "train/step")
        summary = dict(wandb.run.summary)
        assert summary["rollout/raw_reward"] == 0.5 and summary["rollout/step"] == 3
        assert summary["train/loss"] == 1.5 and summary["train/step"] == 7
    finally:
        wandb.finish()
        wandb.teardown()  # stops the wandb-core service this process started (it would outlive the test)
    axes = dict(defined)
    assert axes["train/*"] == "train/step"
    for fam in ("rollout", "multi_turn", "passrate", "perf"):
        assert axes[f"{fam}/*"] == "rollout/step"
    assert axes["eval/*"] == "eval/step"

    # An actor process joins the same run id (offline: its own run dir carrying that id).
    args_file = tmp_path / "args.pkl"
    args_file.write_bytes(pickle.dumps(args))
    code = (
        "import pickle, wandb; from slime.observability import wandb_utils as W;"
        f"a = pickle.load(open({str(args_file)!r}, 'rb'));"
        f"assert W.init_wandb_secondary(a, {run_id!r}) == {run_id!r};"
        "W.log(a, {'eval/acc': 1.0}, 'eval/step', step=0); wandb.finish()"
    )
    env = dict(os.environ, WANDB_MODE="offline")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env, cwd=os.getcwd())
    run_dirs = glob.glob(os.path.join(args.wandb_dir, "wandb", f"offline-run-*-{run_id}"))
    assert len(run_dirs) >= 1 and all(glob.glob(os.path.join(d, f"run-{run_id}.wandb")) for d in run_dirs)
