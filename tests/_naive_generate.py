"""A user's generate function as upstream examples write them (importable by dotted path): it builds its own
`/generate` request for the router slime gives it, at its own temperature (0.8, whatever the flag says), and records
nothing -- no sampling parameters, no weight versions. slime's recording proxy at the router must supply both."""

from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.types import Sample

TEMPERATURE = 0.8


async def generate(args, sample, sampling_params):
    ids = GenerateState(args).tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    payload = {"input_ids": ids, "sampling_params": {**sampling_params, "temperature": TEMPERATURE}}
    out = await post(url, {**payload, "return_logprob": True})
    new = [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
    sample.tokens, sample.response_length, sample.response = ids + new, len(new), out["text"]
    sample.rollout_log_probs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    finish = out["meta_info"]["finish_reason"]["type"]
    sample.status = Sample.Status.TRUNCATED if finish == "length" else Sample.Status.COMPLETED
    return sample
