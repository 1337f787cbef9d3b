"""Reward models: `async_rm(args, sample)` / `batched_async_rm(args, samples)` dispatch on `--rm-type` or `--custom-rm-path`.

Rule types: deepscaler, dapo (returns a dict, use `--reward-key score`), math, f1, gpqa (multiple choice), ifbench
(instruction following, IFBench's verifiers), random (a 0/1 coin flip), answer_match (slime-clone specific) and
remote_rm (POST to `--rm-url`). A `boxed_` prefix (e.g. `boxed_f1`) grades only the last `\\boxed{}` of the response.
A sample's `metadata["rm_type"]` overrides `--rm-type` (mixed-task datasets).
"""

import asyncio
import inspect
import random

import aiohttp

from slime.utils.http_utils import close_loop_session, loop_session
from slime.utils.misc import load_function
from slime.utils.types import Sample

from .answer_match import compute_answer_match
from .deepscaler import get_deepscaler_rule_based_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .math_dapo_utils import compute_score as compute_score_dapo
from .math_utils import extract_answer as extract_boxed_answer
from .math_utils import grade_answer_verl

__all__ = ["async_rm", "batched_async_rm", "remote_rm", "close_remote_rm_session", "RM_TYPES"]

RM_TYPES = ("deepscaler", "dapo", "math", "f1", "gpqa", "ifbench", "random", "answer_match", "remote_rm")

REMOTE_RM_TIMEOUT_S = 120.0
REMOTE_RM_MAX_RETRIES = 6
REMOTE_RM_BACKOFF_S = 0.5  # first retry delay; doubles per attempt up to REMOTE_RM_BACKOFF_MAX_S (plus jitter)
REMOTE_RM_BACKOFF_MAX_S = 8.0


async def close_remote_rm_session() -> None:
    """Close this event loop's shared HTTP session (`slime.utils.http_utils.loop_session`, which remote_rm uses; it
    also closes with its loop)."""
    await close_loop_session()


async def remote_rm(
    args,
    sample: Sample,
    *,
    max_retries: int = REMOTE_RM_MAX_RETRIES,
    timeout: float = REMOTE_RM_TIMEOUT_S,
    backoff: float = REMOTE_RM_BACKOFF_S,
    max_backoff: float = REMOTE_RM_BACKOFF_MAX_S,
):
    """POST `{"prompt", "response", "label"}` to `args.rm_url`; return the decoded JSON reward.

    Connection errors, timeouts and 5xx answers are retried with bounded exponential backoff; a 4xx answer or a
    non-JSON body fails at once (retrying will not fix a bad request).
    """
    url = args.rm_url
    if not url:
        raise ValueError("--rm-type remote_rm needs --rm-url (the HTTP endpoint of your reward model server).")
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    last_error = None
    for attempt in range(max(1, max_retries)):
        try:
            async with (await loop_session()).post(
                url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                body = await resp.text()
                if 400 <= resp.status < 500:
                    raise RuntimeError(
                        f"remote reward model {url} rejected the request with HTTP {resp.status}: {body[:500]}"
                    )
                resp.raise_for_status()
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    raise RuntimeError(f"remote reward model {url} answered non-JSON: {body[:500]!r}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            last_error = e
            if attempt + 1 < max_retries:
                delay = min(backoff * 2**attempt, max_backoff)
                await asyncio.sleep(delay * (1 + 0.1 * random.random()))  # jitter spreads retries of many samples
    raise ConnectionError(
        f"remote reward model {url} failed after {max_retries} attempt(s): {type(last_error).__name__}: {last_error}"
    ) from last_error


async def _call_custom_rm(path, args, arg, **kwargs):
    result = load_function(path)(args, arg, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def async_rm(args, sample: Sample, **kwargs):
    """Reward of one sample: a float/int, or a dict for dapo and for custom/remote RMs that return one.
    The sample's own `custom_rm_path` (e.g. from an eval dataset config) wins over `--custom-rm-path`."""
    path = sample.custom_rm_path or args.custom_rm_path
    if path:
        return await _call_custom_rm(path, args, sample, **kwargs)

    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    response, label = sample.response, sample.label
    if rm_type.startswith("boxed_"):
        response = extract_boxed_answer(response) or ""
        rm_type = rm_type[len("boxed_") :]
    if not rm_type:
        raise NotImplementedError(
            f"Rule-based RM type is not specified for sample {sample.index}: pass --rm-type "
            f"({' | '.join(RM_TYPES)}, optionally prefixed with boxed_), set metadata['rm_type'], or use --custom-rm-path."
        )

    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    if rm_type == "deepscaler":
        return get_deepscaler_rule_based_reward(response, label)
    if rm_type == "dapo":
        return compute_score_dapo(response, label)
    if rm_type == "math":
        return 1 if grade_answer_verl(response, label) else 0
    if rm_type == "f1":
        return f1_score(response, label)[0]
    if rm_type == "answer_match":
        return compute_answer_match(response, label)
    if rm_type == "gpqa":
        return compute_gpqa_reward(response, label, metadata=metadata)
    if rm_type == "ifbench":
        from .ifbench import compute_ifbench_reward  # lazy: IFBench is an optional dependency

        return compute_ifbench_reward(response, label, metadata=metadata)
    if rm_type == "random":  # a 0/1 coin flip (pipeline and throughput tests)
        return random.randint(0, 1)
    raise NotImplementedError(
        f"Rule-based RM {rm_type!r} is not implemented; valid --rm-type values: {', '.join(RM_TYPES)} "
        "(each may be prefixed with boxed_), or write your own and pass --custom-rm-path."
    )


async def batched_async_rm(args, samples: list[Sample], **kwargs) -> list:
    """Rewards of a group: one call of a custom (group) RM with the whole list, else `async_rm` per sample concurrently."""
    if args.custom_rm_path:
        rewards = await _call_custom_rm(args.custom_rm_path, args, samples, **kwargs)
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(samples):
            raise ValueError(
                f"--custom-rm-path {args.custom_rm_path} must return a list with one reward per sample when given "
                f"a list of {len(samples)} samples (--group-rm), got {rewards!r:.200}"
            )
        return list(rewards)
    return list(await asyncio.gather(*(async_rm(args, sample, **kwargs) for sample in samples)))
