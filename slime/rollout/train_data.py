"""Samples -> train data, the pure half of a rollout (no Ray): validate the rollout function's output, post-process
rewards (GRPO-style group normalisation), convert samples to the `TrainData` contract (slime.utils.types) the trainers
read, and the rollout's / eval's metrics. `RolloutController` (slime/ray/buffer.py) calls these; the names stay
importable from `slime.ray.buffer` as before."""

import numbers
import zlib

import numpy as np
import torch

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.provenance import check_weight_versions
from slime.rollout.sampling_provenance import check_sampling_params, rollout_temperatures
from slime.utils.routing_replay import routed_experts_error
from slime.utils.sampling_record import TEMPERATURES_KEY
from slime.utils.top_p_replay import kept_sets_error, sampling_is_truncated
from slime.utils.types import TRAIN_DATA_KEYS, Sample, TrainData

_GROUP_NORM_ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline", "rloo")
_STD_NORM_ESTIMATORS = ("grpo", "gspo", "cispo")


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
        std = args.advantage_estimator in _STD_NORM_ESTIMATORS and args.grpo_std_normalization
        if is_fan_out(samples):
            return raw_rewards, _normalize_by_prompt(samples, raw_rewards, std, fn_path)
        n = args.n_samples_per_prompt
        if len(raw_rewards) % n != 0:
            raise ValueError(
                f"rollout function {fn_path!r} returned {len(raw_rewards)} samples, not a multiple of "
                f"--n-samples-per-prompt={n}; group reward normalisation needs whole groups."
            )
        rewards = torch.tensor(raw_rewards, dtype=torch.float).reshape(-1, n)
        rewards = rewards - rewards.mean(dim=-1, keepdim=True)
        # std of a group of one is undefined (nan); validation also turns it off for n == 1
        if std and n > 1:
            rewards = rewards / (rewards.std(dim=-1, keepdim=True) + 1e-6)
        return raw_rewards, rewards.flatten().tolist()

    return raw_rewards, raw_rewards


def is_fan_out(samples):
    """True when a generate call returned several samples of one rollout (siblings share `Sample.rollout_id`)."""
    ids = [s.rollout_id for s in samples if s.rollout_id is not None]
    return len(set(ids)) < len(ids)


def _normalize_by_prompt(samples, raw_rewards, std, fn_path):
    """Fan-out rollouts give each prompt a varying number of samples: centre (and scale) every sample's reward over
    all samples of its prompt, siblings included, i.e. the samples sharing `Sample.group_index`."""
    groups = {}
    for i, s in enumerate(samples):
        if s.group_index is None:
            raise ValueError(
                f"sample {s.index} (position {i}) from rollout function {fn_path!r} has no group_index; group reward "
                "normalisation of fan-out rollouts groups the samples by their prompt's Sample.group_index"
            )
        groups.setdefault(s.group_index, []).append(i)
    rewards = torch.tensor(raw_rewards, dtype=torch.float)
    out = rewards.clone()
    for members in groups.values():
        r = rewards[members]
        centred = r - r.mean()
        if std and len(members) > 1:
            centred = centred / (r.std() + 1e-6)
        out[members] = centred
    return out.tolist()


def rollout_ids(samples):
    """Each sample's rollout: its `Sample.rollout_id`, or where unset a fresh negative id of its own (user ids are
    sample indices, never negative)."""
    return [s.rollout_id if s.rollout_id is not None else -1 - i for i, s in enumerate(samples)]


def kept_sets_train_data(args, samples, fn_path) -> dict:
    """Top-p replay: the trainer scores each token over the set the engine kept. Under truncating flags every sample
    must carry its sets (never silently scored over all tokens); otherwise the samples whose own requests truncated
    brought theirs (e.g. a generate function that asked for `return_sampling_mask`), and the others get empty spans,
    scored over the full vocabulary as they were sampled."""
    flags = sampling_is_truncated(args)
    ids, offsets = [], []
    for i, s in enumerate(samples):
        if flags or s.rollout_top_p_token_offsets is not None:
            problem = kept_sets_error(s)
            if problem:
                raise ValueError(
                    f"sample {s.index} (position {i}) from rollout function {fn_path!r} {problem}; "
                    + (
                        f"with --rollout-top-p {args.rollout_top_p} / --rollout-top-k {args.rollout_top_k} the trainer "
                        "replays each step's kept token set (the default generate asks the engine for it)"
                        if flags
                        else "the trainer replays the kept token sets a sample carries"
                    )
                )
            ids.append(np.asarray(s.rollout_top_p_token_ids, dtype=np.int32))
            offsets.append(np.asarray(s.rollout_top_p_token_offsets, dtype=np.int32))
        else:
            ids.append(np.zeros(0, dtype=np.int32))
            offsets.append(np.zeros(s.response_length + 1, dtype=np.int32))
    return {"rollout_top_p_token_ids": ids, "rollout_top_p_token_offsets": offsets}


def convert_samples_to_train_data(
    args, samples, custom_reward_fn=None, fn_path=None, pushed_versions=None
) -> TrainData:
    """Samples -> `TrainData` (equal-length lists); big per-sample data as numpy arrays (one Ray object, no per-list
    pickling). With `pushed_versions` (the controller's `PushedVersions`) every trainable token's weight version is
    checked first (`slime.rollout.provenance`)."""
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
    check_sampling_params(args, samples, fn_path)  # scored at what they were sampled with, or refused
    check_weight_versions(args, samples, loss_masks, pushed_versions, fn_path)

    train_data: TrainData = {
        "tokens": [np.asarray(s.tokens, dtype=np.int64) for s in samples],
        "response_lengths": [int(s.response_length) for s in samples],
        "rewards": rewards,
        "raw_reward": raw_rewards,
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "loss_masks": loss_masks,
    }
    if is_fan_out(samples):
        train_data["rollout_ids"] = rollout_ids(samples)
    if any(s.multimodal_train_inputs for s in samples):  # contiguous CPU tensors: one Ray object, any device later
        train_data["multimodal_train_inputs"] = [_cpu_tensors(s.multimodal_train_inputs) for s in samples]

    # Rewards rewritten by the rollout (e.g. an external buffer) keep the grader's raw value for logging; a batch of
    # mixed sources may carry it on some samples only (as current slime: the others keep their own)
    if any("raw_reward" in (s.metadata or {}) for s in samples):
        train_data["raw_reward"] = [(s.metadata or {}).get("raw_reward", r) for s, r in zip(samples, raw_rewards)]
    if "round_number" in samples[0].metadata:
        train_data["round_number"] = [s.metadata["round_number"] for s in samples]
    if samples[0].train_metadata is not None:
        train_data["metadata"] = [s.train_metadata for s in samples]

    for field in ("rollout_log_probs", "teacher_log_probs"):
        if getattr(samples[0], field) is not None:
            train_data[field] = _per_response_token(samples, field, fn_path)
    temperatures = rollout_temperatures(args, samples)
    if temperatures is not None:
        train_data[TEMPERATURES_KEY] = temperatures
    if args.loss_type != "sft_loss" and (
        sampling_is_truncated(args) or any(s.rollout_top_p_token_offsets is not None for s in samples)
    ):
        train_data.update(kept_sets_train_data(args, samples, fn_path))
    if args.use_rollout_routing_replay and args.loss_type != "sft_loss":
        # R3: the trainer routes every token to the engine's experts (never silently to its own)
        for i, s in enumerate(samples):
            problem = routed_experts_error(s, args.num_layers, args.moe_router_topk)
            if problem:
                raise ValueError(
                    f"sample {s.index} (position {i}) from rollout function {fn_path!r} {problem}; with "
                    "--use-rollout-routing-replay the trainer replays the engine's routing (the default generate "
                    "asks the engine for it: SGLang's return_routed_experts)"
                )
        train_data["rollout_routed_experts"] = [np.asarray(s.rollout_routed_experts, dtype=np.int32) for s in samples]
    return train_data


def _cpu_tensors(inputs):
    if not inputs:
        return None
    return {k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in inputs.items()}


def _numeric_mean(values):
    try:
        return float(np.mean([float(v) for v in values]))
    except (TypeError, ValueError):
        return None  # dict rewards without --reward-key etc.: nothing meaningful to average


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


def pass_at_k(groups):
    """`--log-passrate` (current slime's `compute_pass_rate`): {"pass@k": mean over groups of the unbiased estimate
    1 - C(n-c, k) / C(n, k)}, for k = 1, 2, 4, ... up to the group size n, where c of a group's n rewards equal 1.
    Groups of one sample give nothing."""
    n = len(groups[0]) if groups else 0
    if n <= 1 or any(len(g) != n for g in groups):
        return {}
    correct = [sum(1 for r in g if r == 1) for g in groups]
    out = {}
    for k in (2**i for i in range(int(np.log2(n)) + 1)):
        estimates = [
            1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1))) for c in correct
        ]
        out[f"pass@{k}"] = float(np.mean(estimates))
    return out


def _reward_groups(samples, rewards, group_size):
    """Rewards per prompt group: by `Sample.group_index` where every sample has one, else consecutive runs of
    `group_size` (the default rollout's order)."""
    if samples and all(s.group_index is not None for s in samples):
        groups = {}
        for s, r in zip(samples, rewards):
            groups.setdefault(s.group_index, []).append(r)
        return list(groups.values())
    if group_size <= 0 or len(rewards) % group_size:
        return []
    return [list(rewards[i : i + group_size]) for i in range(0, len(rewards), group_size)]


def multi_turn_metrics(args, train_data):
    """`--log-multi-turn` (current slime's names): response lengths with and without the tool/observation tokens
    (the loss mask's zeros), the fraction that reached --rollout-max-response-len, and the turns per sample."""
    raw = np.asarray(train_data["response_lengths"], dtype=np.float64)
    trained = np.asarray([float(np.sum(m)) for m in train_data["loss_masks"]])
    out = {
        "multi_turn/raw_response_length/response_length_mean": float(raw.mean()),
        "multi_turn/raw_response_length/response_length_max": float(raw.max()),
        "multi_turn/raw_response_length/response_length_min": float(raw.min()),
        "multi_turn/raw_response_length/response_length_clip_ratio": float(
            np.mean(raw >= args.rollout_max_response_len)
        ),
        "multi_turn/wo_obs_response_length/response_length_mean": float(trained.mean()),
        "multi_turn/wo_obs_response_length/response_length_max": float(trained.max()),
        "multi_turn/wo_obs_response_length/response_length_min": float(trained.min()),
    }
    if "round_number" in train_data:
        rounds = np.asarray(train_data["round_number"], dtype=np.float64)
        out["multi_turn/multi_turn_metric/round_number_mean"] = float(rounds.mean())
        out["multi_turn/multi_turn_metric/round_number_max"] = float(rounds.max())
        out["multi_turn/multi_turn_metric/round_number_min"] = float(rounds.min())
    return out


def sample_metrics(args, samples, prefix) -> dict:
    """Current slime's metrics of a rollout's or an eval dataset's samples (`compute_metrics_from_samples`), under
    `prefix`: trained response lengths, zero-std groups by reward (not for PPO), prefix-cache hits, repetition and
    truncation."""
    if not samples:
        return {}
    lengths = np.array([s.effective_response_length for s in samples])
    out = {
        "response_len/mean": float(lengths.mean()),
        "response_len/median": float(np.median(lengths)),
        "response_len/max": float(lengths.max()),
        "response_len/min": float(lengths.min()),
    }
    if args.advantage_estimator != "ppo":  # groups of one prompt's responses
        groups = {}
        for s in samples:
            groups.setdefault(s.group_index, []).append(s.get_reward_value(args))
        for rewards in groups.values():
            if all(r == rewards[0] for r in rewards) and _is_number(rewards[0]):
                key = f"zero_std/count_{round(rewards[0], 1)}"
                out[key] = out.get(key, 0) + 1
    cached = sum(s.prefix_cache_info.cached_tokens for s in samples)
    prompt = sum(s.prefix_cache_info.total_prompt_tokens for s in samples)
    out["prefix_cache_hit_rate"] = cached / prompt if prompt else 0.0
    out["avg_cached_tokens_per_sample"] = cached / len(samples)
    out["repetition_frac"] = float(np.mean([_repeats(s.response or "") for s in samples]))
    out["truncated_ratio"] = float(np.mean([s.status == Sample.Status.TRUNCATED for s in samples]))
    return {prefix + k: v for k, v in out.items()}


def _repeats(text) -> bool:
    """Current slime's `has_repetition`: the last 10,000 characters of a long response compress over 10x."""
    if len(text) <= 10000:
        return False
    raw = text[-10000:].encode()
    return len(raw) / len(zlib.compress(raw, 9)) > 10


def rollout_metrics(args, samples, train_data, rollout_time):
    """Metrics of one training rollout (rollout/* and perf/*)."""
    lengths = train_data["response_lengths"]
    metrics = sample_metrics(args, samples, "rollout/")
    raw = _numeric_mean(train_data["raw_reward"])
    if raw is not None:
        metrics["rollout/raw_reward"] = raw
    metrics["rollout/response_length"] = float(np.mean(lengths))
    metrics["rollout/response_length_max"] = int(max(lengths))
    metrics["rollout/truncated_ratio"] = float(np.mean(train_data["truncated"]))
    if args.log_reward_category:
        categories = reward_category_metrics(args.log_reward_category, samples)
        metrics.update({f"rollout/{k}": v for k, v in categories.items()})  # current slime's rollout/error_cat/*
    if args.log_passrate and raw is not None:
        groups = _reward_groups(samples, train_data["raw_reward"], args.n_samples_per_prompt)
        metrics.update({f"passrate/{k}": v for k, v in pass_at_k(groups).items()})
    if args.log_multi_turn and lengths:
        metrics.update(multi_turn_metrics(args, train_data))
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


def eval_metrics(data, args=None):
    metrics = {}
    for name, d in data.items():
        mean = _numeric_mean(d["rewards"])
        if mean is not None:
            metrics[f"eval/{name}"] = mean
            if args is not None and args.log_passrate:
                samples = d.get("samples") or []
                n = _eval_samples_per_prompt(args, name)
                groups = _reward_groups(samples if len(samples) == len(d["rewards"]) else [], d["rewards"], n)
                metrics.update({f"eval/{name}-{k}": v for k, v in pass_at_k(groups).items()})
        if d.get("truncated"):
            metrics[f"eval/{name}-truncated_ratio"] = float(np.mean([1.0 if t else 0.0 for t in d["truncated"]]))
        if args is not None and d.get("samples"):
            metrics.update(sample_metrics(args, d["samples"], f"eval/{name}/"))
    return metrics


def _eval_samples_per_prompt(args, name):
    """Responses per prompt of eval dataset `name`: its own n_samples_per_eval_prompt, else the flag's."""
    for cfg in args.eval_datasets or []:
        if cfg.name == name and cfg.n_samples_per_eval_prompt:
            return cfg.n_samples_per_eval_prompt
    return args.n_samples_per_eval_prompt or 1


# What the trainers need of a custom converter's train data (current slime's contract; declared in slime.utils.types).
CONVERTED_KEYS = TRAIN_DATA_KEYS


def check_train_data(train_data, source):
    """A converter's output (`source` names it) has every key of the contract; else a one-line error."""
    missing = [k for k in TRAIN_DATA_KEYS if not isinstance(train_data, dict) or k not in train_data]
    if missing:
        raise ValueError(
            f"{source} returned no {', '.join(missing)}; it must return a dict with per-sample lists "
            f"{', '.join(TRAIN_DATA_KEYS)} (see slime.utils.types.TrainData)"
        )
    return train_data


def _per_response_token(samples, field, fn_path):
    """`field` of every sample as float32 arrays, each checked to hold one value per response token."""
    out = []
    for i, s in enumerate(samples):
        values = getattr(s, field)
        if values is None or len(values) != s.response_length:
            raise ValueError(
                f"sample {s.index} (position {i}) from rollout function {fn_path!r}: {field} has "
                f"{None if values is None else len(values)} entries but response_length is {s.response_length}"
            )
        out.append(np.asarray(values, dtype=np.float32))
    return out
