"""OpenAI-compatible API of slime's CPU server: `/v1/completions` and `/v1/chat/completions`."""

import asyncio
import time
import uuid

from aiohttp import web

from slime.utils.sampling_record import openai_requested_adapter, openai_sampling_params

from .media import chat_images, expand, fetch_remote_images, images_per_prompt
from .sampling import RequestError, SamplingParams
from .scheduler import Req

# SGLang's ChatCompletionMessageParam: "user", or one of these (case-insensitive, lowered)
_GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")


def _with_checked_role(message):
    role = message["role"]
    if role == "user":
        return message
    if not isinstance(role, str) or role.lower() not in _GENERIC_ROLES:
        allowed = ", ".join(repr(r) for r in _GENERIC_ROLES)
        raise RequestError(f"'role' must be one of {allowed} (case-insensitive), or 'user'; got {role!r}.")
    return {**message, "role": role.lower()}


class OpenAIAPI:
    """`/v1/completions` and `/v1/chat/completions` over the same scheduler as `/generate`."""

    def _openai_sampling(self, b, prompt_len, model_defaults, chat):
        """SGLang's sampling parameters for an OpenAI request (`model_defaults`: what a chat request takes from the
        model's generation_config.json where it sends nothing; {} for /v1/completions)."""
        if chat:  # SGLang: `max_completion_tokens or max_tokens`, else up to the context
            max_tokens = b.get("max_completion_tokens") or b.get("max_tokens")
        else:  # CompletionRequest.max_tokens: 16 unless sent, and positive
            max_tokens = b.get("max_tokens")
            max_tokens = 16 if max_tokens is None else max_tokens
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
                raise RequestError("max_tokens must be positive")
        sp = {
            "max_new_tokens": max_tokens if max_tokens is not None else self.context_len - prompt_len - 1,
            "n": b.get("n", 1),
            "stop": b.get("stop"),
            "stop_token_ids": b.get("stop_token_ids"),
            "sampling_seed": b.get("seed"),
            **openai_sampling_params(b, model_defaults),
        }
        for k in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if k in b:
                sp[k] = b[k]
        return {k: v for k, v in sp.items() if v is not None}

    def _token_logprob(self, token_id, logprob):
        text = self.tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _finish_str(self, r):
        return {"stop": "stop", "length": "length", "abort": "abort"}[r.finish_reason["type"]]

    async def _openai_run(self, b, ids, model_defaults, mm=None, chat=True):
        if b.get("stream"):
            raise RequestError("stream=true is not supported by slime's CPU server's OpenAI endpoints")
        if b.get("echo"):
            raise RequestError("echo=true is not supported by slime's CPU server's OpenAI endpoints")
        sp = SamplingParams.from_dict(self._openai_sampling(b, len(ids), model_defaults, chat), self.cfg.vocab_size)
        self._check_prompt(ids, sp)
        if chat:  # SGLang: `logprobs` a boolean, `top_logprobs` how many alternatives
            want_lp, top_n = bool(b.get("logprobs")), b.get("top_logprobs") or 0
        else:  # `logprobs: N` both asks for log-probs (0 too) and for N alternatives
            want_lp, top_n = b.get("logprobs") is not None, b.get("logprobs") or 0
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise RequestError(
                f"{'top_logprobs' if chat else 'logprobs'} must be a non-negative integer, got {top_n!r}"
            )
        adapter = openai_requested_adapter(b, self.served_model_name)
        if isinstance(adapter, list):  # a list for one prompt: what SGLang's batch normalisation refuses
            raise RequestError(f"lora_path is a list of {len(adapter)}: it needs one entry per prompt (1)")
        reqs = [Req(ids, sp, return_logprob=want_lp, top_logprobs_num=top_n) for _ in range(sp.n)]
        for r, lora in zip(reqs, self._acquire_loras([adapter] * len(reqs))):
            r.mm, r.lora = mm, lora
        return await self._run(reqs)

    async def _chat_media(self, msgs):
        """(messages for the template, the images' processor inputs or None): image parts as SGLang takes them."""
        msgs, image_data = chat_images(msgs)
        if not image_data:
            return msgs, None
        if self.processor is None:
            raise RequestError(f"image parts: the served model ({self.cfg.architecture}) takes text only")
        body = await asyncio.to_thread(fetch_remote_images, {"image_data": image_data})
        return msgs, images_per_prompt(body, 1, False, self.cfg.model_type)[0]

    def _usage(self, prompt_len, reqs):
        """SGLang's UsageInfo (no reasoning parser, no --enable-cache-report: no details)."""
        c = sum(len(r.output_ids) for r in reqs)
        return {
            "prompt_tokens": prompt_len,
            "total_tokens": prompt_len + c,
            "completion_tokens": c,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def _response(self, b, kind, choices, prompt_len, reqs):
        """The response around `choices`, as SGLang builds it: the request's own `model` echoed, and the first
        choice's weight version (and its per-token spans) in `metadata`."""
        return web.json_response(
            {
                "id": uuid.uuid4().hex,
                "object": kind,
                "created": int(time.time()),
                "model": b.get("model", "default"),
                "choices": choices,
                "usage": self._usage(prompt_len, reqs),
                "metadata": self._versions(reqs[0]),
            }
        )

    async def v1_completions(self, request):
        b = await self._body(request)
        self._check_ready()
        prompt = b.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt
        else:
            raise RequestError("prompt must be a string or a list of token ids (batch prompts: send one request each)")
        reqs = await self._openai_run(b, ids, {}, chat=False)
        choices = []
        for i, r in enumerate(reqs):
            lp = None
            if r.return_logprob:  # SGLang's LogProbs: a {token: logprob} per position when asked, offsets unknown
                toks = [self.tokenizer.decode([t]) for t in r.output_ids]
                top = [{self.tokenizer.decode([t]): v for v, t, _ in row} for row in r.output_top_logprobs]
                lp = {
                    "tokens": toks,
                    "token_logprobs": r.output_logprobs,
                    "top_logprobs": top,
                    "text_offset": [-1] * len(toks),
                }
            choices.append(
                {
                    "index": i,
                    "text": r.text,
                    "logprobs": lp,
                    "finish_reason": self._finish_str(r),
                    "matched_stop": r.finish_reason.get("matched"),
                    # SGLang's return_token_ids: the sampled and the prompt's ids
                    **({"token_ids": r.output_ids, "prompt_token_ids": ids} if b.get("return_token_ids") else {}),
                }
            )
        return self._response(b, "text_completion", choices, len(ids), reqs)

    async def v1_chat_completions(self, request):
        b = await self._body(request)
        self._check_ready()
        msgs = b.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise RequestError("messages must be a non-empty list of {role, content} objects")
        msgs = [_with_checked_role(m) for m in msgs]
        kw = {"tools": b["tools"]} if b.get("tools") else {}
        msgs, images = await self._chat_media(msgs)
        try:
            ids = self.tokenizer.apply_chat_template(
                msgs, add_generation_prompt=True, tokenize=True, return_dict=False, **kw
            )
        except Exception as e:  # noqa: BLE001  (a template error is the client's message list)
            raise RequestError(f"the chat template could not render these messages: {e}") from None
        mm = None
        if images:
            ids, mm = expand(self.processor, list(ids), images, "the chat prompt")
        reqs = await self._openai_run(b, list(ids), self.chat_sampling_defaults, mm)
        want_prompt = b.get("return_prompt_token_ids") or b.get("return_token_ids")
        choices = []
        for i, r in enumerate(reqs):
            lp = None
            if r.return_logprob:
                tops = r.output_top_logprobs or [[] for _ in r.output_ids]
                lp = {
                    "content": [
                        {
                            **self._token_logprob(t, v),
                            "top_logprobs": [self._token_logprob(alt, alt_v) for alt_v, alt, _ in top],
                        }
                        for t, v, top in zip(r.output_ids, r.output_logprobs, tops)
                    ]
                }
            choices.append(
                {
                    "index": i,
                    # SGLang leaves a null tool_calls out
                    "message": {"role": "assistant", "content": r.text, "reasoning_content": None},
                    "logprobs": lp,
                    "finish_reason": self._finish_str(r),
                    "matched_stop": r.finish_reason.get("matched"),
                    # SGLang's return_prompt_token_ids / return_token_ids
                    **({"prompt_token_ids": list(ids)} if want_prompt else {}),
                    **({"response_token_ids": r.output_ids} if b.get("return_token_ids") else {}),
                }
            )
        return self._response(b, "chat.completion", choices, len(ids), reqs)
