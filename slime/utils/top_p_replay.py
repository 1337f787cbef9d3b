"""Top-p / top-k replay: the token set the engine kept at each sampling step, so that the trainer scores a sampled
token over exactly the distribution it was drawn from.

When `--rollout-top-p` < 1 or `--rollout-top-k` > 0 the engine samples from a truncated, renormalised
distribution; a trainer that scores the token over the full vocabulary disagrees with the engine by the log of the
kept probability mass. The engine returns each step's kept set (SGLang's `return_sampling_mask`, served the same
way by slime's CPU server) and the rollout stores them on the Sample in current slime's ragged format:
`rollout_top_p_token_ids` (all kept ids, step after step) and `rollout_top_p_token_offsets` (response_length + 1
entries; step i kept `ids[offsets[i]:offsets[i + 1]]`). An empty span (a tool or environment token the engine did not
sample) is scored over the full vocabulary. SGLang returns kept sets only for a finite top-k up to
--sglang-sampling-mask-max-tokens, so top-p alone runs with that cap as its top-k (slime/config/rollout.py).
"""

# the train-data keys carrying the kept sets (per sample: int32 ids, int32 offsets)
TOP_P_KEYS = ("rollout_top_p_token_ids", "rollout_top_p_token_offsets")


def sampling_is_truncated(args) -> bool:
    """Whether training rollouts sample from a truncated distribution (and so need their kept sets replayed)."""
    return args.rollout_top_p < 1.0 or args.rollout_top_k > 0


# SGLang's --sampling-mask-max-tokens default: the largest kept set it returns
SGLANG_SAMPLING_MASK_MAX_TOKENS = 4096


def truncates(applied: dict) -> bool:
    """Whether normalised sampling parameters (`sampling_record.applied_sampling_params`) sample from a truncated
    distribution, whose kept sets the trainer must replay."""
    return applied["top_p"] < 1.0 or applied["top_k"] > 0 or applied["min_p"] > 0.0


def append_kept_sets(sample, kept_sets) -> None:
    """Append one kept set per new response token (`[]` for a token the engine did not sample) to `sample`'s ragged
    `rollout_top_p_token_ids` / `rollout_top_p_token_offsets`. Call before `response_length` grows by these tokens;
    response tokens from before the first call get empty spans."""
    if sample.rollout_top_p_token_offsets is None:
        sample.rollout_top_p_token_ids = []
        sample.rollout_top_p_token_offsets = [0] * (sample.response_length + 1)
    ids, offsets = list(sample.rollout_top_p_token_ids), list(sample.rollout_top_p_token_offsets)
    for kept in kept_sets:
        ids += [int(t) for t in kept]
        offsets.append(len(ids))
    sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets = ids, offsets


def kept_sets_error(sample) -> str | None:
    """What is wrong with `sample`'s kept sets (None when they are consistent with its response)."""
    ids, offsets = sample.rollout_top_p_token_ids, sample.rollout_top_p_token_offsets
    if ids is None or offsets is None:
        return "has no rollout_top_p_token_ids / rollout_top_p_token_offsets"
    offsets = [int(o) for o in offsets]
    if len(offsets) != sample.response_length + 1:
        return f"has {len(offsets)} rollout_top_p_token_offsets for {sample.response_length} response tokens (+1)"
    if offsets[0] != 0 or offsets[-1] != len(ids) or any(b < a for a, b in zip(offsets, offsets[1:])):
        return f"has rollout_top_p_token_offsets that do not partition its {len(ids)} kept token ids"
    response = sample.tokens[len(sample.tokens) - sample.response_length :]
    for i, tok in enumerate(response):
        kept = ids[offsets[i] : offsets[i + 1]]
        if kept and int(tok) not in {int(t) for t in kept}:
            return f"response token {i} ({tok}) is not in the token set kept at that step"
    return None
