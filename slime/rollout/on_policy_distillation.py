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
`slime.backends.sglang_utils.external.check_opd_teacher`). A sample with images whose response holds the image-pad
id is scored up to that pad; its later tokens take the engine's log-probs (`teacher_scored_length`).
"""

import functools
import logging

import torch

from slime.backends.sglang_utils.sglang_config import OPD_TEACHER, get_model_url
from slime.utils.http_utils import post
from slime.utils.processing_utils import image_prompt_fields, load_processor
from slime.utils.types import Sample

logger = logging.getLogger(__name__)
_warned_pad_in_response = False


@functools.lru_cache(maxsize=4)
def _image_token_id(hf_checkpoint):
    return load_processor(hf_checkpoint).image_token_id


def _image_pad(args, sample: Sample):
    """The image-pad token id for a sample with images, else None (a text-only sample needs no processor)."""
    return _image_token_id(args.hf_checkpoint) if (sample.multimodal_inputs or {}).get("images") else None


def teacher_scored_length(args, sample: Sample) -> int:
    """How many leading tokens of `sample.tokens` the teacher is sent: all of them, except for a sample with images
    whose response holds the image-pad id (a tiny model sampling at temperature 1 generates it). Both SGLang
    (transformers' processor, `_expand_input_ids`) and slime's CPU server (`media.expand`) read every pad id in
    `input_ids` as an image placeholder, so a generated pad, sent with the images, is refused ("N image
    placeholder(s) but image_data has M"); there is no way to send it as the text token the student generated. Such
    a sample is scored up to its first generated pad only (`post_process_rewards` fills the rest)."""
    pad = _image_pad(args, sample)
    prompt_len = len(sample.tokens) - sample.response_length
    if pad is None:
        return len(sample.tokens)
    response = sample.tokens[prompt_len:]
    return prompt_len + response.index(pad) if pad in response else len(sample.tokens)


def teacher_prompt_fields(args, sample: Sample) -> dict:
    """The prompt part of the teacher request: `input_ids`, plus for a sample with images its images and each pad
    run of the *prompt* collapsed to one pad (SGLang re-expands it), so the teacher scores `sample.tokens` position
    for position; the response's ids are sent as they are, up to a generated pad (`teacher_scored_length`)."""
    pad = _image_pad(args, sample)
    if pad is None:
        return {"input_ids": sample.tokens}
    prompt_len = len(sample.tokens) - sample.response_length
    fields = image_prompt_fields(pad, sample.tokens[:prompt_len], sample.multimodal_inputs["images"])
    response = sample.tokens[prompt_len : teacher_scored_length(args, sample)]
    return {**fields, "input_ids": list(fields["input_ids"]) + response}


async def reward_func(args, sample: Sample, **kwargs):
    """The teacher server's (`--rm-url`, else the --sglang-config model `teacher`; its /generate) answer for
    `sample.tokens` (up to a generated image pad, `teacher_scored_length`) scored prefill-only: its
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


def _unscored_tail(sample: Sample, scored: int) -> list[float]:
    """Stand-ins for the teacher's log-probs of the response tokens from a generated image pad on (the teacher
    cannot be sent that pad with the images, `teacher_scored_length`): the engine's own log-probs of those tokens, so
    their OPD term is student - engine, 0 with --use-rollout-logprobs (no teacher signal there)."""
    global _warned_pad_in_response
    rollout = sample.rollout_log_probs
    if rollout is None or len(rollout) != sample.response_length:
        raise ValueError(
            f"sample {sample.index}: its response holds the image-pad token at response position {scored}, which the "
            "OPD teacher would read as one more image; the tokens from there on are given the engine's log-probs "
            "instead, but the sample has none for its whole response (rollout_log_probs)"
        )
    if not _warned_pad_in_response:
        _warned_pad_in_response = True
        logger.warning(
            "OPD: sample %d's response holds the image-pad token at response position %d; the teacher scores it up "
            "to there (a generated pad sent with the images reads as one more image) and the remaining %d token(s) "
            "take the engine's log-probs (no teacher signal). Logged once.",
            sample.index,
            scored,
            sample.response_length - scored,
        )
    return [float(x) for x in rollout[scored:]]


def post_process_rewards(args, samples: list[Sample], **kwargs):
    """(raw_rewards, rewards), both 0.0 per sample: the learning signal is the teacher's log-probs, stored here in
    `sample.teacher_log_probs` (response tokens only; from a generated image pad on, the engine's, see
    `teacher_scored_length`). For a task reward on top, wrap this function and return your own rewards after
    calling it."""
    for sample in samples:
        reward = sample.get_reward_value(args)
        if not isinstance(reward, dict) or "meta_info" not in reward:
            raise TypeError(
                f"sample {sample.index}: its reward is not the OPD teacher's answer; pass --custom-rm-path "
                "slime.rollout.on_policy_distillation.reward_func with this post-process function"
            )
        scored = teacher_scored_length(args, sample) - (len(sample.tokens) - sample.response_length)
        teacher = teacher_response_log_probs(reward, scored).tolist()
        if scored < sample.response_length:
            teacher += _unscored_tail(sample, scored)
        sample.teacher_log_probs = teacher
    rewards = [0.0] * len(samples)
    return rewards, rewards


def task_reward_logged_only(args, samples: list[Sample], **kwargs):
    """(raw_rewards, rewards) for `--opd-type megatron` without a task reward to train on: the task reward as
    measured (logged as `rollout/raw_reward`) and 0.0 per sample for the estimator, so each token's advantage is
    the OPD term alone, -coef * (student - teacher log-prob)."""
    return [sample.get_reward_value(args) for sample in samples], [0.0] * len(samples)
