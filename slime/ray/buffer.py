"""`RolloutController`: the Ray actor that runs the rollout function and turns its samples into train data.

It owns the data source (prompts, epochs, partial-rollout buffer), calls the rollout/eval functions loaded by
path, post-processes rewards (GRPO-style group normalisation), converts samples to arrays for the trainers and
returns a `Box(ray.put(train_data))`. Metrics of every call are logged and also returned to the driver.
"""

import functools
import importlib.util
import numbers
import os
import threading
import time

import numpy as np
import ray
import torch

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, call_rollout_fn
from slime.rollout.sample_hooks import set_current_rollout_id
from slime.utils.console import metrics_line
from slime.utils.misc import load_function
from slime.utils.ray_utils import Box
from slime.utils.types import Sample
from slime.utils.user_errors import call_user_function, user_function

_GROUP_NORM_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline", "rloo")
_STD_NORM_ESTIMATORS = ("grpo", "gspo", "cispo")


def _wandb_utils():
    # wandb_utils is optional: the controller works (and logs to stdout) without it.
    if importlib.util.find_spec("slime.utils.wandb_utils") is None:
        return None
    return importlib.import_module("slime.utils.wandb_utils")


def _flatten(data):
    """Samples of a list nested to any depth (groups, or fan-out groups of groups), in order."""
    out = []
    for item in data:
        if isinstance(item, list):
            out += _flatten(item)
        else:
            out.append(item)
    return out


def flatten_rollout_output(data, fn_path):
    """Validate the rollout function's return value and flatten it into one `list[Sample]`.

    `data` is a `RolloutFnTrainOutput` or (slime v0.1.0) the bare list; groups may nest further (fan-out)."""
    metrics = dict(getattr(data, "metrics", None) or {})
    if isinstance(data, RolloutFnTrainOutput):
        data = data.samples
    bad = None
    if not isinstance(data, list) or not data:
        bad = f"{type(data).__name__}" + ("" if not isinstance(data, list) else " (empty)")
    else:
        data = _flatten(data)
        if not data or not all(isinstance(s, Sample) for s in data):
            bad = (
                "a list of empty groups"
                if not data
                else f"a list containing {type(next(s for s in data if not isinstance(s, Sample))).__name__}"
            )
    if bad is not None:
        raise TypeError(
            f"rollout function {fn_path!r} returned {bad}; it must return list[list[Sample]] "
            f"(rollout_batch_size groups of n_samples_per_prompt) or a flat list[Sample]."
        )
    return data, metrics


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) or getattr(value, "ndim", None) == 0  # ints, floats, bools, 0-d arrays


def _reward_source(args, sample, fn_path):
    """The function that produced `sample`'s reward, as the user named it."""
    if args.custom_rm_path:
        return f"the reward function --custom-rm-path {args.custom_rm_path}"
    rm_type = (sample.metadata or {}).get("rm_type") if isinstance(sample.metadata, dict) else None
    if rm_type or args.rm_type:
        return f"the reward function of --rm-type {rm_type or args.rm_type}"
    return f"rollout function {fn_path!r}"


def post_process_rewards(args, samples, custom_fn=None, fn_path=None):
    """(raw_rewards, rewards): group-normalised rewards for grpo/gspo/reinforce_plus_plus_baseline/rloo."""
    if custom_fn is not None:
        return custom_fn(args, samples)

    raw_rewards = []
    for i, s in enumerate(samples):
        r = s.get_reward_value(args)
        if r is None:
            raise ValueError(
                f"sample {s.index} (position {i}) returned by rollout function {fn_path!r} has no reward; the rollout "
                f"function must set `sample.reward` (check --rm-type / --custom-rm-path, and --group-rm)."
            )
        if not _is_number(r):
            hint = " (a dict: pick the training reward with --reward-key)" if isinstance(r, dict) else ""
            raise TypeError(
                f"sample {s.index}: {_reward_source(args, s, fn_path)} returned a {type(r).__name__} "
                f"{r!r:.80}{hint}; a reward must be a number"
            )
        raw_rewards.append(r)

    if args.advantage_estimator in _GROUP_NORM_ESTIMATORS and args.rewards_normalization:
        n = args.n_samples_per_prompt
        if len(raw_rewards) % n != 0:
            raise ValueError(
                f"rollout function {fn_path!r} returned {len(raw_rewards)} samples, not a multiple of "
                f"--n-samples-per-prompt={n}; group reward normalisation needs whole groups."
            )
        rewards = torch.tensor(raw_rewards, dtype=torch.float).reshape(-1, n)
        rewards = rewards - rewards.mean(dim=-1, keepdim=True)
        # std of a group of one is undefined (nan); validation also turns it off for n == 1
        if args.advantage_estimator in _STD_NORM_ESTIMATORS and args.grpo_std_normalization and n > 1:
            rewards = rewards / (rewards.std(dim=-1, keepdim=True) + 1e-6)
        return raw_rewards, rewards.flatten().tolist()

    return raw_rewards, raw_rewards


def convert_samples_to_train_data(args, samples, custom_reward_fn=None, fn_path=None):
    """Samples -> dict of equal-length lists; big per-sample data as numpy arrays (one Ray object, no per-list pickling)."""
    raw_rewards, rewards = post_process_rewards(args, samples, custom_reward_fn, fn_path)
    if len(rewards) != len(samples):
        raise ValueError(
            f"--custom-reward-post-process-path returned {len(rewards)} rewards for {len(samples)} samples"
        )

    loss_masks = []
    for i, s in enumerate(samples):
        if s.response_length > len(s.tokens):
            raise ValueError(
                f"sample {s.index} (position {i}) from rollout function {fn_path!r}: response_length "
                f"{s.response_length} exceeds its {len(s.tokens)} tokens"
            )
        mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
        if len(mask) != s.response_length:
            raise ValueError(
                f"sample {s.index} (position {i}) from rollout function {fn_path!r}: loss_mask has {len(mask)} "
                f"entries but response_length is {s.response_length}; the mask must cover exactly the response tokens."
            )
        # remove_sample (set by --rollout-sample-filter-path): no loss, but still in the reward statistics above
        loss_masks.append(np.zeros(len(mask), dtype=np.int32) if s.remove_sample else np.asarray(mask, dtype=np.int32))

    train_data = {
        "tokens": [np.asarray(s.tokens, dtype=np.int64) for s in samples],
        "response_lengths": [int(s.response_length) for s in samples],
        "rewards": rewards,
        "raw_reward": raw_rewards,
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": loss_masks,
    }

    # Rewards rewritten by the rollout (e.g. an external buffer) keep the grader's raw value for logging.
    if "raw_reward" in samples[0].metadata:
        train_data["raw_reward"] = [s.metadata["raw_reward"] for s in samples]
    if "round_number" in samples[0].metadata:
        train_data["round_number"] = [s.metadata["round_number"] for s in samples]
    if samples[0].train_metadata is not None:
        train_data["metadata"] = [s.train_metadata for s in samples]

    if samples[0].rollout_log_probs is not None:
        log_probs = []
        for i, s in enumerate(samples):
            if s.rollout_log_probs is None or len(s.rollout_log_probs) != s.response_length:
                got = None if s.rollout_log_probs is None else len(s.rollout_log_probs)
                raise ValueError(
                    f"sample {s.index} (position {i}) from rollout function {fn_path!r}: rollout_log_probs has "
                    f"{got} entries but response_length is {s.response_length}"
                )
            log_probs.append(np.asarray(s.rollout_log_probs, dtype=np.float32))
        train_data["rollout_log_probs"] = log_probs
    return train_data


def _numeric_mean(values):
    try:
        return float(np.mean([float(v) for v in values]))
    except (TypeError, ValueError):
        return None  # dict rewards without --reward-key etc.: nothing meaningful to average


def subsample_debug_rollout_data(samples, ratio):
    """--load-debug-rollout-data-subsample RATIO: keep about RATIO of the replayed samples, half from the start and
    half from the end of the dump (current slime's rule); None keeps them all."""
    if ratio is None:
        return samples
    n = int(len(samples) * ratio)
    head = n // 2
    return samples[:head] + (samples[len(samples) - (n - head) :] if n - head > 0 else [])


def reward_category_metrics(key, samples):
    """--log-reward-category KEY: the fraction of samples in each category `sample.reward[KEY]` (e.g. the failure
    kinds a dict reward reports), as `error_cat/<category>`."""
    counts = {}
    for s in samples:
        if not isinstance(s.reward, dict) or key not in s.reward:
            raise ValueError(
                f"--log-reward-category {key}: sample {s.index} has reward {s.reward!r}, which has no {key!r} key "
                "(the reward function must return a dict holding it)"
            )
        counts[s.reward[key]] = counts.get(s.reward[key], 0) + 1
    return {f"error_cat/{category}": n / len(samples) for category, n in counts.items()}


def rollout_metrics(args, samples, train_data, rollout_time):
    """Metrics of one training rollout (rollout/* and perf/*)."""
    lengths = train_data["response_lengths"]
    metrics = {}
    raw = _numeric_mean(train_data["raw_reward"])
    if raw is not None:
        metrics["rollout/raw_reward"] = raw
    metrics["rollout/response_length"] = float(np.mean(lengths))
    metrics["rollout/response_length_max"] = int(max(lengths))
    metrics["rollout/truncated_ratio"] = float(np.mean(train_data["truncated"]))
    if args.log_reward_category:
        metrics.update(reward_category_metrics(args.log_reward_category, samples))
    versions = [s.weight_versions[-1] for s in samples if s.weight_versions]
    if versions:
        try:
            metrics["rollout/weight_version"] = max(int(v) for v in versions)
        except ValueError:
            metrics["rollout/weight_version"] = max(versions)
    if rollout_time is not None and rollout_time > 0:
        trained_tokens = sum(int(np.sum(m)) for m in train_data["loss_masks"])
        metrics["perf/rollout_time"] = rollout_time
        metrics["perf/tokens_per_gpu_per_sec"] = trained_tokens / rollout_time / max(1, args.rollout_num_gpus or 1)
        metrics["perf/longest_sample_tokens_per_sec"] = max(lengths) / rollout_time
    return metrics


def eval_metrics(data):
    metrics = {}
    for name, d in data.items():
        mean = _numeric_mean(d["rewards"])
        if mean is not None:
            metrics[f"eval/{name}"] = mean
        if d.get("truncated"):
            metrics[f"eval/{name}-truncated_ratio"] = float(np.mean([1.0 if t else 0.0 for t in d["truncated"]]))
    return metrics


# What the trainers need of a custom converter's train data (current slime's contract).
CONVERTED_KEYS = ("tokens", "response_lengths", "rewards", "raw_reward", "truncated", "sample_indices", "loss_masks")


def _load_optional(flag, path):
    return user_function(flag, path) if path else None


@ray.remote
class RolloutController:
    """Runs rollouts for the trainers; one per job, created by `RolloutManager` with num_gpus=0."""

    def __init__(self, args, wandb_run_id=None):
        self.args = args
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
        print(f"import {self.rollout_fn_path} as generate_rollout function.")
        print(f"import {self.eval_fn_path} as eval_generate_rollout function.")

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
        rollout_time = time.time() - start

        if args.save_debug_rollout_data:
            path = args.save_debug_rollout_data.format(rollout_id=rollout_id)
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save({"rollout_id": rollout_id, "samples": [s.to_dict() for s in data]}, path)

        train_data = self._convert_samples_to_train_data(data)
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

    def _convert_samples_to_train_data(self, samples):
        if self.custom_convert_samples_to_train_data_func is None:
            return convert_samples_to_train_data(
                self.args, samples, self.custom_reward_post_process_func, self.rollout_fn_path
            )
        # replaces the whole conversion, reward post-processing included
        train_data = self.custom_convert_samples_to_train_data_func(self.args, samples)
        missing = [k for k in CONVERTED_KEYS if not isinstance(train_data, dict) or k not in train_data]
        if missing:
            raise ValueError(
                f"--custom-convert-samples-to-train-data-path {self.args.custom_convert_samples_to_train_data_path} "
                f"returned no {', '.join(missing)}; it must return a dict with per-sample lists "
                f"{', '.join(CONVERTED_KEYS)}"
            )
        return train_data

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
        metrics = eval_metrics(data)
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

    def save(self, rollout_id):
        self.data_source.save(rollout_id)

    def load(self, rollout_id=None):
        self.data_source.load(rollout_id)

    def get_buffer_length(self):
        return self.data_source.get_buffer_length()
