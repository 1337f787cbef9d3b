"""--use-pytorch-profiler / --record-memory-history: the trainers write a torch profiler trace per --profile-target
and a memory recording, as current slime does; bad combinations stop at start-up in one line."""

import gzip
import json

import memray
import pytest
import torch

import train as sync_driver
from slime.observability.profile_utils import TARGETS, TrainProfiler
from tests._args import make_args, one_line_refusal
from tests.test_e2e import make_args as make_run_args


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--use-pytorch-profiler"], "--use-pytorch-profiler writes its traces to --tensorboard-dir: set it."),
        (
            [
                "--use-pytorch-profiler",
                "--tensorboard-dir",
                "/tmp/t",
                "--profile-step-start",
                "3",
                "--profile-step-end",
                "3",
            ],
            "--profile-step-start 3 / --profile-step-end 3: the profiler records rollouts [start, end)",
        ),
        (
            [
                "--use-pytorch-profiler",
                "--tensorboard-dir",
                "/tmp/t",
                "--profile-target",
                "train_overall",
                "train_actor",
            ],
            "--profile-target train_overall train_actor: torch runs one profiler per thread at a time",
        ),
        (["--record-memory-history"], "--memory-recorder torch records the CUDA caching allocator, which a CPU run"),
        (["--record-memory-history", "--memory-recorder", "memray"], "set --memory-snapshot-num-steps"),
        (
            ["--record-memory-history", "--memory-recorder", "memray", "--profile-target", "train_actor"],
            "--record-memory-history records the whole trainer: add train_overall to --profile-target.",
        ),
    ],
)
def test_profiling_start_up_checks(capsys, argv, message):
    assert message in one_line_refusal(capsys, *argv)


def test_memray_recording_is_refused_at_start_up_where_memray_is_not_installed(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "memray" else find_spec(name, *a)
    )
    argv = ["--record-memory-history", "--memory-recorder", "memray", "--memory-snapshot-num-steps", "1"]
    assert "--memory-recorder memray needs the memray package" in one_line_refusal(capsys, *argv)


def test_profiling_flags_parse_with_upstream_defaults():
    args = make_args()
    assert (args.use_pytorch_profiler, args.profile_step_start, args.profile_step_end) == (False, 10, 12)
    assert args.profile_target == ["train_overall"] and args.memory_recorder == "torch"
    assert (args.memory_snapshot_dir, args.memory_snapshot_path, args.profile_ranks) == (".", "snapshot.pickle", [0])


def _trace(tb_dir, target):
    """Names of the events in `target`'s trace files (one for train_overall, one per recorded phase otherwise)."""
    names = set()
    for path in tb_dir.glob(f"{target}_rank_0*.pt.trace.json.gz"):
        with gzip.open(path) as f:
            names |= {e.get("name") for e in json.load(f)["traceEvents"]}
    return names


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_traces_its_phase_of_the_recorded_rollouts(tmp_path, target):
    """A trainer's rollout as `actor.train` runs it: log-prob forwards, then training steps, then `step`."""
    args = make_args(
        *["--use-pytorch-profiler", "--tensorboard-dir", tmp_path, "--profile-target", target],
        *["--profile-step-start", "1", "--profile-step-end", "3"],
    )
    prof = TrainProfiler(args)
    prof.on_init_end()
    x = torch.ones(4, 4)
    for rollout_id in range(4):
        with prof.phase("train_log_probs"), torch.profiler.record_function(f"log_probs_{rollout_id}"):
            x @ x
        with prof.phase("train_actor"), torch.profiler.record_function(f"train_{rollout_id}"):
            x @ x
        with torch.profiler.record_function(f"between_{rollout_id}"):  # outside both phases
            x @ x
        prof.step(rollout_id)
    ours = {n for n in _trace(tmp_path, target) if n and n.split("_")[0] in ("log", "train", "between")}
    # rollouts 1 and 2 are recorded, 0 and 3 are not; a phase target records only its phase
    expected = {
        "train_overall": ["log_probs", "train", "between"],
        "train_actor": ["train"],
        "train_log_probs": ["log_probs"],
    }[target]
    assert ours == {f"{phase}_{r}" for phase in expected for r in (1, 2)}


@pytest.mark.e2e
@pytest.mark.slow
def test_trainer_writes_a_trace_and_a_memray_recording(ray_session, tiny_kit, tmp_path):
    tb, mem = tmp_path / "tb", tmp_path / "mem"
    args = make_run_args(
        tiny_kit,
        tmp_path,
        *[
            "--use-pytorch-profiler",
            "--tensorboard-dir",
            str(tb),
            "--profile-step-start",
            "1",
            "--profile-step-end",
            "2",
        ],
        *["--record-memory-history", "--memory-recorder", "memray", "--memory-snapshot-num-steps", "1"],
        *["--memory-snapshot-dir", str(mem), "--rollout-num-gpus", "1"],
        num_rollout=2,
    )
    sync_driver.train(args)
    # the second rollout (step 1) of the whole trainer: its log-prob forwards and optimizer steps
    overall = _trace(tb, "train_overall")
    assert "ProfilerStep#1" in overall and "aten::mm" in overall and "Optimizer.step#AdamW.step" in overall
    # memray recorded trainer rank 0 from start-up through the first rollout, model build included
    reader = memray.FileReader(str(mem / "memory_snapshot_rank0_snapshot.pickle"))
    assert reader.metadata.total_allocations > 1000 and reader.metadata.peak_memory > 1 << 20
