"""Default rollout: prompts -> router `/generate` -> reward -> filters, with over-sampling, dynamic sampling,
partial rollout (abort + resume) and eval. Works against SGLang or slime's CPU server (same HTTP API).

Module import needs neither sglang, megatron nor a GPU.
"""

import asyncio
import contextlib
import copy
import functools
import inspect
import logging
import uuid
from collections import Counter

from tqdm import tqdm

from slime.backends.sglang_utils.router import ROUTING_KEY_HEADER, abort_all, list_workers, router_url
from slime.backends.sglang_utils.sglang_config import get_model_url, policy_num_gpus
from slime.rollout import EvalResults, RolloutSamples
from slime.rollout.base_types import accepts_data_buffer
from slime.rollout.filter_hub.base_types import MetricGatherer, call_dynamic_filter, should_drop_dynamic_filter_output
from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.rollout.sample_hooks import apply_rollout_sample_hooks
from slime.utils.async_utils import run
from slime.utils.data import Dataset
from slime.utils.eval_config import EvalDatasetConfig, eval_datasets
from slime.utils.http_utils import init_http_client, post
from slime.utils.lora_utils import generate_fields
from slime.utils.misc import SingletonMeta, load_function
from slime.utils.processing_utils import multimodal_dataset_kwargs
from slime.utils.routing_replay import decode_routed_experts
from slime.utils.sampling_record import record_segment
from slime.utils.top_p_replay import append_kept_sets, sampling_is_truncated
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

__all__ = ["generate_rollout", "generate_abortable_samples", "get_model_url"]

GENERATE = "the default generate (slime.rollout.sglang_rollout.generate)"  # a sampling-parameter record's source


class GenerateState(metaclass=SingletonMeta):
    """Process-wide rollout state: tokenizer, concurrency limit, default sampling params, in-flight tasks."""

    def __init__(self, args):
        from transformers import AutoTokenizer  # heavy

        self.args = args
        init_http_client(args)
        self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        # a group's n samples share their prompt text: tokenised once, not n times
        self.prompt_token_ids = functools.lru_cache(maxsize=4096)(
            lambda text: tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        )
        # None unless --multimodal-keys or an eval dataset's own keys bring images
        media = [args.multimodal_keys, *(d.multimodal_keys for d in getattr(args, "eval_datasets", None) or [])]
        self.processor = next((multimodal_dataset_kwargs(args, k)["processor"] for k in media if k), None)
        # Bound in-flight requests to what the engines accept: concurrency per engine x number of engines.
        self.concurrency = max(
            1, args.sglang_server_concurrency * policy_num_gpus(args) // args.rollout_num_gpus_per_engine
        )
        self.semaphore = asyncio.Semaphore(self.concurrency)
        self._multi_acquire = asyncio.Lock()
        self.sampling_params = dict(
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
            stop=args.rollout_stop,
            stop_token_ids=args.rollout_stop_token_ids,
            skip_special_tokens=args.rollout_skip_special_tokens,
            no_stop_trim=True,
            spaces_between_special_tokens=False,
        )
        self.metrics = {}  # of the latest generate_rollout_async call
        self.workers = []  # engine URLs for requests the router cannot forward (top-p replay), read when needed
        self.reset()

    def reset(self):
        self.remaining_batch_size = 0  # submitted groups not yet dropped by the dynamic filter
        self.pendings = set()
        self.aborted = False
        self.request_timeouts = 0  # /generate calls over --rollout-request-timeout (each retried)
        self.timed_out_groups = []  # groups over --rollout-group-timeout, as they were handed out
        self.engine_abort_resumes = 0  # samples resumed after coming back aborted mid-rollout

    @contextlib.asynccontextmanager
    async def slots(self, n: int):
        """n of the semaphore's slots (n <= concurrency), taken by one holder at a time: two groups each holding
        part of what they need would wait on each other forever."""
        taken = 0
        try:
            async with self._multi_acquire:
                while taken < n:
                    await self.semaphore.acquire()
                    taken += 1
            yield
        finally:  # also the slots taken before a cancellation
            for _ in range(taken):
                self.semaphore.release()

    def submit_generate_tasks(self, samples: list[list[Sample]]):
        for group in samples:
            # a copy so per-group changes never leak into the shared defaults
            self.pendings.add(asyncio.create_task(_generate_group(self.args, group, self.sampling_params.copy())))
        self.remaining_batch_size += len(samples)


async def _generate_group(args, group, sampling_params):
    """`_generated_to_the_end` under --rollout-group-timeout: a group over it is dropped from this rollout (None is
    returned) and kept, as it was handed out, in `GenerateState.timed_out_groups` to go back to the data source."""
    if args.rollout_group_timeout is None:
        return await _generated_to_the_end(args, group, sampling_params)
    pristine = copy.deepcopy(group)
    try:
        return await asyncio.wait_for(_generated_to_the_end(args, group, sampling_params), args.rollout_group_timeout)
    except asyncio.TimeoutError:
        state = GenerateState(args)
        state.timed_out_groups.append(pristine)
        logger.warning(
            f"group {group[0].group_index} (samples {[s.index for s in group]}) took longer than --rollout-group-timeout "
            f"{args.rollout_group_timeout:g}s: dropped from this rollout, its prompt goes back to the data source"
        )
        return None


ENGINE_ABORT_RESUMES = 3


async def _generated_to_the_end(args, group, sampling_params):
    """`generate_and_rm_group`, then again for the samples that came back aborted while the rollout was not being
    aborted (an engine paused or aborted them on its own, or a custom generate gave up): they go on from what they
    hold, under the same weights, up to ENGINE_ABORT_RESUMES times; after that the run stops naming them rather
    than train a sample without a reward. (A custom generate that turns a prompt into several samples: not resumed.)"""
    state = GenerateState(args)
    for attempt in range(ENGINE_ABORT_RESUMES + 1):
        out = await generate_and_rm_group(args, group, sampling_params=sampling_params.copy(), evaluation=False)
        aborted = [s.index for s in out if s.status == Sample.Status.ABORTED]
        if not aborted or state.aborted or len(out) != len(group):
            return out
        if attempt == ENGINE_ABORT_RESUMES:
            raise RuntimeError(
                f"samples {aborted} came back aborted {attempt + 1} times in a row while the rollout was not being "
                "aborted: see the engines' logs (or the --custom-generate-function-path) for why they abort them"
            )
        logger.warning(f"samples {aborted} came back aborted while the rollout was not: resuming them")
        state.engine_abort_resumes += len(aborted)
        group = out
    return out


def routing_headers(args, sample: Sample) -> dict | None:
    """`--router-policy consistent_hashing`: every turn of a session (the sample's `session_id`) goes to the same
    engine, keyed by the router's routing-key header (as current slime sends it)."""
    if sample.session_id and args.router_policy == "consistent_hashing":
        return {ROUTING_KEY_HEADER: sample.session_id}
    return None


async def _post_to_a_worker(args, state, sample, payload, on_retry, attempts=3):
    """POST a /generate that asks for sampling masks straight to one of the router's workers: sglang-router 0.3.2
    re-serialises /generate bodies into its own request type and drops `return_sampling_mask` and
    `return_routed_experts`. A prompt group goes
    to one worker (its prefix is cached there); a worker that stops answering is skipped after the usual retries,
    with the list re-read from the router (fault tolerance replaces engines there). Returns (output, url)."""
    loop = asyncio.get_running_loop()
    headers = {"Authorization": f"Bearer {args.sglang_api_key}"} if args.sglang_api_key else None
    last = None
    for attempt in range(attempts):
        if attempt or not state.workers:
            state.workers = await loop.run_in_executor(None, list_workers, router_url(args))
            if not state.workers:
                raise ConnectionError(f"sglang-router at {router_url(args)} lists no worker for sample {sample.index}")
        key = sample.group_index if sample.group_index is not None else sample.index or 0
        worker = state.workers[(key + attempt) % len(state.workers)]
        try:
            url = f"{worker}/generate"
            output = await post(url, payload, timeout=args.rollout_request_timeout, headers=headers, on_retry=on_retry)
            return output, url
        except ConnectionError as e:
            last = e
            logger.warning(f"sample {sample.index}: worker {worker} did not serve /generate ({e}); trying another")
    raise ConnectionError(f"no worker of sglang-router {router_url(args)} served sample {sample.index}: {last}")


def prompt_ids(state, sample: Sample) -> list:
    """What a (resumed) sample sends: its tokens so far, else its text prompt tokenised (then kept as its tokens)."""
    if has_media(sample):  # never drop the images or videos silently
        raise ValueError(
            f"sample {sample.index} has images or videos, which this generate does not send (the default and "
            "streaming generates do: prompt_fields, docs/vlm.md)"
        )
    if not sample.tokens:
        if not isinstance(sample.prompt, str):
            raise TypeError(
                f"sample {sample.index}: the prompt is a {type(sample.prompt).__name__}, not text. The default generate "
                f"sends text prompts; pass --apply-chat-template for chat-message prompts, or use "
                f"--custom-generate-function-path."
            )
        sample.tokens = list(state.prompt_token_ids(sample.prompt))
    return list(sample.tokens)


def has_media(sample: Sample) -> bool:
    """Whether the sample's prompt holds images or videos."""
    return bool(
        sample.multimodal_inputs and (sample.multimodal_inputs.get("images") or sample.multimodal_inputs.get("videos"))
    )


def prompt_fields(state, sample: Sample) -> dict:
    """The prompt part of a sample's /generate request: its images and videos with it when it has any, else
    `input_ids`."""
    if has_media(sample):
        return multimodal_prompt_fields(state, sample)
    return {"input_ids": prompt_ids(state, sample)}


def multimodal_prompt_fields(state, sample: Sample) -> dict:
    """The prompt part of a /generate request for a sample with images or videos, as current slime sends it: the
    template text (SGLang expands its placeholders with its own processor), one PNG data URL per image as `image_data`
    and one data URL of each encoded video as `video_data`. The processor's expanded ids (each video sampled and
    resized as SGLang does, slime.utils.video) become the sample's tokens, its other outputs (pixel_values,
    image_grid_thw, pixel_values_videos, ...) the sample's `multimodal_train_inputs`. A resumed sample
    (--partial-rollout) sends its tokens so far as `input_ids` instead, each image's run collapsed to one pad, which
    the engine expands to the same ids again (not with videos: refused at start-up)."""
    from slime.utils.processing_utils import encode_image_for_rollout_engine, image_prompt_fields, process_prompt
    from slime.utils.video import data_url

    if state.processor is None:
        raise ValueError(f"sample {sample.index} has images or videos but --hf-checkpoint has no processor")
    images = sample.multimodal_inputs.get("images") or []
    videos = sample.multimodal_inputs.get("videos") or []
    if (
        sample.response_length > 0
    ):  # resumed: its tokens so far, each image's run collapsed for the engine to re-expand
        if videos:
            raise ValueError(f"sample {sample.index} has videos; a sample with videos cannot be resumed")
        pad = state.processor.image_token_id
        if pad in sample.tokens[len(sample.tokens) - sample.response_length :]:
            raise ValueError(
                f"sample {sample.index}: its partial response holds the image-pad token {pad}, which the engine would "
                "read as an image placeholder; it cannot be resumed (drop --partial-rollout with --multimodal-keys)"
            )
        return image_prompt_fields(pad, sample.tokens, images)
    if not isinstance(sample.prompt, str):
        raise TypeError(
            f"sample {sample.index}: a prompt with images must be rendered to text; pass --apply-chat-template "
            "with --multimodal-keys"
        )
    sample.tokens, sample.multimodal_train_inputs = process_prompt(state.processor, sample.prompt, images, videos)
    fields = {"text": sample.prompt}
    if images:
        fields["image_data"] = [encode_image_for_rollout_engine(image) for image in images]
    if videos:
        fields["video_data"] = [data_url(video) for video in videos]
    return fields


async def generate(args, sample: Sample, sampling_params, evaluation=False) -> Sample:
    """Default generate: one `/generate` call through the router; resumes a partially generated sample.

    Training rollouts with truncated sampling (`--rollout-top-p` < 1 / `--rollout-top-k` > 0) ask the engine for each
    step's kept token set (SGLang's `return_sampling_mask`, sent to a worker directly: see `_post_to_a_worker`); they
    are stored on the sample for top-p replay, and the rollout log-probs are the engine's, renormalised over those
    sets, as the trainer computes them."""
    state = GenerateState(args)
    url = f"{router_url(args)}/generate"
    _check_generatable(sample)

    if sample.response_length > 0:  # resume a partial rollout: only the remaining token budget
        sampling_params["max_new_tokens"] -= sample.response_length
        if sampling_params["max_new_tokens"] <= 0:
            sample.status = Sample.Status.TRUNCATED
            return sample

    payload, replay, routed = _payload(args, state, sample, sampling_params, evaluation)
    on_retry = _on_retry(args, state, f"sample {sample.index}")
    if replay or routed:  # the router drops both request fields
        output, url = await _post_to_a_worker(args, state, sample, payload, on_retry)
    else:
        output = await _post_router(args, url, payload, sample, on_retry, f"sample {sample.index}")
    return _take_output(args, sample, output, url, payload, sampling_params, replay, routed)


async def generate_group(args, group: list[Sample], sampling_params) -> list[Sample]:
    """The default generate for a group of fresh samples in one batch `/generate` (SGLang's list `input_ids`, one
    `sampling_params` for all): one HTTP round trip, one request to parse and one response to write for the group
    instead of one per sample. Each sample gets exactly what `generate` would give it from the same output."""
    state = GenerateState(args)
    url = f"{router_url(args)}/generate"
    for sample in group:
        _check_generatable(sample)
    payloads = [_payload(args, state, sample, sampling_params, False)[0] for sample in group]
    body = {**payloads[0], "input_ids": [p["input_ids"] for p in payloads]}
    what = f"samples {[s.index for s in group]}"
    outputs = await _post_router(args, url, body, group[0], _on_retry(args, state, what), what)
    if not isinstance(outputs, list) or len(outputs) != len(group):
        raise RuntimeError(f"{url} returned an unexpected response for {what}: {str(outputs)[:300]}")
    return [
        _take_output(args, sample, output, url, payload, sampling_params, False, False)
        for sample, output, payload in zip(group, outputs, payloads)
    ]


def _check_generatable(sample):
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(
            f"sample {sample.index} has status {sample.status.value}; only pending or aborted samples are generated"
        )


def _payload(args, state, sample, sampling_params, evaluation):
    """(the sample's /generate body, whether it asks for sampling masks, whether for routed experts)."""
    payload = {
        **prompt_fields(state, sample),
        "sampling_params": sampling_params,
        "return_logprob": True,
        **generate_fields(args),  # the policy's LoRA adapter under --lora-sync adapter
    }
    replay = not evaluation and sampling_is_truncated(args)
    if replay:
        payload["return_sampling_mask"] = True
    routed = not evaluation and args.use_rollout_routing_replay
    if routed:  # R3: every token's experts per layer (for the whole sequence: a resumed prompt is re-routed)
        payload["return_routed_experts"] = True
    return payload, replay, routed


def _on_retry(args, state, what):
    def on_retry(error):
        if isinstance(error, asyncio.TimeoutError):
            state.request_timeouts += 1
            logger.warning(
                f"{what}: /generate took longer than --rollout-request-timeout "
                f"{args.rollout_request_timeout:g}s; retrying it"
            )

    return on_retry


async def _post_router(args, url, payload, sample, on_retry, what):
    try:
        return await post(
            url,
            payload,
            timeout=args.rollout_request_timeout,
            headers=routing_headers(args, sample),
            on_retry=on_retry,
        )
    except ConnectionError as e:
        raise ConnectionError(f"sglang-router at {router_url(args)} did not serve {what}: {e}") from e


def _take_output(args, sample, output, url, payload, sampling_params, replay, routed) -> Sample:
    """Append one /generate output (tokens, log-probs, kept sets, routed experts, its sampling record) to sample."""
    if not isinstance(output, dict) or "meta_info" not in output:
        raise RuntimeError(f"{url} returned an unexpected response for sample {sample.index}: {str(output)[:300]}")

    meta_info = output["meta_info"]
    # An aborted request may carry no tokens at all.
    token_logprobs = meta_info.get("output_token_logprobs") or []
    new_tokens = [int(item[1]) for item in token_logprobs]
    new_log_probs = [float(item[0]) for item in token_logprobs]
    if replay:
        kept_sets = meta_info.get("output_token_sampling_mask")
        if kept_sets is None or len(kept_sets) != len(new_tokens):
            raise RuntimeError(
                f"sample {sample.index}: the engine returned no sampling mask for its {len(new_tokens)} tokens "
                f"(got {None if kept_sets is None else len(kept_sets)}), which --rollout-top-p / --rollout-top-k "
                "replay needs"
            )
        append_kept_sets(sample, kept_sets)
        new_log_probs = [float(x) for x in meta_info["output_token_sampling_logprobs"]]

    if new_tokens:  # what these tokens were sampled with: the engine's echo, else the request sent
        start = sample.response_length
        record_segment(
            sample, meta_info, sampling_params, start=start, end=start + len(new_tokens), source=GENERATE, body=payload
        )
    sample.tokens = sample.tokens + new_tokens
    aborted_early = (meta_info.get("finish_reason") or {}).get("type") == "abort" and "routed_experts" not in meta_info
    if routed and sample.tokens and not aborted_early:  # an abort before any compute is generated again later
        where = f"{url}, sample {sample.index}"
        sample.rollout_routed_experts = decode_routed_experts(
            meta_info, len(sample.tokens), args.num_layers, args.moe_router_topk, where
        )
    # generated tokens train: the mask covers the response from here on (as current slime's Sample does), so hooks,
    # reward functions, filters and converters see a list; a resumed sample's masked earlier tokens stay masked
    mask = [1] * sample.response_length if sample.loss_mask is None else sample.loss_mask
    sample.loss_mask = mask + [1] * len(new_tokens)
    sample.response_length += len(new_tokens)
    sample.response += output.get("text", "")
    if sample.rollout_log_probs is None:
        sample.rollout_log_probs = []
    sample.rollout_log_probs += new_log_probs
    sample.apply_finish_reason(meta_info, args, num_new_tokens=len(new_tokens))
    return sample


async def generate_and_rm(args, sample: Sample, sampling_params: dict, evaluation=False):
    """Generate one sample (default or `--custom-generate-function-path`) and reward it unless `--group-rm`."""
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout and sample.response_length > 0:
        # a sample from the buffer: what it already holds came from older weights; only new tokens train
        sample.loss_mask = [0] * sample.response_length
    # Groups returned to the buffer may hold samples that already finished in an earlier rollout.
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        if not args.group_rm and sample.reward is None:
            sample.reward = await async_rm(args, sample)
        return sample

    state = GenerateState(args)
    async with state.semaphore:
        if state.aborted:
            sample.status = Sample.Status.ABORTED
            return sample
        # a sample's own generate_function_path (e.g. from an eval dataset config) wins over the flag
        path = sample.generate_function_path or args.custom_generate_function_path
        generate_fn = load_function(path) if path else generate
        # as current slime: `evaluation=` only to a generate function that names it (a **kwargs one may forward
        # its keywords to a callee that takes none)
        named = "evaluation" in inspect.signature(generate_fn).parameters
        sample = await generate_fn(args, sample, sampling_params, **({"evaluation": evaluation} if named else {}))
    return await _hooks_and_reward(args, sample, evaluation)


async def _hooks_and_reward(args, sample, evaluation):
    """A generated sample (or a custom generate's list of them) through the sample hooks, then its reward unless
    --group-rm scores the whole group."""
    sample = await apply_rollout_sample_hooks(args, sample, evaluation=evaluation)

    # group RM scores the whole group in generate_and_rm_group
    if args.group_rm:
        return sample

    if isinstance(sample, list):  # a custom generate may turn one prompt into several samples
        if any(s.status == Sample.Status.ABORTED for s in sample):
            return sample
        unscored = [s for s in sample if s.reward is None]
        if unscored:
            rewards = await batched_async_rm(args, unscored)
            for s, r in zip(unscored, rewards):
                s.reward = r
        return sample

    if sample.status == Sample.Status.ABORTED:
        return sample
    if sample.reward is None:  # a custom generate may already have scored it
        sample.reward = await async_rm(args, sample)
    return sample


def _one_request(args, group, evaluation) -> bool:
    """Whether the default generate sends the group as one batch request (unless --rollout-request-per-sample): fresh
    text samples that it generates itself, through the router, to one engine (one session under consistent hashing),
    with the same sampling parameters (not --deterministic-mode's per-sample seeds), no more of them than the
    concurrency limit admits at once."""
    return (
        len(group) > 1
        and len(group) <= GenerateState(args).concurrency
        and not args.rollout_request_per_sample
        and not args.custom_generate_function_path
        and not args.sglang_enable_deterministic_inference
        and (evaluation or not (sampling_is_truncated(args) or args.use_rollout_routing_replay))
        and all(routing_headers(args, s) == routing_headers(args, group[0]) for s in group)
        and all(
            s.status == Sample.Status.PENDING
            and s.response_length == 0
            and not s.generate_function_path
            and not has_media(s)
            for s in group
        )
    )


async def generate_and_rm_one_request(args, group, sampling_params, evaluation=False) -> list[Sample]:
    """`generate_and_rm` for each sample of a group that `_one_request` admits, the group's /generate calls sent as
    one: it holds one concurrency slot per sample, as n separate requests would."""
    state = GenerateState(args)
    async with state.slots(len(group)):
        if state.aborted:
            for sample in group:
                sample.status = Sample.Status.ABORTED
            return group
        group = await generate_group(args, group, sampling_params)
    return list(await asyncio.gather(*(_hooks_and_reward(args, s, evaluation) for s in group)))


def seeded(args, sampling_params, j):
    """A copy of `sampling_params`; with --sglang-enable-deterministic-inference (which --deterministic-mode turns on)
    the j-th sample of a group gets `sampling_seed` --rollout-seed + j (as current slime), so the engine's draws
    depend on the request only, not on what else it batches."""
    params = sampling_params.copy()
    if args.sglang_enable_deterministic_inference:
        params["sampling_seed"] = args.rollout_seed + j
    return params


async def generate_and_rm_group(args, group: list[Sample], sampling_params: dict, evaluation=False) -> list[Sample]:
    state = GenerateState(args)
    if state.aborted:
        return group
    for sample in group:  # each sample its own session (as current slime): its turns' routing key
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())

    if _one_request(args, group, evaluation):
        results = await generate_and_rm_one_request(args, group, sampling_params, evaluation=evaluation)
    else:
        results = await asyncio.gather(
            *(
                generate_and_rm(args, sample, seeded(args, sampling_params, j), evaluation=evaluation)
                for j, sample in enumerate(group)
            )
        )
    group = [s for r in results for s in (r if isinstance(r, list) else [r])]

    if args.group_rm and not state.aborted and not any(s.status == Sample.Status.ABORTED for s in group):
        rewards = await batched_async_rm(args, group)
        for sample, reward in zip(group, rewards):
            sample.reward = reward
    return group


async def abort(args, rollout_id: int) -> list[list[Sample]]:
    """Abort every in-flight request on every worker, drain the tasks; with --partial-rollout return the groups."""

    state = GenerateState(args)
    state.aborted = True
    await abort_all(router_url(args), admin_key=args.sglang_admin_api_key or args.sglang_api_key)

    aborted_samples = []
    while state.pendings:
        done, state.pendings = await asyncio.wait(state.pendings, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            group = task.result()
            if group is not None and args.partial_rollout:
                aborted_samples.append(_mark_start_rollout_id(group, rollout_id))
    return aborted_samples


def _mark_start_rollout_id(group, rollout_id):
    """Remember the rollout a partially generated sample started in (kept across later resumptions)."""
    for sample in group:
        if sample.response_length > 0 and "start_rollout_id" not in sample.metadata:
            sample.metadata["start_rollout_id"] = rollout_id
    return group


def _data_order(group):
    """Sort key of a finished group (None: timed out) by its prompt's place in the data."""
    if not group:
        return (0, -1, -1)
    first = group[0]
    return (1, -1 if first.group_index is None else first.group_index, -1 if first.index is None else first.index)


async def generate_rollout_async(args, rollout_id: int, data_source) -> tuple[RolloutSamples, list[list[Sample]]]:
    """Keep `rollout_batch_size` (or over-sampling) groups in flight until enough pass the dynamic filter.

    `data_source` is a callable `n -> list[list[Sample]]`. Returns (groups sorted by index, aborted groups); the
    groups are a `RolloutSamples` (a list with `.samples` and `.metrics`: the dynamic-filter drops of this call,
    also left in `GenerateState(args).metrics`). With
    --partial-rollout the aborted groups (and finished surplus groups) carry `metadata["start_rollout_id"]`.
    Then `--rollout-sample-filter-path fn(args, groups)` sees the kept groups (it may set `remove_sample`) and
    `--rollout-all-samples-process-path fn(args, all_groups, data_source)` every group that finished.
    """
    state = GenerateState(args)
    n = args.n_samples_per_prompt
    over_sampling_batch_size = args.over_sampling_batch_size or args.rollout_batch_size

    dynamic_filter = load_function(args.dynamic_sampling_filter_path) if args.dynamic_sampling_filter_path else None
    over_sampling_filter = load_function(args.over_sampling_filter_path) if args.over_sampling_filter_path else None
    target_data_size = over_sampling_batch_size if over_sampling_filter is not None else args.rollout_batch_size

    data = []
    surplus = []  # groups that finished after the target was reached (in the same wait)
    # every group that finished (kept, dropped by the filter, surplus), for --rollout-all-samples-process-path only:
    # a filter that keeps dropping would otherwise hold every group it ever saw
    finished = []
    drops = Counter()
    gatherer = MetricGatherer()
    pbar = tqdm(total=target_data_size * n, desc="Rollout generation")
    try:
        while len(data) < target_data_size:
            while state.remaining_batch_size < target_data_size:
                samples = data_source(over_sampling_batch_size)
                if not samples:
                    raise RuntimeError("the data source returned no prompts; cannot fill the rollout batch")
                state.submit_generate_tasks(samples)

            # --deterministic-mode: the groups in flight all finish, then count in data order, so which groups the
            # rollout keeps does not depend on which finished first
            when = asyncio.ALL_COMPLETED if args.deterministic_mode else asyncio.FIRST_COMPLETED
            done, state.pendings = await asyncio.wait(state.pendings, return_when=when)
            # the groups that finished together, in data order (asyncio's done set has none): which of them fill
            # the batch is then reproducible, and groups taken back from the buffer (earlier in the data) go first
            groups = sorted((task.result() for task in done), key=_data_order)
            for group in groups:
                if group is None:  # over --rollout-group-timeout: replaced by a fresh prompt
                    state.remaining_batch_size -= 1
                    continue
                if args.custom_generate_function_path is None and len(group) != n:
                    raise RuntimeError(
                        f"a group of {len(group)} samples came back, expected --n-samples-per-prompt={n}"
                    )
                if args.rollout_all_samples_process_path:
                    finished.append(group)
                if dynamic_filter is not None:
                    output = call_dynamic_filter(dynamic_filter, args, group)
                    if should_drop_dynamic_filter_output(
                        output, remaining_batch_size=state.remaining_batch_size, target_data_size=target_data_size
                    ):
                        state.remaining_batch_size -= 1
                        drops[output.reason or "filtered"] += 1
                        gatherer.on_dynamic_filter_drop(output.reason)
                        if sum(drops.values()) % (10 * target_data_size) == 0:  # e.g. a policy that never scores
                            logger.warning(
                                f"rollout {rollout_id}: --dynamic-sampling-filter-path {args.dynamic_sampling_filter_path} "
                                f"dropped {sum(drops.values())} groups so far, kept {len(data)}/{target_data_size}; "
                                "generation continues until enough groups pass"
                            )
                        continue
                if len(data) < target_data_size:
                    data.append(group)
                    pbar.update(len(group))
                else:
                    surplus.append(group)
        pbar.close()
        aborted_samples = await abort(args, rollout_id)
    except BaseException:
        # Leave nothing running on the loop and the singleton clean for the next rollout.
        pbar.close()
        for task in state.pendings:
            task.cancel()
        state.reset()
        raise

    if args.partial_rollout:  # beyond slime, which drops them: finished work goes back to the buffer too
        aborted_samples = [_mark_start_rollout_id(g, rollout_id) for g in surplus] + aborted_samples

    if over_sampling_filter is not None:
        data = over_sampling_filter(args, data)[: args.rollout_batch_size]
    assert len(data) == args.rollout_batch_size, f"got {len(data)} groups, expected {args.rollout_batch_size}"
    data = sorted(data, key=lambda group: group[0].index)

    metrics = {"rollout/dynamic_filter/drop": sum(drops.values())} if dynamic_filter is not None else {}
    metrics.update(gatherer.collect())
    if args.rollout_request_timeout is not None:
        metrics["rollout/timeouts/requests"] = state.request_timeouts
    if args.rollout_group_timeout is not None:
        metrics["rollout/timeouts/groups"] = len(state.timed_out_groups)
    if state.engine_abort_resumes:
        metrics["rollout/engine_abort_resumes"] = state.engine_abort_resumes
    # dropped by the group timeout: served again, first, by the next rollout (same indices: nothing lost)
    aborted_samples = aborted_samples + state.timed_out_groups
    state.reset()
    state.metrics = metrics

    if args.rollout_sample_filter_path:
        load_function(args.rollout_sample_filter_path)(args, data)
    if args.rollout_all_samples_process_path:
        all_groups = sorted(finished, key=lambda group: group[0].index)
        load_function(args.rollout_all_samples_process_path)(args, all_groups, data_source)
    # a list (slime v0.1.0) that is also current slime's RolloutFnTrainOutput (.samples, .metrics)
    return RolloutSamples(data, metrics=metrics), aborted_samples


EVAL_PROMPT_DATASET = {}  # EvalDatasetConfig.cache_key -> loaded prompts


async def eval_rollout_single_dataset(args, rollout_id, dataset_cfg: EvalDatasetConfig):
    """Generate `n_samples_per_eval_prompt` samples per prompt of one eval dataset, with its own sampling params,
    reward (`custom_rm_path`, `rm_type`) and generate function; {name: {rewards, truncated, samples}}."""
    state = GenerateState(args)
    name = dataset_cfg.name
    if dataset_cfg.cache_key not in EVAL_PROMPT_DATASET:
        EVAL_PROMPT_DATASET[dataset_cfg.cache_key] = Dataset(
            dataset_cfg.path,
            tokenizer=state.tokenizer,
            max_length=args.eval_max_prompt_len,
            prompt_key=dataset_cfg.input_key,
            label_key=dataset_cfg.label_key,
            metadata_key=dataset_cfg.metadata_key,
            tool_key=dataset_cfg.tool_key,
            apply_chat_template=dataset_cfg.apply_chat_template,
            apply_chat_template_kwargs=dataset_cfg.apply_chat_template_kwargs,
            **multimodal_dataset_kwargs(args, dataset_cfg.multimodal_keys),
        )
    dataset = EVAL_PROMPT_DATASET[dataset_cfg.cache_key]
    sampling_params = dataset_cfg.sampling_params(state.sampling_params)

    tasks = []
    sample_index = 0
    for prompt_sample in dataset.samples:
        for j in range(dataset_cfg.n_samples_per_eval_prompt):
            sample = copy.deepcopy(prompt_sample)
            sample.index = sample_index
            sample_index += 1
            sample.metadata = dataset_cfg.inject_metadata(sample.metadata)
            if dataset_cfg.custom_rm_path:
                sample.custom_rm_path = dataset_cfg.custom_rm_path
            if dataset_cfg.custom_generate_function_path:
                sample.generate_function_path = dataset_cfg.custom_generate_function_path
            tasks.append(generate_and_rm(args, sample, seeded(args, sampling_params, j), evaluation=True))

    data = []
    pbar = tqdm(total=len(tasks), desc=f"Eval {name}")
    for coro in asyncio.as_completed(tasks):
        result = await coro
        data.extend(result if isinstance(result, list) else [result])
        pbar.update(1)
    pbar.close()
    data.sort(key=lambda s: s.index)

    reward_key = args.eval_reward_key or args.reward_key
    return {
        name: {
            "rewards": [s.reward if not reward_key else s.reward[reward_key] for s in data],
            "truncated": [s.status == Sample.Status.TRUNCATED for s in data],
            "samples": data,
        }
    }


async def eval_rollout(args, rollout_id):
    """Scores eval samples one by one (--group-rm with the default eval is refused at start-up). Returns
    `(results, [])`, as both slime v0.1.0 (a dict) and current slime (`RolloutFnEvalOutput`) do: `EvalResults` is
    either."""
    results = EvalResults()
    for dataset_cfg in eval_datasets(args):
        results.update(await eval_rollout_single_dataset(args, rollout_id, dataset_cfg))
    return results, []


def generate_abortable_samples(args, rollout_id, data_source, evaluation=False):
    """slime v0.1.0's building block of `generate_rollout`: with `evaluation`, the eval results; otherwise
    `(completed_groups, aborted_groups)` from `generate_rollout_async`, where `data_source` is `n -> groups`.
    It reads the global prompt dataset (start-up validation refuses --disable-rollout-global-dataset with it)."""
    if evaluation:
        return run(eval_rollout(args, rollout_id))
    return run(generate_rollout_async(args, rollout_id, data_source))


@accepts_data_buffer
def generate_rollout(args, rollout_id, data_source, evaluation=False):
    """The default `--rollout-function-path`: training groups, or eval results when `evaluation`.

    The training result is a `list[list[Sample]]` (`RolloutSamples`) that also has `.samples` and `.metrics`, so
    callers written against either slime v0.1.0 (a list) or current slime (`RolloutFnTrainOutput`) work."""
    if evaluation:
        results, _ = generate_abortable_samples(args, rollout_id, data_source, evaluation=True)
        return results
    completed, aborted = generate_abortable_samples(args, rollout_id, data_source.get_samples)
    data_source.add_samples(aborted)
    return completed
