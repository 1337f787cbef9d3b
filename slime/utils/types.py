"""Core rollout types: `Sample` (one prompt + response trajectory), `TrainData` (what a rollout hands the trainers)
and `ParamInfo` (weight-sync metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Optional, TypedDict, Union

import numpy as np

from slime.utils.routing_replay import decode_routed_experts
from slime.utils.sampling_record import META_KEY as SAMPLING_META_KEY
from slime.utils.sampling_record import record_segment
from slime.utils.top_p_replay import append_kept_sets
from slime.utils.weight_versions import append_spans, call_spans

APPEND_SOURCE = "Sample.append_response_tokens"  # a sampling-parameter record's source


@dataclass
class Sample:
    """One trajectory. `tokens` = prompt ids + response ids; `loss_mask` covers the response only."""

    # Field order and names follow current slime (user code may construct or read any of them).
    group_index: Optional[int] = None  # the prompt group's ordinal in data-source order (same for its n samples)
    index: Optional[int] = None
    rollout_id: Optional[int] = None  # one rollout execution; fan-out siblings share it (one loss denominator)
    prompt: Union[str, list[dict[str, str]]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: Optional[dict] = None  # raw media, e.g. {"images": [...]}
    multimodal_train_inputs: Optional[dict] = None  # processor outputs shipped to training (e.g. pixel_values)
    multimodal_train_input_id: Optional[str] = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Optional[Any] = None
    reward: Optional[Union[float, dict[str, Any]]] = None
    loss_mask: Optional[list[int]] = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: Optional[list[float]] = None
    rollout_top_p_token_ids: Optional[Any] = None
    rollout_top_p_token_offsets: Optional[Any] = None
    rollout_routed_experts: Optional[Any] = None
    remove_sample: bool = False  # True: trained with an all-zero loss mask (still counted in reward statistics)
    teacher_log_probs: Optional[list[float]] = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: Optional[str] = None  # per-sample --custom-generate-function-path
    custom_rm_path: Optional[str] = None  # per-sample --custom-rm-path
    train_metadata: Optional[dict] = None  # handed to the trainers as train data "metadata"
    session_id: Optional[str] = None
    non_generation_time: float = 0.0  # seconds a plugin spent outside the engine (tools, ...)

    @dataclass
    class SpecInfo:
        """Speculative-decoding counters summed over a sample's engine calls (current slime's names)."""

        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        @property
        def spec_accept_rate(self) -> float:
            return self.spec_accept_token_num / self.spec_draft_token_num if self.spec_draft_token_num else 0.0

        @property
        def spec_accept_length(self) -> float:
            return self.completion_token_num / self.spec_verify_ct if self.spec_verify_ct else 0.0

        def add(self, meta_info: dict) -> None:
            self.spec_accept_token_num += int(meta_info.get("spec_accept_token_num") or 0)
            self.spec_draft_token_num += int(meta_info.get("spec_draft_token_num") or 0)
            self.spec_verify_ct += int(meta_info.get("spec_verify_ct") or 0)
            self.completion_token_num += int(meta_info.get("completion_tokens") or 0)

        def to_dict(self) -> dict:
            return dict(self.__dict__)

        @staticmethod
        def from_dict(d: dict) -> "Sample.SpecInfo":
            return Sample.SpecInfo(**{k: v for k, v in (d or {}).items() if k in Sample.SpecInfo.__dataclass_fields__})

    @dataclass
    class PrefixCacheInfo:
        """Prompt tokens sent and found in the engine's prefix cache, summed over a sample's engine calls."""

        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        @property
        def prefix_cache_hit_rate(self) -> float:
            return self.cached_tokens / self.total_prompt_tokens if self.total_prompt_tokens else 0.0

        def add(self, meta_info: dict) -> None:
            self.cached_tokens += int(meta_info.get("cached_tokens") or 0)
            self.total_prompt_tokens += int(meta_info.get("prompt_tokens") or 0)

        def to_dict(self) -> dict:
            return dict(self.__dict__)

        @staticmethod
        def from_dict(d: dict) -> "Sample.PrefixCacheInfo":
            keys = Sample.PrefixCacheInfo.__dataclass_fields__
            return Sample.PrefixCacheInfo(**{k: v for k, v in (d or {}).items() if k in keys})

    spec_info: SpecInfo = field(default_factory=lambda: Sample.SpecInfo())
    prefix_cache_info: PrefixCacheInfo = field(default_factory=lambda: Sample.PrefixCacheInfo())
    # the weight version of each generated response token: spans {"version", "start", "end"} over the response
    # (end exclusive), from SGLang's per-token `meta_info.weight_versions` (else the call's `weight_version`);
    # tokens no span covers (tool output, a generate function that records none) have no version.
    # `weight_versions` keeps one label per generate call, as before.
    weight_version_spans: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["status"] = self.status.value
        d["spec_info"], d["prefix_cache_info"] = self.spec_info.to_dict(), self.prefix_cache_info.to_dict()
        return d

    @staticmethod
    def from_dict(d: dict) -> "Sample":
        d = dict(d)  # never mutate the caller's dict
        d["status"] = Sample.Status(d.get("status", "pending"))
        d["spec_info"] = Sample.SpecInfo.from_dict(d.get("spec_info"))
        d["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(d.get("prefix_cache_info"))
        known = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in d.items() if k in known})
        for k, v in d.items():  # forward compatibility: keep unknown keys as attributes
            if k not in known:
                setattr(sample, k, v)
        return sample

    def get_reward_value(self, args) -> Any:
        key = args.reward_key
        if not key:
            return self.reward
        if not isinstance(self.reward, dict) or key not in self.reward:
            raise KeyError(
                f"--reward-key {key!r}: sample {self.index} has reward {self.reward!r}, which has no such key"
            )
        return self.reward[key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(
        self,
        args=None,
        *,
        tokens=None,
        log_probs=None,
        trainable=True,
        meta_info=None,
        text=None,
        update_terminal_info=True,
        sampling_params=None,
    ):
        """Append response tokens and keep `loss_mask` and `rollout_log_probs` aligned (current slime's helper for
        multi-turn generate functions). Model tokens pass `log_probs` (and SGLang's `meta_info`, which sets the
        status unless `update_terminal_info=False`); tool/environment tokens pass `trainable=False` and get loss-mask
        zeros and log-prob zeros. With --use-rollout-routing-replay, `meta_info["routed_experts"]` (the engine's
        routing of the whole sequence it was sent plus these tokens) becomes `rollout_routed_experts`. Trainable
        tokens get a sampling record (`metadata["sampling_params"]`, which the trainer scores them at): the engine's
        echo in `meta_info` when it has one (slime's CPU server), else `sampling_params`, the request's, when given."""
        tokens = [int(t) for t in (tokens if tokens is not None else [])]
        log_probs = None if log_probs is None else [float(x) for x in log_probs]
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens need their rollout log-probs (log_probs=)")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens take no rollout log-probs")
            log_probs = [0.0] * len(tokens)
        kept_sets = (meta_info or {}).get("output_token_sampling_mask") if trainable else None
        if kept_sets is not None and len(kept_sets) != len(tokens):
            raise ValueError(f"meta_info has {len(kept_sets)} sampling masks for {len(tokens)} tokens")
        if tokens and (kept_sets is not None or self.rollout_top_p_token_offsets is not None):
            # top-p replay: the engine's kept set per sampled token; tool tokens get empty spans (full vocabulary)
            append_kept_sets(self, kept_sets if kept_sets is not None else [[]] * len(tokens))
        if text is not None:
            self.response += text
        previous = self.response_length
        if (
            tokens
            and trainable
            and ((meta_info or {}).get(SAMPLING_META_KEY) is not None or sampling_params is not None)
        ):
            record_segment(
                self, meta_info, sampling_params, start=previous, end=previous + len(tokens), source=APPEND_SOURCE
            )
        if tokens:
            self.tokens = _extended(self.tokens, tokens)
            self.response_length += len(tokens)
            mask = self.loss_mask if self.loss_mask is not None else [1] * previous
            self.loss_mask = _extended(mask, [1 if trainable else 0] * len(tokens))
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and previous:
                    raise ValueError(
                        "cannot append trainable log-probs to a sample whose earlier response tokens "
                        "have no rollout_log_probs"
                    )
                self.rollout_log_probs = [0.0] * previous
            self.rollout_log_probs = _extended(self.rollout_log_probs, log_probs)
        if meta_info and "routed_experts" in meta_info and args is not None and args.use_rollout_routing_replay:
            # SGLang routes the whole sequence sent (earlier turns and tool tokens included): the latest answer wins
            self.rollout_routed_experts = decode_routed_experts(
                meta_info, len(self.tokens), args.num_layers, args.moe_router_topk, f"sample {self.index}"
            )
        if meta_info and update_terminal_info:
            self.apply_finish_reason(meta_info, args, num_new_tokens=len(tokens) if trainable else 0)
        elif meta_info and tokens and trainable:
            self.record_weight_version_spans(meta_info, len(tokens))

    _FINISH_TO_STATUS = {"length": "TRUNCATED", "abort": "ABORTED", "stop": "COMPLETED"}

    def apply_finish_reason(self, meta_info: dict, args=None, num_new_tokens=None) -> None:
        """Map SGLang's `meta_info.finish_reason.type` (stop|length|abort) onto `status`, record the weight version
        (and the per-token version spans of the call's output, the last `num_new_tokens` response tokens: by default
        as many as the engine reports) and add the call's prefix-cache (and, with speculative decoding, its draft)
        counters."""
        reason = (meta_info.get("finish_reason") or {}).get("type")
        if reason in self._FINISH_TO_STATUS:
            self.status = Sample.Status[self._FINISH_TO_STATUS[reason]]
        if meta_info.get("weight_version") is not None:
            self.weight_versions.append(str(meta_info["weight_version"]))
        self.record_weight_version_spans(meta_info, num_new_tokens)
        if args is not None and args.sglang_speculative_algorithm:
            self.spec_info.add(meta_info)
        self.prefix_cache_info.add(meta_info)

    def record_weight_version_spans(self, meta_info: dict, num_new_tokens=None) -> None:
        """Place one generate call's version spans (SGLang's `meta_info.weight_versions`, else its `weight_version`)
        on its output: the last `num_new_tokens` (default: the engine's count) tokens of the response. Nothing is
        recorded when they cannot be placed (the response holds fewer tokens than the call returned)."""
        if num_new_tokens == 0:
            return
        spans = call_spans(meta_info, num_new_tokens)
        n = spans[-1]["end"] if num_new_tokens is None and spans else num_new_tokens
        if not spans or n is None or n > self.response_length:
            return
        if self.weight_version_spans is None:
            self.weight_version_spans = []
        append_spans(self.weight_version_spans, spans, self.response_length - n)


def _extended(current, new: list) -> list:
    """`current` with `new` appended, in place when it is a list: generate functions written for current slime keep
    a reference to `sample.loss_mask` (or `tokens`) across `append_response_tokens` calls and assign it back."""
    if isinstance(current, list):
        current.extend(new)
        return current
    return list(current) + new


@dataclass(frozen=True)
class ParamInfo:
    name: str
    dtype: Any
    shape: tuple
    attrs: dict
    size: int
    src_rank: int


# ---------------------------------------------------------------------------------------------- train data
# The rollout -> trainer contract, declared once: what `RolloutController.generate` puts in the object store (built
# by `slime.rollout.train_data.convert_samples_to_train_data`, or a --custom-convert-samples-to-train-data-path
# function) and what every trainer rank reads (`slime.backends.megatron_utils.rollout_data`). One entry per sample in
# every list, in the same order.


class _RequiredTrainData(TypedDict):
    tokens: list[np.ndarray]  # int64 prompt + response ids
    response_lengths: list[int]
    rewards: list[float]  # what the advantages use (group-normalised for GRPO-style estimators)
    raw_reward: list  # the grader's value, for logging
    truncated: list[int]  # 1 if the response hit --rollout-max-response-len
    sample_indices: list[int]  # `Sample.index`: global, increasing; each is trained once
    loss_masks: list[np.ndarray]  # int32 over the response tokens; all zero for a removed sample


class TrainData(_RequiredTrainData, total=False):
    rollout_log_probs: list[np.ndarray]  # float32 over the response tokens, as the engine sampled them
    teacher_log_probs: list[np.ndarray]  # float32 over the response tokens, from the OPD teacher (--use-opd)
    round_number: list[int]  # from `Sample.metadata["round_number"]` (multi-turn rollouts)
    metadata: list  # `Sample.train_metadata`, for --rollout-data-postprocess-path and custom losses
    rollout_top_p_token_ids: list[np.ndarray]  # int32: each step's kept token set, concatenated (top-p/top-k replay)
    rollout_top_p_token_offsets: list[np.ndarray]  # int32: where each step's set starts in the ids (one more entry)
    rollout_routed_experts: list[np.ndarray]  # int32 [tokens - 1, layers, top-k]: the engine's experts (R3)
    # float32 over the response tokens: the temperature each was sampled at (present when any differs from the flag)
    rollout_temperatures: list[np.ndarray]
    # fan-out: the rollout each sample belongs to (siblings of one generate call share it; default: one per sample).
    # The trainer keeps a rollout's samples in one optimizer step and weighs the rollout once in the loss.
    rollout_ids: list[int]
    # vision-language samples: the processor's outputs (pixel_values, image_grid_thw, ...), None for text-only ones
    multimodal_train_inputs: list


TRAIN_DATA_KEYS = tuple(_RequiredTrainData.__annotations__)  # every converter must return these
OPTIONAL_TRAIN_DATA_KEYS = tuple(k for k in TrainData.__annotations__ if k not in TRAIN_DATA_KEYS)

RolloutBatch = dict[str, list]
