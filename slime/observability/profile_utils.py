"""Profiling the trainers, as current slime does: a torch profiler trace (`--use-pytorch-profiler`) and a memory
recording (`--record-memory-history`) per trainer rank.

`--profile-target` picks what is traced, one target per run: `train_overall` (everything a trainer does, one profiler
step per rollout, one trace), `train_actor` (the training steps) or `train_log_probs` (the log-prob forwards: one
trace per forward). Rollouts `--profile-step-start` to `--profile-step-end` (excluded) are recorded, counted from the
trainer's start, as TensorBoard traces (`{target}_rank_{R}.*.pt.trace.json.gz`) in `--tensorboard-dir`, on the
ranks in `--profile-ranks`. The memory recorder (`--memory-recorder torch`: the CUDA caching allocator's history, dumped also
on an out-of-memory error; `memray`: every allocation of the process, CPU machines included) runs from start-up until
rollout `--memory-snapshot-num-steps` and writes `--memory-snapshot-dir/memory_snapshot_rank{R}_{--memory-snapshot-path}`.
"""

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from slime.utils import device

logger = logging.getLogger(__name__)

TARGETS = ("train_overall", "train_actor", "train_log_probs")


class TrainProfiler:
    def __init__(self, args, enabled=True):
        self.args = args
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._rollouts = 0  # rollouts trained by this process: the profiler's steps
        self._target = None  # parse_args allows one (torch runs one profiler per thread at a time)
        if enabled and args.use_pytorch_profiler and rank in args.profile_ranks:
            self._target = args.profile_target[0]
            self._handler = torch.profiler.tensorboard_trace_handler(
                args.tensorboard_dir, worker_name=f"{self._target}_rank_{rank}", use_gzip=True
            )
        self._overall = None
        if self._target == "train_overall":
            start, end = args.profile_step_start, args.profile_step_end
            # skip the rollouts before `start` (the last of them warms up), record [start, end)
            schedule = torch.profiler.schedule(
                wait=max(start - 1, 0), warmup=1 if start > 0 else 0, active=end - start, repeat=1
            )
            self._overall = _torch_profiler(schedule, self._handler)
        self._memory = None
        if enabled and args.record_memory_history:
            os.makedirs(args.memory_snapshot_dir, exist_ok=True)
            path = os.path.join(args.memory_snapshot_dir, f"memory_snapshot_rank{rank}_{args.memory_snapshot_path}")
            self._memory = _MEMORY_RECORDERS[args.memory_recorder](path)
            self._memory.start()

    def on_init_end(self):
        if self._overall is not None:
            self._overall.start()

    @contextlib.contextmanager
    def phase(self, target):
        """Trace the block when `target` is profiled and this rollout is in [--profile-step-start, -end): one trace
        file per block (a phase runs once or more per rollout)."""
        if target != self._target or not self.args.profile_step_start <= self._rollouts < self.args.profile_step_end:
            yield
            return
        with _torch_profiler(None, self._handler):
            yield

    def step(self, rollout_id):
        """After each rollout's training."""
        self._rollouts += 1
        if self._overall is not None:
            self._overall.step()
        if self._memory is not None and rollout_id + 1 == self.args.memory_snapshot_num_steps:
            self._memory.stop()
            self._memory = None


def _torch_profiler(schedule, on_trace_ready):
    return torch.profiler.profile(
        activities=device.profiler_activities(),
        schedule=schedule,
        on_trace_ready=on_trace_ready,
        record_shapes=True,
        with_stack=True,
        profile_memory=True,
        with_flops=True,
    )


class _TorchMemoryHistory:
    """The CUDA caching allocator's history of allocations with their stacks (torch.cuda.memory)."""

    def __init__(self, path):
        self.path = path
        self.memory = device.memory_history_module()

    def start(self):
        self.memory._record_memory_history(max_entries=1_000_000, stacks="all")

        def on_oom(dev, alloc, device_alloc, device_free):
            logger.error("out of memory on device %s: dumping the memory history to %s", dev, self.path)
            self.memory._dump_snapshot(self.path)

        torch._C._cuda_attach_out_of_memory_observer(on_oom)

    def stop(self):
        logger.info("memory history written to %s", self.path)
        self.memory._dump_snapshot(self.path)
        self.memory._record_memory_history(enabled=None)


class _MemrayRecording:
    """Every allocation of this process with native stacks (memray's capture file: `memray flamegraph PATH`)."""

    def __init__(self, path):
        import memray  # optional: the [profile] extra

        if os.path.exists(path):  # memray refuses to overwrite: a rerun with the same paths replaces the file
            os.remove(path)
        self.tracker = memray.Tracker(file_name=path, native_traces=True)

    def start(self):
        self.tracker.__enter__()

    def stop(self):
        self.tracker.__exit__(None, None, None)


_MEMORY_RECORDERS = {"torch": _TorchMemoryHistory, "memray": _MemrayRecording}
