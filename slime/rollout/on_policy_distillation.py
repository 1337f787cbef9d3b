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
def _image_token_ids(hf_checkpoint):
    """(image pad, <|vision_start|>) token ids of the checkpoint's processor."""
    processor = load_processor(hf_checkpoint)
    return processor.image_token_id, processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")


def _teacher_cut(args, sample: Sample) -> tuple[int, int]:
    """(how many leading tokens of `sample.tokens` the teacher is sent, how many of its images they hold). An image's
    tokens are a pad run right after <|vision_start|>, one per image in order (the prompt's, then an environment's
    observations in the response); any other pad in the response is one the model generated (a tiny model sampling
    at temperature 1 does). SGLang (transformers' processor, `_expand_input_ids`) and slime's CPU server
    (`media.expand`) read every pad id in `input_ids` as an image placeholder, so a generated pad cannot be sent as
    the text token it was: the teacher scores the sample up to it (`post_process_rewards` fills the rest)."""
    images = len((sample.multimodal_inputs or {}).get("images") or ())
    if not images:
        return len(sample.tokens), 0
    pad, start = _image_token_ids(args.hf_checkpoint)
    tokens, runs = sample.tokens, 0
    prompt_len = len(tokens) - sample.response_length
    for i, t in enumerate(tokens):
        if t != pad or (i and tokens[i - 1] == pad):  # not the first pad of a run
            continue
        if runs < images and i and tokens[i - 1] == start:
            runs += 1
        elif i >= prompt_len:
            return i, runs
    return len(tokens), runs


def teacher_scored_length(args, sample: Sample) -> int:
    """How many leading tokens of `sample.tokens` the teacher scores: all, or up to a generated image pad."""
    return _teacher_cut(args, sample)[0]


def teacher_prompt_fields(args, sample: Sample) -> dict:
    """The prompt part of the teacher request: `input_ids`, plus for a sample with images the images its scored
    tokens hold, each pad run collapsed to one pad (SGLang re-expands it), so the teacher scores `sample.tokens`
    position for position (up to a generated pad, `_teacher_cut`)."""
    length, images = _teacher_cut(args, sample)
    if not images:
        return {"input_ids": sample.tokens[:length]}
    pad, _ = _image_token_ids(args.hf_checkpoint)
    return image_prompt_fields(pad, sample.tokens[:length], sample.multimodal_inputs["images"][:images])


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
