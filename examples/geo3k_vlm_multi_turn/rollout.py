"""Multi-turn rollout with an environment that answers in text and images (current slime's `geo3k_vlm_multi_turn`).

    --custom-generate-function-path examples.geo3k_vlm_multi_turn.rollout.generate
    --custom-config-path examples/geo3k_vlm_multi_turn/geo3k_vlm_multi_turn_config.yaml

The config sets `max_turns` and `rollout_interaction_env_path`: a module path or a `.py` file whose
`build_env(sample=, args=)` returns an environment (`base_env.BaseInteractionEnv`); and optionally
`max_new_tokens_per_turn` (beyond current slime: unset, a turn may use the whole remaining budget). Each turn the policy answers,
`env.step` reads the answer, and `env.format_observation` turns the observation into the next user message, which
the chat template renders as one turn and the processor expands (its images' pad runs). The model's tokens train
(loss mask 1, the engine's log-probs); the observations' do not. The sample keeps every image in order
(`multimodal_inputs["images"]`) and their processor outputs (`multimodal_train_inputs`), so the trainer sees what the
engine saw. Each request sends the tokens so far with each image's pad run collapsed to one pad plus all images so
far, which SGLang re-expands (an expanded run is refused); the engine's prompt length is checked against the tokens.
An answer holding an image-pad id ends the episode (the engine would take it for another image; the trainer reads
it as text).
The response budget (--rollout-max-response-len) covers the model's and the observations' tokens.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from slime.backends.sglang_utils.router import router_url
from slime.rollout.sglang_rollout import GenerateState
from slime.utils.http_utils import post
from slime.utils.lora_utils import generate_fields
from slime.utils.processing_utils import (
    image_prompt_fields,
    merge_multimodal_inputs,
    process_prompt,
    process_vision_info,
)
from slime.utils.types import Sample

DEFAULT_ENV_MODULE = "examples.geo3k_vlm_multi_turn.env_geo3k"
# a conversation rendered before the observation, then cut off: what is left is the observation's own turn
DUMMY_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
]


def load_env_module(path: str | None):
    """The environment module: `path` as a `.py` file, else as a module path (default: the geo3k environment)."""
    target = path or DEFAULT_ENV_MODULE
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise FileNotFoundError(f"rollout_interaction_env_path {target}: no such file")
        name = f"rollout_env_{os.path.splitext(os.path.basename(target))[0]}"
        spec = importlib.util.spec_from_file_location(name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(target)


def encode_observation(state, message: dict, tools=None, chat_kwargs=None):
    """(token ids, images, processor outputs, text) of one environment message as the next chat turn."""
    render = state.tokenizer.apply_chat_template
    kwargs = dict(tools=tools, tokenize=False, **(chat_kwargs or {}))
    before = render(DUMMY_MESSAGES, add_generation_prompt=False, **kwargs)
    text = render(DUMMY_MESSAGES + [message], add_generation_prompt=True, **kwargs)
    if not text.startswith(before):
        raise ValueError("the chat template renders a conversation differently once a message follows it")
    text = text[len(before) :]
    images = (process_vision_info([message]) or {}).get("images", [])
    if not images:
        return state.tokenizer(text, add_special_tokens=False)["input_ids"], [], None, text
    if state.processor is None:
        raise ValueError("the environment sent images but --hf-checkpoint has no processor (--multimodal-keys)")
    ids, train_inputs = process_prompt(state.processor, text, images)
    return ids, images, train_inputs, text


async def generate(args, sample: Sample, sampling_params) -> Sample:
    """Up to `max_turns` policy turns, each followed by the environment's observation unless it is done."""
    if args.partial_rollout:
        raise ValueError("the multi-turn VLM rollout does not support --partial-rollout (turns cannot be resumed)")
    max_turns = getattr(args, "max_turns", None)
    if not max_turns:
        raise ValueError("the multi-turn VLM rollout needs max_turns, set in the --custom-config-path file")
    state = GenerateState(args)
    env = load_env_module(getattr(args, "rollout_interaction_env_path", None)).build_env(sample=sample, args=args)

    images = list((sample.multimodal_inputs or {}).get("images") or [])
    chunks = []
    if images:
        if not isinstance(sample.prompt, str) or state.processor is None:
            raise ValueError(
                f"sample {sample.index}: a prompt with images needs --apply-chat-template and a processor"
            )
        sample.tokens, train_inputs = process_prompt(state.processor, sample.prompt, images)
        chunks.append(train_inputs)
    else:
        sample.tokens = state.tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    budget = sampling_params["max_new_tokens"]
    per_turn = getattr(args, "max_new_tokens_per_turn", None)
    if args.rollout_max_context_len is not None:
        budget = min(budget, args.rollout_max_context_len - len(sample.tokens))
    url = f"{router_url(args)}/generate"
    try:
        env.reset()
        for turn in range(max_turns):
            left = budget - sample.response_length
            if left <= 0:
                sample.status = Sample.Status.TRUNCATED
                break
            params = {**sampling_params, "max_new_tokens": min(left, per_turn or left)}
            if images:
                prompt = image_prompt_fields(state.processor.image_token_id, sample.tokens, images)
            else:
                prompt = {"input_ids": sample.tokens}
            payload = {**prompt, "sampling_params": params, "return_logprob": True, **generate_fields(args)}
            output = await post(url, payload)
            meta = output["meta_info"]
            if meta.get("prompt_tokens", len(sample.tokens)) != len(sample.tokens):
                raise RuntimeError(
                    f"{url} read sample {sample.index}'s {len(sample.tokens)} tokens and {len(images)} image(s) as "
                    f"{meta['prompt_tokens']} tokens: the engine expands the images differently from the processor"
                )
            pairs = meta.get("output_token_logprobs") or []
            sample.append_response_tokens(
                args,
                tokens=[p[1] for p in pairs],
                log_probs=[p[0] for p in pairs],
                meta_info=meta,
                text=output["text"],
                sampling_params=params,
            )
            # an answer cut by max_new_tokens_per_turn (not by the budget or the context) still gets its observation
            cut_at_turn_cap = (
                sample.status == Sample.Status.TRUNCATED and len(pairs) == params["max_new_tokens"] < left
            )
            if not (sample.status == Sample.Status.COMPLETED or cut_at_turn_cap) or turn + 1 == max_turns:
                break
            if images and state.processor.image_token_id in (p[1] for p in pairs):
                break  # the engine would read a generated image pad as one more image: no next turn can be sent
            observation, done, _ = env.step(output["text"])
            if done:
                break
            ids, new_images, train_inputs, text = encode_observation(
                state,
                env.format_observation(observation),
                (sample.metadata or {}).get("tools"),
                args.apply_chat_template_kwargs,
            )
            if sample.response_length + len(ids) >= budget:  # no room left for the model to answer it
                sample.status = Sample.Status.TRUNCATED
                break
            sample.append_response_tokens(args, tokens=ids, trainable=False, text=text)
            images += new_images
            chunks.append(train_inputs)
    finally:
        env.close()
    if images:
        sample.multimodal_inputs = {**(sample.multimodal_inputs or {}), "images": images}
        sample.multimodal_train_inputs = merge_multimodal_inputs(chunks)
    return sample
