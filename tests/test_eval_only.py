"""An eval-only run (`--num-rollout 0` with eval data) and `--skip-eval-before-train`, end to end on the tiny kit:
real trainers, CPU inference server and router (Ray; run under the heavy-test lock)."""

import pytest

import train as sync_driver
from slime.ray.driver import RunRecorder
from tests.test_e2e import make_args, read_metrics


def _eval_args(tiny_kit, tmp_path, *extra, num_rollout):
    return make_args(
        tiny_kit,
        tmp_path,
        "--rollout-num-gpus",
        "1",
        "--eval-interval",
        "1",
        "--eval-prompt-data",
        "addition",
        f"{tiny_kit[1]}/eval.jsonl",
        "--eval-temperature",
        "0",
        *extra,
        num_rollout=num_rollout,
    )


@pytest.mark.slow
def test_eval_only_and_skip_eval_before_train(ray_session, tiny_kit, tmp_path, monkeypatch):
    evals = []
    record_eval = RunRecorder.eval
    monkeypatch.setattr(RunRecorder, "eval", lambda self, i, m: (evals.append(i), record_eval(self, i, m)))

    only = tmp_path / "only"
    only.mkdir()
    sync_driver.train(_eval_args(tiny_kit, only, num_rollout=0))
    rows = read_metrics(only)
    # one eval of the initial weights; nothing generated for training, nothing trained
    assert evals == [0]
    assert len(rows) == 1 and rows[0]["rollout_id"] == 0 and 0.0 <= rows[0]["eval/addition"] <= 1.0
    assert not any(k.startswith("train/") for k in rows[0])

    evals.clear()
    skip = tmp_path / "skip"
    skip.mkdir()
    sync_driver.train(_eval_args(tiny_kit, skip, "--skip-eval-before-train", num_rollout=1))
    # without the flag: an eval at rollout 0 before training, and the periodic one after rollout 0
    assert evals == [0]
    rows = read_metrics(skip)
    assert [r["rollout_id"] for r in rows] == [0] and "train/pg_loss" in rows[0] and "eval/addition" in rows[0]
