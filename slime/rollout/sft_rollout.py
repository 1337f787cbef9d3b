"""SFT "rollout": tokenise chat transcripts with a loss mask on the assistant turns; no generation.

Use with `--rollout-function-path slime.rollout.sft_rollout.generate_rollout --input-key messages
--loss-type sft_loss --calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only`.
With `--multimodal-keys` a transcript's images and videos go to the trainer too: each image's pad, as the chat
template renders it, is expanded to the image's token count (untrained), as the processor expands it, and each video's
run to the processor's layout of it.
"""

import functools

from slime.rollout.base_types import accepts_data_buffer
from slime.utils.mask_utils import MultiTurnLossMaskGenerator
from slime.utils.processing_utils import expand_image_pads, load_processor
from slime.utils.types import Sample

_MASK_GENERATORS = {}  # (hf_checkpoint, loss_mask_type) -> MultiTurnLossMaskGenerator


def _mask_generator(args):
    key = (args.hf_checkpoint, args.loss_mask_type)
    if key not in _MASK_GENERATORS:
        from transformers import AutoTokenizer  # heavy

        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        _MASK_GENERATORS[key] = MultiTurnLossMaskGenerator(tokenizer, tokenizer_type=args.loss_mask_type)
    return _MASK_GENERATORS[key]


@functools.lru_cache(maxsize=2)
def _processor(hf_checkpoint):
    return load_processor(hf_checkpoint)


@accepts_data_buffer
def generate_rollout(args, rollout_id, data_source, evaluation=False):
    if evaluation:
        raise ValueError(
            "slime.rollout.sft_rollout has no eval mode; set --eval-function-path to a generating rollout"
        )
    if not args.rollout_global_dataset:
        raise ValueError("slime.rollout.sft_rollout reads the prompt dataset; remove --disable-rollout-global-dataset")
    mask_generator = _mask_generator(args)

    samples = data_source.get_samples(args.rollout_batch_size)
    for group in samples:
        if len(group) != 1:
            raise ValueError(f"SFT needs --n-samples-per-prompt 1, got groups of {len(group)}")
        (sample,) = group
        messages = sample.prompt
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise TypeError(
                f"SFT sample {sample.index}: the prompt must be a list of chat messages ({{'role', 'content'}}), got "
                f"{type(messages).__name__}. Point --input-key at the messages column and do not pass --apply-chat-template."
            )
        token_ids, loss_mask = mask_generator.get_loss_mask(messages, tools=(sample.metadata or {}).get("tools"))
        media = sample.multimodal_inputs or {}
        if media.get("images") or media.get("videos"):
            processor, train = _processor(args.hf_checkpoint), {}
            if media.get("images"):
                token_ids, loss_mask, train = _with_images(processor, sample, token_ids, loss_mask)
            if media.get("videos"):
                token_ids, loss_mask, videos = _with_videos(processor, sample, token_ids, loss_mask)
                train.update(videos)
            sample.multimodal_train_inputs = train
        response_length = mask_generator.get_response_lengths([loss_mask])[0]
        sample.tokens = list(token_ids)
        sample.response_length = response_length
        sample.loss_mask = list(loss_mask[len(loss_mask) - response_length :])
        sample.reward = 0
        sample.status = Sample.Status.COMPLETED
    return samples


def _with_images(processor, sample, token_ids, loss_mask):
    """(ids, loss mask, processor outputs) of a transcript with images: each image's one pad expanded to its
    grid's token count (t * h * w / merge_size^2), as the processor expands it, with loss mask 0."""
    images = sample.multimodal_inputs["images"]
    pad = processor.image_token_id
    if token_ids.count(pad) != len(images):
        raise ValueError(
            f"SFT sample {sample.index}: the chat template rendered {token_ids.count(pad)} image pad(s) for "
            f"{len(images)} image(s); each image must be rendered as one pad"
        )
    train_inputs, index = expand_image_pads(processor, token_ids, images)
    ids = [token_ids[i] for i in index]
    return ids, [0 if t == pad else loss_mask[i] for t, i in zip(ids, index)], dict(train_inputs)


def _with_videos(processor, sample, token_ids, loss_mask):
    """(ids, loss mask, processor outputs) of a transcript with videos: each video's run as the chat template renders
    it (<|vision_start|><|video_pad|><|vision_end|>) replaced by what the processor makes of that run and the video
    (sampled as SGLang samples it; Qwen3-VL's layout with a timestamp per frame pair), with loss mask 0."""
    from slime.utils.processing_utils import merge_multimodal_inputs, process_prompt

    videos = sample.multimodal_inputs["videos"]
    run = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", processor.video_token, "<|vision_end|>"])
    starts = [i for i in range(len(token_ids) - 2) if token_ids[i : i + 3] == run]
    if len(starts) != len(videos) or token_ids.count(run[1]) != len(videos):
        raise ValueError(
            f"SFT sample {sample.index}: the chat template rendered {token_ids.count(run[1])} video pad(s) for "
            f"{len(videos)} video(s); each video must be rendered as one <|vision_start|><|video_pad|><|vision_end|>"
        )
    ids, mask, outputs, last = [], [], [], 0
    for start, video in zip(starts, videos):
        expanded, out = process_prompt(
            processor, "<|vision_start|>" + processor.video_token + "<|vision_end|>", None, [video]
        )
        ids += token_ids[last:start] + expanded
        mask += list(loss_mask[last:start]) + [0] * len(expanded)
        outputs.append(out)
        last = start + 3
    return ids + token_ids[last:], mask + list(loss_mask[last:]), merge_multimodal_inputs(outputs)
