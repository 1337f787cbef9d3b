"""Which weights generated each trainable token: the gate `convert_samples_to_train_data` runs before a rollout is
trained, and the provenance record of `--save-debug-rollout-data` dumps.

Every engine slime starts is labelled `INITIAL_WEIGHT_VERSION` ("0", the --hf-checkpoint weights) and every push
labels the engines with the trainer's next integer version. Each sample records the version of each response token
(`Sample.weight_version_spans`, from SGLang's per-token `meta_info.weight_versions`) and of each generate call
(`Sample.weight_versions`). Before training, every trainable token's version must be one the trainer pushed and one
the mode allows:

- synchronous (train.py): the version the engines serve now;
- one-step off-policy (train_async.py): that version or the push before it;
- fully async: within --max-staleness versions of it;
- --partial-rollout without --mask-offpolicy-in-partial-rollout: any pushed version (resumed samples keep tokens of
  earlier weights, by design, as upstream slime).

A label slime never sets (SGLang's "default": an engine slime did not label), a version never pushed or one outside
the window stops the run in one line naming the sample and the version. A sample that records no version at all (a
custom generate function that reads no `meta_info`, as upstream examples) is trained, with one warning naming the
generate function. `--no-check-weight-versions` turns the gate off (one warning). Under `--debug-train-only` no
engine runs, so nothing was sampled from this run's weights and there is nothing to check (an SFT run's transcripts).

What this proves: the engines' *labels*, as slime set them, per token. Not the weights themselves (a label is an
assertion of whoever set it), nor the prompt's KV computed before a change.
"""

import logging

import numpy as np

from slime.utils.weight_versions import INITIAL_WEIGHT_VERSION

logger = logging.getLogger(__name__)

FULLY_ASYNC = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"
_warned: set = set()


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


class PushedVersions:
    """The rollout side's record of the pushes: the labels the driver reported after each push, in order (the
    controller keeps it; `RolloutManager.set_weight_version` feeds it). A resumed run also accepts the integer
    versions up to the one its checkpoint's run last pushed."""

    def __init__(self):
        self.pushed: list[str] = []
        self.resumed_at: int | None = None

    def push(self, version):
        if version is not None and (not self.pushed or self.pushed[-1] != str(version)):
            self.pushed.append(str(version))

    def resume(self, version):
        if version is not None and str(version).isdigit():
            self.resumed_at = int(version)

    @property
    def current(self) -> str:
        """What the engines serve: the last push, else the checkpoint's, else the initial weights."""
        if self.pushed:
            return self.pushed[-1]
        return str(self.resumed_at) if self.resumed_at is not None else INITIAL_WEIGHT_VERSION

    def was_pushed(self, version: str) -> bool:
        if version in self.pushed:
            return True
        if not self.pushed and self.resumed_at is None:
            return version == INITIAL_WEIGHT_VERSION  # no push yet (--debug-rollout-only): the initial weights
        return self.resumed_at is not None and version.isdigit() and 1 <= int(version) <= self.resumed_at

    def refusal(self, version: str, args) -> str | None:
        """Why `version` may not be trained now, or None when it may."""
        if not version.isdigit():
            return (
                "a label slime never sets (engines start at version 0 and every push labels them with an integer; "
                "SGLang's 'default' means an engine slime did not label)"
            )
        if not self.was_pushed(version):
            return f"which the trainer never pushed (pushed so far: {self.pushed[-5:] or [INITIAL_WEIGHT_VERSION]})"
        current, v = self.current, int(version)
        if args.partial_rollout and not args.mask_offpolicy_in_partial_rollout:
            ok, allowed = v <= int(current), f"a version up to {current} (--partial-rollout)"
        elif args.rollout_function_path == FULLY_ASYNC:
            low = int(current) - args.max_staleness
            ok, allowed = low <= v <= int(current), f"versions {low}..{current} (--max-staleness {args.max_staleness})"
        elif getattr(args, "asynchronous", False):
            recent = self.pushed[-2:] or [current]
            ok, allowed = version in recent, f"{' or '.join(recent)} (one-step off-policy: current or previous)"
        else:
            ok, allowed = version == current, f"only {current} (synchronous: the weights being trained)"
        return None if ok else f"but the engines serve version {current} and this mode trains {allowed}"


def _generate_function(args, sample) -> str:
    path = sample.generate_function_path or args.custom_generate_function_path
    return f"generate function {path}" if path else "the default generate (slime.rollout.sglang_rollout.generate)"


def check_weight_versions(args, samples, loss_masks, versions: PushedVersions | None, fn_path=None) -> None:
    """The gate: every trainable token's weight version is a pushed one the mode allows (see the module doc).
    `loss_masks`: the samples' masks over their response tokens (a removed sample's are zeros: nothing to check)."""
    if versions is None or args.debug_train_only:  # no engines: the samples are data (SFT transcripts), not sampled
        return
    if not getattr(args, "check_weight_versions", True):
        _warn_once("off", "--no-check-weight-versions: the weight versions of trained tokens are not checked")
        return
    for i, (s, mask) in enumerate(zip(samples, loss_masks)):
        mask = np.asarray(mask, dtype=bool)
        if not mask.any():
            continue
        covered = np.zeros(len(mask), dtype=bool)
        needed = {}  # version -> (first, last) trainable token it covers
        for span in s.weight_version_spans or []:
            a, b = max(0, int(span["start"])), min(len(mask), int(span["end"]))
            if b <= a:
                continue
            covered[a:b] = True
            hit = np.flatnonzero(mask[a:b])
            if hit.size:
                first, last = needed.get(span["version"], (a + int(hit[0]), a + int(hit[-1])))
                needed[span["version"]] = (min(first, a + int(hit[0])), max(last, a + int(hit[-1])))
        uncovered = np.flatnonzero(mask & ~covered)
        if uncovered.size:
            if s.weight_versions:  # per-call labels only: every one of them may have produced these tokens
                for v in s.weight_versions:
                    needed.setdefault(str(v), (int(uncovered[0]), int(uncovered[-1])))
            else:
                where = _generate_function(args, s)
                _warn_once(
                    ("none", where),
                    f"{where} records no weight version for trained tokens (sample {s.index} is the first): "
                    "their provenance is not checked; read meta_info with Sample.apply_finish_reason or "
                    "append_response_tokens to record it",
                )
        for version, (first, last) in needed.items():
            reason = versions.refusal(str(version), args)
            if reason is not None:
                raise RuntimeError(
                    f"sample {s.index} (position {i}) from rollout function {fn_path!r}: its trainable response "
                    f"tokens {first}..{last} were generated under weight version {str(version)!r}, {reason}; "
                    "refusing to train on them (--no-check-weight-versions trains anyway)"
                )


def record_provenance(samples) -> None:
    """`--save-debug-rollout-data`: each sample's `metadata["provenance"]` says which weights generated it."""
    for s in samples:
        s.metadata["provenance"] = {
            "weight_versions": list(s.weight_versions),
            "weight_version_spans": [dict(x) for x in s.weight_version_spans or []],
        }
