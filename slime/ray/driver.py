"""The driver's side of a run: cleanup of what it started (however the run ends), the watchdog that names a dead
trainer or engine instead of hanging, and the per-rollout recorder (console line + metrics JSONL)."""

import contextlib
import json
import os
import signal
import threading
import time

import ray

from slime.observability.wandb_utils import get_step, log
from slime.utils.console import metrics_line
from slime.utils.user_errors import UserCodeError

_cleanups: list = []


def register_cleanup(fn):
    """Run `fn` when the enclosing `cleanup_on_exit()` block ends (engines, router, actors, placement groups)."""
    _cleanups.append(fn)
    return fn


@contextlib.contextmanager
def cleanup_on_exit():
    """Release what the run registered, in reverse order, however it ends (return, exception, Ctrl-C, SIGTERM)."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if in_main else None

    owner = os.getpid()

    def _on_sigterm(signum, frame):
        if os.getpid() != owner:  # a forked child (e.g. the router process) inherited this handler: default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        raise KeyboardInterrupt(f"received signal {signum}")

    if in_main:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        while _cleanups:
            _run_cleanup(_cleanups.pop())


CLEANUP_STEP_TIMEOUT_S = 60.0


def _run_cleanup(fn):
    """One cleanup step, bounded: a Ray call can block forever once the cluster is half gone (e.g. removing a
    placement group after its raylet died), and the run must still end."""
    name = getattr(fn, "__qualname__", fn)
    errors = []

    def run():
        try:
            fn()
        except Exception as e:  # keep releasing the rest; a dead actor has nothing left to stop
            errors.append(e)

    thread = threading.Thread(target=run, name=f"cleanup-{name}", daemon=True)
    thread.start()
    thread.join(CLEANUP_STEP_TIMEOUT_S)
    if thread.is_alive():
        print(
            f"cleanup {name} did not finish within {CLEANUP_STEP_TIMEOUT_S:g}s (is Ray still up?); skipped", flush=True
        )
    elif errors:
        print(f"cleanup {name} failed: {errors[0]}", flush=True)


class Watchdog:
    """`ray.get` for the driver loop that fails fast, naming the culprit, when a trainer, an engine or the router the
    wait depends on dies or hangs — instead of waiting on HTTP retries to a dead server or a collective that will never
    complete. With --use-fault-tolerance a dead engine is handed to the rollout manager instead (it is replaced)."""

    def __init__(self, rollout_manager, actor_model=None, poll_s: float = 1.0, engine_check_s: float = 5.0):
        self.rollout_manager, self.actor_model = rollout_manager, actor_model
        self.poll_s, self.engine_check_s = poll_s, engine_check_s

    def _names(self):
        names = {}
        for i, a in enumerate(self.actor_model.actors if self.actor_model else []):
            names[a._actor_id.hex()] = f"trainer rank {i}"
        names.update(self.rollout_manager.actor_names())
        return names

    def _died(self, err):
        actor_id = getattr(err, "actor_id", None)
        who = self._names().get(actor_id, f"actor {actor_id}")
        return RuntimeError(f"{who} died: {err}")

    def _check_engines(self):
        self.rollout_manager.check_engines_alive()

    def get(self, refs):
        single = not isinstance(refs, list)
        pending = [refs] if single else list(refs)
        try:
            last_engine_check = time.monotonic()
            while True:
                _, not_ready = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
                if not not_ready:
                    break
                self.rollout_manager.raise_if_failed()  # a hung engine or a dead router, seen by the health monitor
                if time.monotonic() - last_engine_check >= self.engine_check_s:
                    self._check_engines()
                    last_engine_check = time.monotonic()
            values = ray.get(pending)
        except ray.exceptions.RayActorError as e:
            raise self._died(e) from e
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, UserCodeError):  # the user's own traceback, not Ray's wrapping of it
                raise e.cause from None
            raise
        return values[0] if single else values


class RunRecorder:
    """Per-rollout metrics on the driver: one compact console line and a JSONL record (`--metrics-path`)."""

    def __init__(self, args, rollout_manager):
        self.args, self.rollout_manager = args, rollout_manager
        self.last_time = time.time()
        self.pending_eval = {}
        self._events_seen = 0
        if args.metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_path)), exist_ok=True)

    def eval(self, rollout_id, eval_metrics):
        self.pending_eval.update(eval_metrics or {})

    def rollout_done(self, rollout_id, train_metrics, update_metrics=None):
        now = time.time()
        record = {"rollout_id": rollout_id}
        record.update(self.rollout_manager.pop_metrics(rollout_id))
        record.update(_flatten(_group_report(train_metrics)))
        record.update(_flatten(next((m for m in update_metrics or [] if m), {})))
        record.update(self.pending_eval)
        record.update(self._fault_metrics())
        record["perf/step_time"] = now - self.last_time
        self.pending_eval, self.last_time = {}, now
        self._track(rollout_id, record)
        print(self._line(record), flush=True)
        if self.args.metrics_path:
            with open(self.args.metrics_path, "a") as f:
                f.write(json.dumps(_jsonable(record)) + "\n")

    def _track(self, rollout_id, record):
        """What only the driver measures (the step's wall time, the weight push, fault counts) to W&B and
        TensorBoard on the rollout axis; the controller and the trainers log the rest themselves."""
        if not (self.args.use_wandb or self.args.use_tensorboard):
            return
        own = {
            k: v
            for k, v in record.items()
            if k.startswith(("perf/step_time", "perf/update_weights", "update_weights/", "fault/"))
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
        }
        log(self.args, own, "rollout/step", step=get_step(self.args, "rollout", rollout_id))

    def _fault_metrics(self):
        """Counts of engine/router faults so far and what was done (`fault/*`), plus this rollout's new events."""
        events = self.rollout_manager.fault_events
        if not events:
            return {}
        counts = {}
        for e in events:
            counts[f"fault/{e['kind']}"] = counts.get(f"fault/{e['kind']}", 0) + 1
        new, self._events_seen = events[self._events_seen :], len(events)
        return {**counts, "fault/events": [dict(e) for e in new]}

    @staticmethod
    def _line(r):
        """The headline metrics of a rollout record, in the console format (`slime.utils.console`)."""
        shown = {
            label: r[key]
            for key, label in [
                ("rollout/raw_reward", "reward"),
                ("rollout/response_length", "resp_len"),
                ("train/pg_loss", "pg_loss"),
                ("train/grad_norm", "grad_norm"),
                ("train/train_rollout_logprob_abs_diff", "logp_diff"),
            ]
            if key in r
        }
        shown.update((k, v) for k, v in r.items() if k.startswith("eval/") and not k.endswith("truncated_ratio"))
        shown["step_time_s"] = r["perf/step_time"]
        return metrics_line(f"rollout {r['rollout_id']}", shown, short_names=False)

    def finish(self):
        if self.args.use_wandb:  # the controller and trainers log to wandb themselves; close the driver's run
            import wandb  # heavy: only with --use-wandb

            if wandb.run is not None:
                wandb.finish()


def _group_report(results):
    """A trainer group's per-rank results as one report: each section (rollout, train, perf, critic) from the first
    rank that has it. The optimizer steps' metrics exist on the last pipeline stage only, not on rank 0 under PP."""
    report = {}
    for result in results or []:
        for section, value in (result or {}).items():
            if value and section not in report:
                report[section] = value
    return report


def _flatten(metrics):
    """Nested metric dicts -> one flat dict; for a list of per-step dicts (several optimizer steps) each metric's
    latest value (a metric some steps do not report keeps that of the last step that did)."""
    flat = {}
    for k, v in (metrics or {}).items():
        if isinstance(v, dict):
            flat.update(_flatten(v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for step in v:
                flat.update(_flatten(step))
        else:
            flat[k] = v
    return flat


def _jsonable(d):
    def one(v):
        if isinstance(v, (int, float, str, bool, type(None))):
            return v
        if isinstance(v, (list, tuple)):
            return [one(x) for x in v]
        if isinstance(v, dict):
            return {str(k): one(x) for k, x in v.items()}
        return float(v) if hasattr(v, "__float__") else str(v)

    return {k: one(v) for k, v in d.items()}
