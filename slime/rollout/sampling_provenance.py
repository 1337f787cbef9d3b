"""Trained samples are scored at what they were sampled with, or refused.

The trainer scores every trained token at the temperature it was sampled with (`rollout_temperatures` below, which
the log-prob forward divides each token's logits by; `--rollout-temperature` where the sample records nothing), over
the full vocabulary or, under `--rollout-top-p` < 1 / `--rollout-top-k` > 0, over the kept token set the engine
returned for it (top-p replay, slime/utils/top_p_replay.py). Penalties, `logit_bias`, grammars, `min_new_tokens` and
custom logit processors change the behaviour distribution in ways it cannot replay at all. A sample records what each
of its engine calls was sampled with (`sample.metadata["sampling_params"]`, slime/utils/sampling_record.py: the
default generate, the streaming generate and the agent adapters write it), and `check_sampling_params` -- called from
`convert_samples_to_train_data` -- refuses, in one line, a trained segment that truncated without kept sets for the
trainer to replay, or that used anything the trainer cannot replay. A sample with no record (a user's generate
function that records nothing) is trained at the flag's temperature, with one warning naming the function.
`--no-check-sampling-params` turns the check off (warned once).

Under `--lora-sync adapter` the adapter is part of what a token was sampled with: SGLang serves a `/generate` that
names no `lora_path` from the frozen base, and its response does not say which adapter served it. So a segment's
record carries the `lora_path` its request named (recorded from the request body), and a trained segment that named
another adapter, or none, or whose record has no `lora_path` -- or a trained sample with no record at all -- is
refused: nothing shows it was sampled from the policy being trained.
"""

import logging

import numpy as np

from slime.utils.lora_utils import ADAPTER_NAME, generate_fields
from slime.utils.sampling_record import ADAPTER_KEY, GREEDY_EPS, META_KEY, PROCESSOR_KEYS, response_temperatures

logger = logging.getLogger(__name__)

_warned: set = set()  # warn-once keys


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def _generate_function(args, sample):
    path = getattr(sample, "generate_function_path", None) or args.custom_generate_function_path
    return f"--custom-generate-function-path {path}" if path else "the default generate"


def _trained(mask, start, end):
    return mask is None or any(mask[start:end])


def _has_kept_sets(sample, start, end):
    """Whether every token of response[start:end] has a (non-empty) kept set for top-p replay."""
    offsets = sample.rollout_top_p_token_offsets
    if offsets is None or len(offsets) < end + 1:
        return False
    return all(int(offsets[k + 1]) > int(offsets[k]) for k in range(start, end))


# how a generate function names the policy's adapter and records it (the refusals' hint)
_ADAPTER_HINT = (
    "add slime.utils.lora_utils.generate_fields(args) to every /generate body and pass the body to "
    "slime.utils.sampling_record.record_segment(..., body=payload)"
)


def adapter_problem(args, rec) -> str | None:
    """Under `--lora-sync adapter`: what is wrong with the adapter a segment's record says it was sampled with."""
    if not generate_fields(args):
        return None
    if ADAPTER_KEY not in rec:
        return (
            f"no record of the adapter it was sampled with ({ADAPTER_KEY}), so nothing shows it was sampled from the "
            f"policy's adapter {ADAPTER_NAME!r} and not the frozen base under --lora-sync adapter ({_ADAPTER_HINT})"
        )
    if rec[ADAPTER_KEY] != ADAPTER_NAME:
        served = "the frozen base" if rec[ADAPTER_KEY] is None else f"adapter {rec[ADAPTER_KEY]!r}"
        return (
            f"{ADAPTER_KEY}={rec[ADAPTER_KEY]!r}: under --lora-sync adapter the engine sampled it from {served}, not "
            f"the policy's adapter {ADAPTER_NAME!r} ({_ADAPTER_HINT})"
        )
    return None


def segment_problem(args, sample, rec) -> str | None:
    """What in one segment's record `rec` the trainer cannot score (None when it scores it exactly)."""
    start, end = rec.get("response_span") or (0, sample.response_length)
    adapter = adapter_problem(args, rec)
    if adapter:
        return adapter
    # a temperature other than the flag's is replayed per token (rollout_temperatures); a greedy flag is refused
    # at start-up
    for key, default in (
        ("frequency_penalty", 0.0),
        ("presence_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("min_new_tokens", 0),
    ):
        v = rec.get(key, default)
        if v is not None and v != default:
            return f"{key}={v:g}, which the trainer cannot replay (it needs {key}={default:g})"
    for key in PROCESSOR_KEYS:
        if rec.get(key):
            return f"{key} set, which the trainer cannot replay"
    truncating = [
        f"{k}={rec[k]:g}"
        for k, off in (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0))
        if rec.get(k) is not None and rec[k] != off
    ]
    if truncating and not _has_kept_sets(sample, start, end):
        flags = f"--rollout-top-p {args.rollout_top_p:g} / --rollout-top-k {args.rollout_top_k}"
        return (
            f"{', '.join(truncating)} (a truncated distribution) but no kept token sets for those tokens, so the "
            f"trainer would score them over the full vocabulary ({flags}; the default generate asks the engine for "
            "the kept sets when these flags truncate)"
        )
    return None


def check_sampling_params(args, samples, fn_path=None) -> None:
    """Refuse the first trained sample whose recorded sampling parameters the trainer cannot score exactly."""
    if args.loss_type == "sft_loss":  # no importance ratio: the rollout's log-probs are not used
        return
    if args.no_check_sampling_params:
        _warn_once(
            "off",
            "--no-check-sampling-params: trained samples are not checked against --rollout-temperature / top-p "
            "replay; a sample sampled at other parameters (a client's temperature, a penalty) trains with biased "
            "importance ratios",
        )
        return
    for i, s in enumerate(samples):
        if s.remove_sample or not s.response_length:
            continue
        records = (s.metadata or {}).get(META_KEY) if isinstance(s.metadata, dict) else None
        uncovered = _uncovered(s, records or ())
        if uncovered is not None:
            _unrecorded(args, s, i, fn_path, uncovered, whole=not records)
        for rec in records or ():
            start, end = rec.get("response_span") or (0, s.response_length)
            if not _trained(s.loss_mask, start, end):
                continue
            problem = segment_problem(args, s, rec)
            if problem:
                raise ValueError(
                    f"sample {s.index} (position {i}) from rollout function {fn_path!r}: its response tokens "
                    f"{start}..{end} were sampled by {rec.get('source') or _generate_function(args, s)} (parameters "
                    f"from the {rec.get('origin') or 'record'}) with {problem}; the sample cannot be trained "
                    "without biased importance ratios (pass --no-check-sampling-params to train on it anyway)"
                )


def _uncovered(sample, records):
    """(start, end) of the trained response tokens no record covers (first to last), or None when all are."""
    trained = np.ones(sample.response_length, bool) if sample.loss_mask is None else np.asarray(sample.loss_mask) != 0
    for rec in records:
        start, end = rec.get("response_span") or (0, sample.response_length)
        trained[start:end] = False
    left = np.flatnonzero(trained)
    return None if not len(left) else (int(left[0]), int(left[-1]) + 1)


def _unrecorded(args, s, i, fn_path, span, whole):
    """Trained tokens with no record: refused under --lora-sync adapter, else trained at the flags (warned once)."""
    where = _generate_function(args, s)
    what = (
        "records no sampling parameters"
        if whole
        else f"records no sampling parameters for response tokens {span[0]}..{span[1]}"
    )
    what += f" (sample.metadata[{META_KEY!r}]; the tokens match no /generate that went through slime's router either)"
    if generate_fields(args):
        raise ValueError(
            f"sample {s.index} (position {i}) from {where} (rollout function {fn_path!r}) {what}, so nothing shows it "
            f"was sampled from the policy's adapter {ADAPTER_NAME!r} and not the frozen base under --lora-sync "
            f"adapter ({_ADAPTER_HINT}; pass --no-check-sampling-params to train on it anyway)"
        )
    _warn_once(
        ("unrecorded", where),
        f"sample {s.index} (position {i}) from {where} (rollout function {fn_path!r}) {what}: it is trained as if "
        f"sampled at --rollout-temperature {args.rollout_temperature:g} with no penalties (warned once per function)",
    )


def rollout_temperatures(args, samples):
    """The `rollout_temperatures` train-data entry: per sample, the temperature of each response token (float32), so
    the trainer scores every token at the temperature it was sampled with; None when all were sampled at
    `--rollout-temperature` (the forward then divides by the flag, as without records)."""
    if args.loss_type == "sft_loss" or args.rollout_temperature < GREEDY_EPS:
        return None
    per_sample = [response_temperatures(s, args.rollout_temperature) for s in samples]
    if all(t is None for t in per_sample):
        return None
    return [
        np.full(s.response_length, args.rollout_temperature, dtype=np.float32) if t is None else t
        for s, t in zip(samples, per_sample)
    ]
