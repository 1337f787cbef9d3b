"""--release-train: the trainers are shut down after each weight push and recreated from --save before training.

The end-to-end run records, from inside each training step (a before-train-step hook), the trainer's process id,
the sum of its weights and the optimizer's step count; its generate function checks that the trainers of the previous
rollout are gone while it generates. The published disk versions (kept) hold what the engines served."""

import json
import os
import time

import pytest
from safetensors.torch import load_file

import train as sync_driver
from slime.config import parse_args
from tests._args import BASE as TINY_BASE
from tests._args import TINY_MODEL, one_line_refusal
from tests._args import make_args as parse
from tests.test_e2e import make_args, read_metrics

TINY_ARGV = [*TINY_BASE, *TINY_MODEL]
BASE = [
    "--release-train",
    "--update-weight-transport",
    "disk",
    "--update-weight-disk-dir",
    "/tmp/x",
    "--save",
    "/tmp/s",
]


@pytest.mark.parametrize(
    "argv, why",
    [
        (["--release-train"], "needs --update-weight-transport disk --update-weight-mode full"),
        (
            [*BASE, "--update-weight-mode", "delta", "--update-weight-local-checkpoint-dir", "/tmp/l"],
            "needs --update-weight-transport disk --update-weight-mode full",
        ),
        (BASE[:5], "needs --save"),
        (
            [*BASE, "--save-interval", "2"],
            "saves after every rollout (the next trainers load it): drop --save-interval 2",
        ),
        ([*BASE, "--advantage-estimator", "ppo"], "with a critic"),
        (
            [*BASE, "--use-kl-loss", "--ref-update-interval", "2"],
            "with --ref-update-interval: the updated reference lives in the trainers only",
        ),
        ([*BASE, "--debug-rollout-only"], "with --debug-rollout-only: there are no trainers to release"),
    ],
)
def test_release_train_start_up_checks(capsys, argv, why):
    assert f"--release-train {why}" in one_line_refusal(capsys, *argv)


def test_release_train_refuses_lora_adapter_sync(capsys):
    """--lora-sync adapter sends adapters by value, never through the disk --release-train needs: refused in one
    line whichever transport is given (with disk, by --lora-sync adapter's own rule, which runs first)."""
    lora = ["--enable-lora", "--lora-sync", "adapter"]
    err = one_line_refusal(capsys, *BASE, *lora)
    assert "--lora-sync adapter" in err and "use --lora-sync merged" in err
    err = one_line_refusal(capsys, "--release-train", "--save", "/tmp/s", *lora)
    assert "--release-train needs --update-weight-transport disk" in err


def test_release_train_is_refused_by_train_async(capsys):
    with pytest.raises(SystemExit):
        parse_args(argv=[*TINY_ARGV, *BASE], check_paths=False, asynchronous=True)
    assert "--release-train: train_async.py generates while the trainers work" in capsys.readouterr().err


def test_release_train_saves_every_rollout():
    assert parse(*BASE).save_interval == 1


def _record_path(args):
    return os.path.join(os.path.dirname(args.metrics_path), "steps.jsonl")


def record_step(args, rollout_id, step_id, model, optimizer, opt_param_scheduler):
    """--custom-megatron-before-train-step-hook-path: who trains, on which weights, at which optimizer step."""
    if step_id != 0:
        return
    total = sum(p.detach().double().sum().item() for m in model for p in m.parameters())
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    adam_steps = sorted({float(s["step"]) for o in inner for s in o.state.values() if "step" in s})
    group_steps = sorted({g.get("step") for o in inner for g in o.param_groups})
    row = dict(rollout_id=rollout_id, pid=os.getpid(), weight_sum=total, scheduler_steps=opt_param_scheduler.num_steps)
    with open(_record_path(args), "a") as f:
        f.write(json.dumps({**row, "adam_steps": adam_steps, "group_steps": group_steps}) + "\n")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def check_trainers_gone_generate(args, sample, sampling_params):
    """Custom generate: every trainer that trained an earlier rollout has exited (given up to 30 s to die)."""
    from slime.rollout.sglang_rollout import generate

    path = _record_path(args)
    pids = [json.loads(line)["pid"] for line in open(path)] if os.path.exists(path) else []
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            with open(path + ".alive", "a") as f:
                f.write(f"{[p for p in pids if _alive(p)]} alive while generating sample {sample.index}\n")
            break
        time.sleep(0.1)
    return await generate(args, sample, sampling_params)


@pytest.mark.e2e
@pytest.mark.slow
def test_release_train_recreates_trainers_from_each_save_and_trains_on(ray_session, tiny_kit, tmp_path):
    versions = tmp_path / "versions"
    args = make_args(
        tiny_kit,
        tmp_path,
        *["--colocate", "--release-train", "--update-weight-transport", "disk"],
        *["--update-weight-disk-dir", str(versions), "--update-weight-disk-keep-files"],
        *["--save", str(tmp_path / "ckpt")],
        *["--custom-megatron-before-train-step-hook-path", f"{__name__}.record_step"],
        *["--custom-generate-function-path", f"{__name__}.check_trainers_gone_generate"],
        num_rollout=3,
    )
    sync_driver.train(args)

    assert not os.path.exists(_record_path(args) + ".alive"), open(_record_path(args) + ".alive").read()
    steps = [json.loads(line) for line in open(_record_path(args))]
    assert [s["rollout_id"] for s in steps] == [0, 1, 2]
    assert len({s["pid"] for s in steps}) == 3, "each rollout is trained by new trainer processes"
    # each new trainer starts on exactly the weights the engines generated its rollout with: the version pushed
    # before rollout r is r + 1 (the initial push is 1), written to disk by the trainers before it
    for s in steps:
        [shard] = (versions / f"weight_v{s['rollout_id'] + 1:06d}").glob("*.safetensors")
        served = sum(t.double().sum().item() for t in load_file(shard).values())
        assert abs(s["weight_sum"] - served) < 1e-6, (s, served)
    # and resumes the optimizer as a run that never stopped: 2 steps of 8 samples per rollout (the scheduler
    # counts samples), and each parameter's Adam step count (its bias correction) is 2 per rollout
    assert [s["scheduler_steps"] for s in steps] == [0, 16, 32]
    assert [s["adam_steps"] for s in steps] == [[], [2.0], [4.0]]
    assert [s["group_steps"] for s in steps] == [[None], [2.0], [4.0]]
    # the run went on: every rollout trained and generated by the version pushed before it
    rows = read_metrics(tmp_path)
    assert [int(r["rollout/weight_version"]) for r in rows] == [1, 2, 3]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # the trainer scores each rollout's tokens as the engine sampled them: the engine served the trainer's weights
    assert all(r["train/train_rollout_logprob_abs_diff"] < 1e-4 for r in rows), rows
