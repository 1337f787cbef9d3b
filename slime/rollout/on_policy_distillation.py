"""On-policy distillation (OPD) with a teacher served by an inference server (`--use-opd --opd-type sglang`).

Wire it as upstream slime's example does:

    --use-opd --opd-type sglang --opd-kl-coef 1.0
    --rm-url http://TEACHER_HOST:PORT/generate
    --custom-rm-path slime.rollout.on_policy_distillation.reward_func
    --custom-reward-post-process-path slime.rollout.on_policy_distillation.post_process_rewards

`reward_func` has the teacher score each sample's whole token sequence (prefill only, no token generated, at the
rollout temperature; a sample's images go with it as `image_data`, so a vision-language teacher sees them) and
returns the server's answer as the sample's reward; `post_process_rewards` keeps the teacher's log-probs of the
response tokens in `sample.teacher_log_probs` and gives every sample the task reward 0.0. The trainer then turns each
response token's advantage A into A - coef * (student - teacher log-prob)
(`slime.backends.megatron_utils.advantages.apply_opd_kl_to_advantages`). The teacher must share the student's tokenizer:
it scores the student's token ids as they are (checked at start-up by
`slime.backends.sglang_utils.external.check_opd_teacher`).
"""

import functools

import torch

from slime.backends.sglang_utils.sglang_config import OPD_TEACHER, get_model_url
from slime.utils.http_utils import post
from slime.utils.processing_utils import image_prompt_fields, load_processor
from slime.utils.types import Sample


@functools.lru_cache(maxsize=4)
def _image_token_id(hf_checkpoint):
    return load_processor(hf_checkpoint).image_token_id


def teacher_prompt_fields(args, sample: Sample) -> dict:
    """The prompt part of the teacher request: `input_ids`, plus for a sample with images its images and each pad
    run collapsed to one pad (SGLang re-expands it), so the teacher scores `sample.tokens` position for position."""
    images = (sample.multimodal_inputs or {}).get("images")
    if not images:
        return {"input_ids": sample.tokens}
    return image_prompt_fields(_image_token_id(args.hf_checkpoint), sample.tokens, images)


async def reward_func(args, sample: Sample, **kwargs):
    """The teacher server's (`--rm-url`, else the --sglang-config model `teacher`; its /generate) answer for `sample.tokens` scored prefill-only: its
    `meta_info.input_token_logprobs` holds, per input position, [log-prob, token id, ...] (the first is None).
    Retried like every engine request; an HTTP error names the URL."""
    payload = {
        **teacher_prompt_fields(args, sample),
        "sampling_params": {
            "temperature": args.rollout_temperature,
            "max_new_tokens": 0,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    return await post(args.rm_url or get_model_url(args, OPD_TEACHER, "/generate"), payload)


def teacher_response_log_probs(reward, response_length: int) -> torch.Tensor:
    """float32 log-probs the teacher gave the last `response_length` tokens, from its /generate answer."""
    per_token = reward["meta_info"]["input_token_logprobs"][1:]  # position 0 has no log-prob
    if len(per_token) < response_length:
        raise ValueError(
            f"the OPD teacher scored {len(per_token) + 1} tokens, fewer than the response's {response_length}: "
            "it must score the whole sequence (logprob_start_len 0)"
        )
    values = [item[0] for item in per_token[len(per_token) - response_length :]]
    return torch.tensor(values, dtype=torch.float32)


def post_process_rewards(args, samples: list[Sample], **kwargs):
    """(raw_rewards, rewards), both 0.0 per sample: the learning signal is the teacher's log-probs, stored here in
    `sample.teacher_log_probs` (response tokens only). For a task reward on top, wrap this function and return
    your own rewards after calling it."""
    for sample in samples:
        reward = sample.get_reward_value(args)
        if not isinstance(reward, dict) or "meta_info" not in reward:
            raise TypeError(
                f"sample {sample.index}: its reward is not the OPD teacher's answer; pass --custom-rm-path "
                "slime.rollout.on_policy_distillation.reward_func with this post-process function"
            )
        sample.teacher_log_probs = teacher_response_log_probs(reward, sample.response_length).tolist()
    rewards = [0.0] * len(samples)
    return rewards, rewards


def task_reward_logged_only(args, samples: list[Sample], **kwargs):
    """(raw_rewards, rewards) for `--opd-type megatron` without a task reward to train on: the task reward as
    measured (logged as `rollout/raw_reward`) and 0.0 per sample for the estimator, so each token's advantage is
    the OPD term alone, -coef * (student - teacher log-prob)."""
    return [sample.get_reward_value(args) for sample in samples], [0.0] * len(samples)
