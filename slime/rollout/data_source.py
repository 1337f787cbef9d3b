"""Prompt source for rollouts: dataset epochs and offsets, global sample indices, and the partial-rollout buffer.

`get_samples(n)` hands out `n` groups of `n_samples_per_prompt` deep copies of the next prompts; `save`/`load`
persist the position (and, beyond slime, the buffered groups) so a resumed run continues where it stopped.
`--data-source-path` replaces the default `RolloutDataSourceWithBuffer` with any `DataSource` subclass, built as
`cls(args)`. (slime v0.1.0 imported these classes from `slime.ray.rollout_data_source`, which still works.)
"""

import abc
import copy
import os
import threading

import torch

from slime.utils.checkpoint_tracker import replace_durably
from slime.utils.data import Dataset
from slime.utils.misc import load_function
from slime.utils.processing_utils import multimodal_dataset_kwargs
from slime.utils.types import Sample


class DataSource(abc.ABC):
    """What the rollout manager and rollout functions use of a data source (`--data-source-path`)."""

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        """`num_samples` groups of `n_samples_per_prompt` samples each."""

    @abc.abstractmethod
    def add_samples(self, samples: list[list[Sample]]):
        """Take back groups (aborted or partial ones) to hand out again."""

    @abc.abstractmethod
    def save(self, rollout_id):
        """Persist the position after rollout `rollout_id` (called at checkpoint saves)."""

    @abc.abstractmethod
    def load(self, rollout_id=None):
        """Restore the position saved after rollout `rollout_id`."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Prompts per epoch (0 when there is no dataset)."""


class RolloutDataSource(DataSource):
    def __init__(self, args):
        self.args = args
        self.epoch_id = 0
        self.sample_index = 0  # global, increasing index of every handed-out sample
        self.sample_group_index = 0  # global index of every handed-out prompt group
        self.sample_offset = 0  # position in the (shuffled) dataset of the current epoch
        self.metadata = {}
        # The weight version the engines serve (set by the driver after each push), saved with the position.
        self.weight_version = None
        # A rollout function that keeps work between calls (the fully async worker) registers a state_dict()
        # callable here, so its queue is saved and restored with the data source; `lock` makes the two consistent.
        self.rollout_states = {}
        self.loaded_rollout_states = {}
        self.lock = threading.RLock()

        if args.rollout_global_dataset and args.prompt_data is not None:
            from transformers import AutoTokenizer  # heavy

            tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
            if args.dump_details:
                tokenizer.save_pretrained(os.path.join(args.dump_details, "tokenizer"))
            self.dataset = Dataset(
                args.prompt_data,
                tokenizer=tokenizer,
                max_length=args.rollout_max_prompt_len,
                prompt_key=args.input_key,
                label_key=args.label_key,
                metadata_key=args.metadata_key,
                tool_key=args.tool_key,
                apply_chat_template=args.apply_chat_template,
                apply_chat_template_kwargs=args.apply_chat_template_kwargs,
                seed=args.rollout_seed,
                **multimodal_dataset_kwargs(args),
            )
            if len(self.dataset) == 0:
                raise ValueError(
                    f"--prompt-data {args.prompt_data!r} has no usable prompts (empty file, or every prompt is longer "
                    f"than --rollout-max-prompt-len {args.rollout_max_prompt_len}); nothing to roll out."
                )
            if args.rollout_shuffle:
                self.dataset.shuffle(self.epoch_id)
        else:
            self.dataset = None

    def __len__(self):
        return len(self.dataset) if self.dataset is not None else 0

    def get_samples(self, num_samples):
        """`num_samples` groups, each `n_samples_per_prompt` independent copies of one prompt."""
        if self.dataset is not None:
            prompt_samples = self._take_prompts(num_samples)
        else:
            prompt_samples = [Sample() for _ in range(num_samples)]

        groups = []
        for prompt_sample in prompt_samples:
            group = []
            for _ in range(self.args.n_samples_per_prompt):
                sample = copy.deepcopy(prompt_sample)
                sample.index = self.sample_index
                sample.group_index = self.sample_group_index
                self.sample_index += 1
                group.append(sample)
            self.sample_group_index += 1
            groups.append(group)
        return groups

    def _take_prompts(self, num_samples):
        # On overrun: take the tail, start the next epoch (reshuffled), continue from the head.
        taken = []
        while num_samples > 0:
            end = min(self.sample_offset + num_samples, len(self.dataset))
            chunk = self.dataset.samples[self.sample_offset : end]
            taken += chunk
            num_samples -= len(chunk)
            self.sample_offset = end
            if self.sample_offset == len(self.dataset) and num_samples > 0:
                self.epoch_id += 1
                if self.args.rollout_shuffle:
                    self.dataset.shuffle(self.epoch_id)
                self.sample_offset = 0
        return taken

    def add_samples(self, samples):
        raise RuntimeError(f"{type(self).__name__} is read-only: use RolloutDataSourceWithBuffer to return samples.")

    def update_metadata(self, metadata: dict):
        self.metadata.update(metadata)

    def get_metadata(self):
        return self.metadata

    # ---------------------------------------------------------------- checkpointing

    @staticmethod
    def state_path(save_dir, rollout_id):
        return os.path.join(save_dir, "rollout", f"global_dataset_state_dict_{rollout_id}.pt")

    def _state_dict(self):
        return {
            "sample_offset": self.sample_offset,
            "epoch_id": self.epoch_id,
            "sample_index": self.sample_index,
            "sample_group_index": self.sample_group_index,
            "metadata": self.metadata,
            "weight_version": self.weight_version,
            "rollout_states": {name: state_dict() for name, state_dict in self.rollout_states.items()},
        }

    def _load_state_dict(self, state):
        self.sample_offset = state.get("sample_offset", 0)
        self.epoch_id = state.get("epoch_id", 0)
        self.sample_index = state.get("sample_index", 0)
        self.sample_group_index = state.get("sample_group_index", 0)
        self.metadata = state.get("metadata", {})
        self.weight_version = state.get("weight_version")
        self.loaded_rollout_states = state.get("rollout_states", {})

    def save(self, rollout_id):
        if not self.args.rollout_global_dataset:
            return
        if not self.args.save:
            raise ValueError("RolloutDataSource.save needs --save (the directory checkpoints are written to).")
        path = self.state_path(self.args.save, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # Write then rename, so a crash mid-save never leaves a truncated state file behind.
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            with self.lock:
                state = self._state_dict()
            torch.save(state, tmp)
            replace_durably(tmp, path)  # on disk before the driver publishes the checkpoint's tracker
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load(self, rollout_id=None):
        if not self.args.rollout_global_dataset or self.args.load is None:
            return
        path = self.state_path(self.args.load, rollout_id)
        if not os.path.exists(path):
            if rollout_id is not None and rollout_id >= 0:  # the trainers resume after rollout_id: so must the data
                raise FileNotFoundError(
                    f"--load {self.args.load}: checkpoint {rollout_id} has no rollout data-source state ({path}), so "
                    "the run cannot continue its data order; it is incomplete (saved by an older version?). Resume "
                    "from another iteration with --ckpt-step, or train from it as a new run with --finetune"
                )
            print(f"rollout data source: no state at {path}, starting from the beginning of the dataset")
            return
        print(f"rollout data source: loading state from {path}")
        try:
            state = torch.load(path, weights_only=False)
        except Exception as e:
            raise RuntimeError(f"cannot read rollout data-source state {path}: {type(e).__name__}: {e}") from e
        with self.lock:
            self._load_state_dict(state)
        if self.dataset is not None and self.args.rollout_shuffle:
            self.dataset.shuffle(self.epoch_id)


def pop_first(args, rollout_id, buffer: list[list[Sample]], num_samples: int) -> list[list[Sample]]:
    """Default buffer filter: remove and return the oldest `num_samples` groups (FIFO)."""
    num_to_pop = min(len(buffer), num_samples)
    samples = buffer[:num_to_pop]
    del buffer[:num_to_pop]
    return samples


class RolloutDataSourceWithBuffer(RolloutDataSource):
    """Data source that first serves groups returned by earlier rollouts (e.g. partial rollouts), then fresh prompts."""

    def __init__(self, args):
        super().__init__(args)
        self.buffer: list[list[Sample]] = []
        path = args.buffer_filter_path
        self.buffer_filter = load_function(path) if path else pop_first

    def get_samples(self, num_samples: int) -> list[list[Sample]]:
        samples = self._get_samples_from_buffer(num_samples)
        num_samples -= len(samples)
        if num_samples > 0:
            samples += super().get_samples(num_samples)
        return samples

    def _get_samples_from_buffer(self, num_samples):
        if not self.buffer or num_samples == 0:
            return []
        samples = self.buffer_filter(self.args, None, self.buffer, num_samples)
        if not isinstance(samples, list) or len(samples) > num_samples:
            raise ValueError(
                f"--buffer-filter-path {self.args.buffer_filter_path!r} must return a list of at most "
                f"{num_samples} groups (and remove them from the buffer), got {type(samples).__name__} of "
                f"{len(samples) if isinstance(samples, list) else '?'} items"
            )
        return samples

    def add_samples(self, samples: list[list[Sample]]):
        if not samples:
            return
        n = self.args.n_samples_per_prompt
        if not isinstance(samples, list) or not all(isinstance(g, list) for g in samples):
            raise TypeError(
                f"add_samples expects a list of groups (list[list[Sample]]), got {type(samples).__name__} of "
                f"{type(samples[0]).__name__ if isinstance(samples, list) else '?'}"
            )
        for i, group in enumerate(samples):
            if len(group) != n:
                raise ValueError(
                    f"add_samples: group {i} has {len(group)} samples, but every group must hold "
                    f"--n-samples-per-prompt={n} samples"
                )
            if not all(isinstance(s, Sample) for s in group):
                raise TypeError(f"add_samples: group {i} contains something that is not a Sample")
        self.buffer.extend(samples)

    def get_buffer_length(self):
        return len(self.buffer)

    def _state_dict(self):
        state = super()._state_dict()
        state["buffer"] = [[s.to_dict() for s in group] for group in self.buffer]
        return state

    def _load_state_dict(self, state):
        super()._load_state_dict(state)
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state.get("buffer", [])]
