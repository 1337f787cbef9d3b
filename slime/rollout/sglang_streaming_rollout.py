"""A generate function that streams: `--custom-generate-function-path
slime.rollout.sglang_streaming_rollout.generate_streaming` (current slime's path and name).

It sends the default generate's request (images included) with `stream: true`. The engine answers with server-sent events, each
holding the call's output so far (SGLang's stream is cumulative), and every event is written onto the sample as it
arrives. So when a rollout ends with an abort (`--partial-rollout`, a weight update) the sample already holds the
tokens and log-probs received up to then: it is marked ABORTED and keeps them, without waiting for the abort's own
answer. The rollout loop around it (concurrency, aborts, the partial-rollout buffer) is the default rollout's.
"""

from slime.backends.sglang_utils.router import router_url
from slime.rollout.sglang_rollout import GenerateState, prompt_fields, routing_headers
from slime.utils.http_utils import post_stream
from slime.utils.lora_utils import generate_fields
from slime.utils.sampling_record import record_segment
from slime.utils.top_p_replay import sampling_is_truncated
from slime.utils.types import Sample

__all__ = ["generate_streaming"]


async def generate_streaming(args, sample: Sample, sampling_params, evaluation=False) -> Sample:
    if not evaluation and sampling_is_truncated(args):
        raise ValueError(
            "generate_streaming does not ask the engine for the kept token sets that --rollout-top-p < 1 / "
            "--rollout-top-k > 0 replay needs: use the default generate for truncated sampling"
        )
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(
            f"sample {sample.index} has status {sample.status.value}; only pending or aborted samples are generated"
        )
    state = GenerateState(args)
    budget = sampling_params["max_new_tokens"] - sample.response_length  # a resumed sample: what is left
    if budget <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {
        **prompt_fields(state, sample),  # with its images, if it has any
        "sampling_params": {**sampling_params, "max_new_tokens": budget},
        "return_logprob": True,
        "stream": True,
        **generate_fields(args),
    }
    # each event is cumulative within this call: the sample is its state before the call plus the event's output
    tokens, response, length = list(sample.tokens), sample.response, sample.response_length
    log_probs, loss_mask = list(sample.rollout_log_probs or []), sample.loss_mask
    meta = {}
    url, headers = f"{router_url(args)}/generate", routing_headers(args, sample)
    async for event in post_stream(url, payload, timeout=args.rollout_request_timeout, headers=headers):
        meta = event["meta_info"]
        pairs = meta.get("output_token_logprobs") or []
        sample.tokens = tokens + [int(t) for _, t, *_ in pairs]
        sample.rollout_log_probs = log_probs + [float(lp) for lp, *_ in pairs]
        sample.response = response + event.get("text", "")
        sample.response_length = length + len(pairs)
        if loss_mask is not None:  # e.g. a resumed sample's masked earlier tokens: the new ones train
            sample.loss_mask = list(loss_mask) + [1] * len(pairs)
        if state.aborted:  # leaving the stream closes it: the engine aborts the request
            break
    if sample.response_length > length:  # what these tokens were sampled with: the engine's echo, else the request
        source = "slime.rollout.sglang_streaming_rollout.generate_streaming"
        record_segment(
            sample,
            meta,
            payload["sampling_params"],
            start=length,
            end=sample.response_length,
            source=source,
            body=payload,
        )
    sample.apply_finish_reason(meta, args, num_new_tokens=sample.response_length - length)
    if not meta.get("finish_reason"):  # cut before the engine finished it
        sample.status = Sample.Status.ABORTED
    return sample
