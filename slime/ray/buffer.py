"""`RolloutController`: the Ray actor that runs the rollout function and turns its samples into train data.

It owns the data source (prompts, epochs, partial-rollout buffer), calls the rollout/eval functions loaded by
path, converts the samples with `slime.rollout.train_data` (reward post-processing, the `TrainData` contract) and
returns a `Box(ray.put(train_data))`. Metrics of every call are logged and also returned to the driver.
"""

import functools
import importlib.util
import os
import threading
import time

import ray
import torch

from slime.rollout.base_types import RolloutFnEvalOutput, call_rollout_fn
from slime.rollout.provenance import PushedVersions, record_provenance
from slime.rollout.recording_proxy import start_recording_proxy
from slime.rollout.sample_hooks import set_current_rollout_id

# the conversion's public names, importable from here as in earlier versions
from slime.rollout.train_data import (  # noqa: F401
    CONVERTED_KEYS,
    check_train_data,
    convert_samples_to_train_data,
    eval_metrics,
    flatten_rollout_output,
    post_process_rewards,
    rollout_metrics,
)
from slime.utils.console import metrics_line
from slime.utils.misc import freeze_startup_objects, load_function
from slime.utils.ray_utils import Box
from slime.utils.types import Sample
from slime.utils.user_errors import call_user_function, user_function


def _wandb_utils():
    # wandb_utils is optional: the controller works (and logs to stdout) without it.
    if importlib.util.find_spec("slime.observability.wandb_utils") is None:
        return None
    return importlib.import_module("slime.observability.wandb_utils")


def _load_optional(flag, path):
    return user_function(flag, path) if path else None


def subsample_debug_rollout_data(samples, ratio):
    """--load-debug-rollout-data-subsample RATIO: keep about RATIO of the replayed samples, half from the start and
    half from the end of the dump (current slime's rule); None keeps them all."""
    if ratio is None:
        return samples
    n = int(len(samples) * ratio)
    head = n // 2
    return samples[:head] + (samples[len(samples) - (n - head) :] if n - head > 0 else [])


@ray.remote
class RolloutController:
    """Runs rollouts for the trainers; one per job, created by `RolloutManager` with num_gpus=0."""

    def __init__(self, args, wandb_run_id=None):
        self.args = args
        # before any user code reads the router's address: what each request through it samples with is recorded
        self.proxy, self.ledger = start_recording_proxy(args)
        # Log to wandb only when this actor joined the driver's run; TensorBoard needs no run to join.
        self.wandb = None
        wandb_utils = _wandb_utils() if args.use_wandb or args.use_tensorboard else None
        if wandb_utils is not None and (
            wandb_utils.init_wandb_secondary(args, wandb_run_id) is not None or args.use_tensorboard
        ):
            self.wandb = wandb_utils

        self.data_source = load_function(args.data_source_path)(args)
        self.rollout_fn_path = args.rollout_function_path
        self.eval_fn_path = args.eval_function_path or args.rollout_function_path
        self.generate_rollout = load_function(self.rollout_fn_path)
        self.eval_generate_rollout = load_function(self.eval_fn_path)
        self.custom_reward_post_process_func = _load_optional(
            "--custom-reward-post-process-path", args.custom_reward_post_process_path
        )
        self.custom_convert_samples_to_train_data_func = _load_optional(
            "--custom-convert-samples-to-train-data-path", args.custom_convert_samples_to_train_data_path
        )
        self._metrics = {}  # rollout_id -> metrics; train_async generates N+1 before the driver records N
        self._eval_thread, self._eval_results = None, []  # background eval (fully async)
        self.pushed_versions = PushedVersions()  # what the weight-version gate checks trained tokens against
        print(f"import {self.rollout_fn_path} as generate_rollout function.")
        print(f"import {self.eval_fn_path} as eval_generate_rollout function.")
        # the rollout's allocations trigger collections that otherwise rescan every module and the dataset: a fifth
        # of this actor's CPU in the main job
        freeze_startup_objects()

    def get_num_rollout_per_epoch(self):
        if not self.args.rollout_global_dataset:
            raise ValueError(
                "the number of rollouts per epoch needs the global dataset: set --num-rollout, or drop "
                "--disable-rollout-global-dataset"
            )
        return len(self.data_source) // self.args.rollout_batch_size

    def generate(self, rollout_id):
        args = self.args
        start = time.time()
        set_current_rollout_id(rollout_id)
        if args.load_debug_rollout_data:
            path = args.load_debug_rollout_data.format(rollout_id=rollout_id)
            if not os.path.exists(path):
                raise FileNotFoundError(f"--load-debug-rollout-data: {path} does not exist (rollout {rollout_id})")
            data = [Sample.from_dict(d) for d in torch.load(path, weights_only=False)["samples"]]
            data = subsample_debug_rollout_data(data, args.load_debug_rollout_data_subsample)
            extra = {}
        else:
            user_fn = functools.partial(
                call_user_function,
                f"raised by --rollout-function-path {self.rollout_fn_path} in rollout {rollout_id}",
                self.generate_rollout,
            )
            output = call_rollout_fn(user_fn, args, rollout_id, self.data_source, evaluation=False)
            data, extra = flatten_rollout_output(output, self.rollout_fn_path)
            if self.ledger is not None:  # what samples that record nothing were sampled with, seen at the router
                self.ledger.attach(data)
        rollout_time = time.time() - start

        if args.save_debug_rollout_data:
            record_provenance(data)  # metadata["provenance"]: the weight versions that generated each sample
            path = args.save_debug_rollout_data.format(rollout_id=rollout_id)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in data]}, path)

        # replayed dumps were generated by another run's pushes: their versions are not this run's to check
        train_data = self._convert_samples_to_train_data(data, check_versions=not args.load_debug_rollout_data)
        # Replayed debug data has no meaningful generation time.
        loaded = bool(args.load_debug_rollout_data)
        metrics = rollout_metrics(args, data, train_data, None if loaded else rollout_time)
        metrics.update(extra)
        custom_log = _load_optional("--custom-rollout-log-function-path", args.custom_rollout_log_function_path)
        # a truthy return means the custom function logged this rollout itself
        if not (custom_log and custom_log(rollout_id, args, data, extra or None, rollout_time)):
            self._log("rollout", rollout_id, metrics)
        self._metrics[rollout_id] = metrics
        return Box(ray.put(train_data))

    def _convert_samples_to_train_data(self, samples, check_versions=True):
        if self.custom_convert_samples_to_train_data_func is None:
            return convert_samples_to_train_data(
                self.args,
                samples,
                self.custom_reward_post_process_func,
                self.rollout_fn_path,
                pushed_versions=self.pushed_versions if check_versions else None,
            )
        # replaces the whole conversion, reward post-processing included
        flag = f"--custom-convert-samples-to-train-data-path {self.args.custom_convert_samples_to_train_data_path}"
        return check_train_data(self.custom_convert_samples_to_train_data_func(self.args, samples), flag)

    def pop_metrics(self, rollout_id):
        """Metrics of `generate(rollout_id)`, handed over once (the driver prints and records them)."""
        return self._metrics.pop(rollout_id, {})

    def eval(self, rollout_id):
        if self.args.debug_train_only:
            return {}
        set_current_rollout_id(rollout_id)
        user_fn = functools.partial(
            call_user_function,
            f"raised by --eval-function-path {self.eval_fn_path} at rollout {rollout_id}",
            self.eval_generate_rollout,
        )
        output = call_rollout_fn(user_fn, self.args, rollout_id, self.data_source, evaluation=True)
        data = output.data if isinstance(output, RolloutFnEvalOutput) else output
        if not isinstance(data, dict) or not all(isinstance(d, dict) and "rewards" in d for d in data.values()):
            raise TypeError(
                f"eval function {self.eval_fn_path!r} returned {type(data).__name__}; it must return "
                f'RolloutFnEvalOutput or {{dataset_name: {{"rewards": [...], "truncated": [...]}}}}'
            )
        metrics = eval_metrics(data, self.args)
        metrics.update(output.metrics or {})
        custom_log = _load_optional(
            "--custom-eval-rollout-log-function-path", self.args.custom_eval_rollout_log_function_path
        )
        if not (custom_log and custom_log(rollout_id, self.args, data, output.metrics)):
            self._log("eval", rollout_id, metrics)
        return metrics

    def set_weight_version(self, version):
        """The driver reports the weight version the engines serve after each push (saved with the data source)."""
        self.data_source.weight_version = version
        self.pushed_versions.push(version)

    def start_eval(self, rollout_id, weight_version):
        """Evaluate in the background while training goes on; the driver pins `weight_version` on the engines (it
        pushes no weights) until `collect_evals` says the eval is done."""
        if self._eval_thread is not None:
            raise RuntimeError(f"eval of rollout {rollout_id} started while another eval is still running")

        def work():
            try:
                result = {"metrics": self.eval(rollout_id)}
            except Exception as e:  # reported to the driver by collect_evals
                result = {"error": f"{type(e).__name__}: {e}"}
            self._eval_results.append({"rollout_id": rollout_id, "weight_version": weight_version, **result})

        self._eval_thread = threading.Thread(target=work, name=f"eval-{rollout_id}", daemon=True)
        self._eval_thread.start()

    def collect_evals(self, wait=False):
        """(an eval is still running, finished evals as {rollout_id, weight_version, metrics}); `wait` joins it."""
        results = []
        if self._eval_thread is not None and (wait or not self._eval_thread.is_alive()):
            self._eval_thread.join()  # the thread appends its result last: read only after it ended
            self._eval_thread = None
            results, self._eval_results = self._eval_results, []
        for r in results:
            if "error" in r:
                raise RuntimeError(f"background eval of rollout {r['rollout_id']} failed: {r['error']}")
        return self._eval_thread is not None, results

    def _log(self, kind, rollout_id, metrics):
        print(metrics_line(f"{kind} {rollout_id}", metrics, short_names=False), flush=True)
        if self.wandb is not None:
            step = self.wandb.get_step(self.args, kind, rollout_id)
            self.wandb.log(self.args, metrics, f"{kind}/step", step=step)

    def finish_tracking(self):
        """This actor's side of the W&B run, closed before the driver finishes the run and kills the actor."""
        if self.wandb is not None:
            self.wandb.finish_secondary(self.args)

    def save(self, rollout_id):
        self.data_source.save(rollout_id)

    def load(self, rollout_id=None):
        self.data_source.load(rollout_id)
        # a resumed run: the versions its checkpoint's run pushed (up to the last) may still be in its queue/buffer
        self.pushed_versions.resume(getattr(self.data_source, "weight_version", None))

    def get_buffer_length(self):
        return self.data_source.get_buffer_length()
