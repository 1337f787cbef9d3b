import contextlib
import json
import os
import signal
import threading
import time

import ray

NOSET_VISIBLE_DEVICES_ENV_VARS_LIST = [
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
]


@ray.remote(num_cpus=0)
class Lock:
    """Non-blocking lock: no weight broadcast into the engines while another source rank holds them."""

    def __init__(self):
        self.locked = False

    def acquire(self) -> bool:
        if self.locked:
            return False
        self.locked = True
        return True

    def release(self) -> None:
        assert self.locked, "Lock.release() called while the lock is not held"
        self.locked = False


@contextlib.contextmanager
def cleanup_on_exit(rollout_manager, actor_model=None):
    """Stop engines, router and training actors however the run ends (return, exception, Ctrl-C, SIGTERM)."""
    previous = signal.getsignal(signal.SIGTERM)

    def _on_sigterm(signum, frame):
        raise KeyboardInterrupt(f"received signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
        rollout_manager.shutdown()
        if actor_model is not None:
            actor_model.kill()


class RunRecorder:
    """Per-rollout metrics on the driver: one compact console line, a JSONL record (`--metrics-path`) and wandb."""

    def __init__(self, args, rollout_manager):
        self.args, self.rollout_manager = args, rollout_manager
        self.last_time = time.time()
        self.pending_eval = {}
        if args.metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_path)), exist_ok=True)

    def eval(self, rollout_id, eval_metrics):
        self.pending_eval.update(eval_metrics or {})

    def rollout_done(self, rollout_id, train_metrics, update_metrics=None):
        now = time.time()
        record = {"rollout_id": rollout_id}
        record.update(ray.get(self.rollout_manager.controller.get_last_metrics.remote()) or {})
        record.update(next((m for m in train_metrics or [] if m), {}))  # rank 0 reports for the group
        record.update(next((m for m in update_metrics or [] if m), {}))
        record.update(self.pending_eval)
        record["perf/step_time"] = now - self.last_time
        self.pending_eval, self.last_time = {}, now
        print(self._line(record), flush=True)
        if self.args.metrics_path:
            with open(self.args.metrics_path, "a") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")
        if self.args.use_wandb:
            from slime.utils import wandb_utils

            wandb_utils.log(self.args, record, "rollout/step")

    @staticmethod
    def _line(r):
        parts = [f"rollout {r['rollout_id']}"]
        for key, label in [("rollout/raw_reward", "reward"), ("rollout/response_length", "resp_len"),
                           ("train/pg_loss", "pg_loss"), ("train/grad_norm", "grad_norm"),
                           ("train/train_rollout_logprob_abs_diff", "logp_diff")]:
            if key in r:
                parts.append(f"{label} {r[key]:.4g}")
        parts += [f"{k} {v:.3f}" for k, v in r.items() if k.startswith("eval/") and not k.endswith("truncated_ratio")
                  and isinstance(v, (int, float))]
        parts.append(f"step {r['perf/step_time']:.1f}s")
        return " | ".join(parts)

    def finish(self):
        if self.args.use_wandb:
            from slime.utils import wandb_utils

            wandb_utils.finish()


def _jsonable(d):
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else float(v) if hasattr(v, "__float__") else str(v))
            for k, v in d.items()}
