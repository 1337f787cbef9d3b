"""A session's turns as a tree, and its conversion into loss-masked training samples.

Every turn an adapter serves is one engine call: the prompt token ids it sent and the token ids / log-probs the
engine sampled. A turn's parent is the earlier turn whose whole sequence (prompt + sampled output) is a prefix of
this turn's prompt, i.e. the turn this one continues. A prompt that extends no earlier turn (the first turn, a
sub-agent with its own system prompt, a compacted history, or a history the chat template re-rendered differently
from what was sampled) starts a new root. Each leaf of the tree is one branch and becomes one `Sample`: its tokens
are the leaf's prompt + output, the sampled spans of the turns on its path are trained (loss mask 1, the engine's
log-probs) and everything else -- templates, tool results, user text -- is context (loss mask 0). A turn shared by
several branches is trained in the first branch only, so every sampled response is trained exactly once. The sampled
ids are used as they came from the engine; text is never re-tokenised. Turns that carry the engine's kept token
sets (top-p replay) put them at their place in every branch through them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from slime.utils.sampling_record import META_KEY as SAMPLING_KEY
from slime.utils.top_p_replay import append_kept_sets
from slime.utils.types import Sample
from slime.utils.weight_versions import append_spans

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """One engine call: what was sent and what was sampled."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    message: dict | None = None  # the parsed assistant message returned to the client
    ill_formed: bool = False  # the output looked like a tool call but did not parse
    weight_version: str | None = None
    # the weight version of each output token: SGLang's per-token spans (slime.utils.weight_versions.call_spans)
    weight_version_spans: tuple = ()
    # what the output was sampled with (slime.utils.sampling_record.segment_record; its response_span is set when
    # the turn becomes part of a sample)
    sampling_params: dict | None = None
    # the token ids the engine kept at each sampling step (SGLang's output_token_sampling_mask), one tuple per output
    # token, for top-p / top-k replay (slime.utils.top_p_replay); None when the turn did not ask for them
    kept_sets: tuple | None = None

    def __post_init__(self):
        if len(self.output_log_probs) != len(self.output_ids):
            raise ValueError(
                f"a turn needs one log-prob per sampled token: {len(self.output_ids)} tokens, "
                f"{len(self.output_log_probs)} log-probs"
            )
        if self.kept_sets is not None and len(self.kept_sets) != len(self.output_ids):
            raise ValueError(
                f"a turn needs one kept set per sampled token: {len(self.output_ids)} tokens, "
                f"{len(self.kept_sets)} kept sets"
            )

    @property
    def full_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class TurnNode:
    def __init__(self, record: TurnRecord, index: int, parent: TurnNode | None):
        self.record = record
        self.index = index  # order of arrival within the session
        self.parent = parent
        self.children: list[TurnNode] = []

    def path(self) -> list[TurnNode]:
        node, out = self, []
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


class TrajectoryTree:
    """The turns of one session."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.nodes: list[TurnNode] = []

    def add_turn(self, record: TurnRecord) -> TurnNode:
        """Attach a turn under the longest earlier turn its prompt extends, or as a new root."""
        parent = None
        for node in self.nodes:
            full = node.record.full_ids
            if len(full) <= len(record.prompt_ids) and record.prompt_ids[: len(full)] == full:
                if parent is None or len(full) > len(parent.record.full_ids):
                    parent = node
        node = TurnNode(record, len(self.nodes), parent)
        if parent is not None:
            parent.children.append(node)
        elif self.nodes:
            logger.debug("session %s: turn %d extends no earlier turn; new branch", self.session_id, node.index)
        self.nodes.append(node)
        return node

    @property
    def num_turns(self) -> int:
        return len(self.nodes)

    def leaves(self) -> list[TurnNode]:
        return [n for n in self.nodes if not n.children]

    def to_samples(
        self,
        base_sample: Sample,
        *,
        reward: Any = None,
        extra_metadata: dict | None = None,
        tokenizer=None,
    ) -> list[Sample]:
        """One Sample per branch, in the order the branches' last turns arrived; all share one rollout_id."""
        rollout_id = base_sample.rollout_id if base_sample.rollout_id is not None else base_sample.index
        trained: set[int] = set()
        samples = []
        leaves = self.leaves()
        for branch, leaf in enumerate(leaves):
            path = leaf.path()
            tokens = leaf.record.full_ids
            prompt_len = len(path[0].record.prompt_ids)
            loss_mask = [0] * (len(tokens) - prompt_len)
            log_probs = [0.0] * (len(tokens) - prompt_len)
            sampled_with = []  # one record per trained turn
            version_spans = []  # the trained turns' per-token weight versions, placed in the response
            for node in path:
                if node.index in trained:
                    continue
                trained.add(node.index)
                start = len(node.record.prompt_ids) - prompt_len
                for k, lp in enumerate(node.record.output_log_probs):
                    loss_mask[start + k] = 1
                    log_probs[start + k] = lp
                append_spans(version_spans, [dict(x) for x in node.record.weight_version_spans], start)
                if node.record.sampling_params is not None and node.record.output_ids:
                    span = [start, start + len(node.record.output_ids)]
                    sampled_with.append({**node.record.sampling_params, "response_span": span})
            if not any(loss_mask):  # nothing sampled on this branch (an empty output): nothing to train
                logger.debug(
                    "session %s: branch ending at turn %d sampled no token; skipped", self.session_id, leaf.index
                )
                continue
            last = leaf.record
            status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED}.get(
                last.finish_reason, Sample.Status.COMPLETED
            )
            messages = [n.record.message for n in path if n.record.message]
            sample = dataclasses.replace(
                base_sample,
                rollout_id=rollout_id,
                tokens=list(tokens),
                response_length=len(tokens) - prompt_len,
                loss_mask=loss_mask,
                rollout_log_probs=log_probs,
                reward=reward if reward is not None else base_sample.reward,
                status=status,
                session_id=self.session_id,
                weight_versions=[n.record.weight_version for n in path if n.record.weight_version],
                weight_version_spans=version_spans,
                metadata={
                    **base_sample.metadata,
                    **(extra_metadata or {}),
                    "agent": {
                        "session_id": self.session_id,
                        "branch": branch,
                        "num_branches": len(leaves),
                        "turns": [n.index for n in path],
                        "num_tool_calls": sum(len(m.get("tool_calls") or []) for m in messages),
                        "ill_formed": any(n.record.ill_formed for n in path),
                    },
                },
            )
            sample.metadata.pop(SAMPLING_KEY, None)  # never the base sample's record
            set_kept_sets(sample, path, prompt_len)
            if sampled_with:
                sample.metadata[SAMPLING_KEY] = sampled_with
            if tokenizer is not None:
                sample.response = tokenizer.decode(tokens[prompt_len:], skip_special_tokens=False)
            samples.append(sample)
        return samples


def set_kept_sets(sample: Sample, path: list[TurnNode], prompt_len: int) -> None:
    """The branch's kept sets for top-p replay: every turn on its path that carries them -- a turn shared with an
    earlier branch too, as its tokens were sampled from those sets here as well -- and empty spans for the tokens the
    engine did not sample (later turns' prompts). None, as without replay, when no turn on the path carries any."""
    sample.rollout_top_p_token_ids = sample.rollout_top_p_token_offsets = None
    if all(node.record.kept_sets is None for node in path):
        return
    per_token = [()] * sample.response_length
    for node in path:
        if node.record.kept_sets is not None:
            start = len(node.record.prompt_ids) - prompt_len
            per_token[start : start + len(node.record.kept_sets)] = node.record.kept_sets
    sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets = [], [0]
    append_kept_sets(sample, per_token)
