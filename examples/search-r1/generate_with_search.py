"""Search-R1 on slime: a multi-turn custom generate function with a search tool, and its exact-match reward.

    PYTHONPATH=examples/search-r1 python train.py ... \
        --custom-generate-function-path generate_with_search.generate \
        --custom-rm-path generate_with_search.reward_func

Each turn the policy writes `<think>...</think>` and then either `<search> query </search>` (the retriever's top
passages come back inside `<information>...</information>`) or `<answer> ... </answer>`. Tokens the model wrote get
loss mask 1; retrieved passages and correction hints get loss mask 0, so the policy is never trained to produce them.
"""

import asyncio
import os
import re

from qa_em_format import compute_score_em

from slime.utils.http_utils import post
from slime.utils.lora_utils import generate_fields
from slime.utils.sampling_record import record_segment
from slime.utils.types import Sample

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = "examples/search-r1 generate_with_search.generate"  # a sampling record's source
SEARCH_R1_CONFIGS = {
    "max_turns": 3,
    "topk": 3,
    # None: the bundled BM25 retriever over `corpus_path`. A URL: Search-R1's retrieval server (see README.md).
    "retriever_url": os.environ.get("SEARCH_R1_RETRIEVER_URL"),
    "corpus_path": os.environ.get("SEARCH_R1_CORPUS", os.path.join(HERE, "data", "toy_corpus.jsonl")),
    "search_concurrency": 256,
    # reward: 1 for an exact match, format_score for a well-formed wrong answer
    "format_score": 0.2,
}
INVALID_ACTION_HINT = (
    "\nMy previous action is invalid. If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. Let me try again.\n"
)

_cache = {}


def _tokenizer(args):
    if "tokenizer" not in _cache:
        from transformers import AutoTokenizer

        _cache["tokenizer"] = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
    return _cache["tokenizer"]


def _semaphore():
    # created lazily inside the running loop (a module-level Semaphore would bind the import-time loop)
    if "semaphore" not in _cache:
        _cache["semaphore"] = asyncio.Semaphore(SEARCH_R1_CONFIGS["search_concurrency"])
    return _cache["semaphore"]


def _passages2string(retrieval_result) -> str:
    out = ""
    for idx, item in enumerate(retrieval_result):
        content = item["document"]["contents"]
        title, _, text = content.partition("\n")
        out += f"Doc {idx + 1}(Title: {title}) {text}\n"
    return out


async def search(query: str) -> str:
    topk = SEARCH_R1_CONFIGS["topk"]
    url = SEARCH_R1_CONFIGS["retriever_url"]
    if url:
        out = await post(url, {"queries": [query], "topk": topk, "return_scores": True})
        return _passages2string(out["result"][0])
    if "retriever" not in _cache:
        from local_retriever import BM25Retriever

        _cache["retriever"] = BM25Retriever(SEARCH_R1_CONFIGS["corpus_path"])
    return _passages2string(_cache["retriever"].search(query, topk))


def postprocess_responses(resp: str) -> str:
    """Cut the turn right after its first action: text after </search> or </answer> was never seen by the tool."""
    if "</search>" in resp:
        return resp.split("</search>")[0] + "</search>"
    if "</answer>" in resp:
        return resp.split("</answer>")[0] + "</answer>"
    return resp


def postprocess_predictions(prediction: str):
    match = re.search(r"<(search|answer)>(.*?)</\1>", prediction, re.DOTALL)
    if match:
        return match.group(1), match.group(2).strip()
    return None, ""


async def execute_predictions(prediction: str):
    """(next observation, done) for one model turn."""
    action, content = postprocess_predictions(prediction)
    if action == "search":
        async with _semaphore():
            results = await search(content)
        return f"\n\n<information>{results.strip()}</information>\n\n", False
    if action == "answer":
        return "", True
    return INVALID_ACTION_HINT, False


async def generate(args, sample: Sample, sampling_params) -> Sample:
    if getattr(args, "partial_rollout", False):
        raise ValueError("generate_with_search does not support --partial-rollout (turns cannot be resumed)")
    tokenizer = _tokenizer(args)
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    prompt = sample.prompt
    prompt_token_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response, response_token_ids, loss_mask = "", [], []
    finish = "stop"
    for _ in range(SEARCH_R1_CONFIGS["max_turns"]):
        payload = {"text": prompt + response, "sampling_params": sampling_params, **generate_fields(args)}
        output = await post(url, payload)
        finish = output["meta_info"]["finish_reason"]["type"]
        if finish == "abort":
            sample.status = Sample.Status.ABORTED
            return sample
        cur = postprocess_responses(output["text"])
        cur_ids = tokenizer(cur, add_special_tokens=False)["input_ids"]
        # what this turn was sampled with, the adapter included (checked before training: sampling_provenance)
        start = len(response_token_ids)
        record_segment(
            sample,
            output["meta_info"],
            sampling_params,
            start=start,
            end=start + len(cur_ids),
            source=SOURCE,
            body=payload,
        )
        response += cur
        response_token_ids += cur_ids
        loss_mask += [1] * len(cur_ids)
        if finish == "length":
            break
        next_obs, done = await execute_predictions(cur)
        if done:
            break
        obs_ids = tokenizer(next_obs, add_special_tokens=False)["input_ids"]
        response += next_obs
        response_token_ids += obs_ids
        loss_mask += [0] * len(obs_ids)

    sample.tokens = prompt_token_ids + response_token_ids
    sample.response_length = len(response_token_ids)
    sample.response = response
    sample.loss_mask = loss_mask
    sample.status = {"length": Sample.Status.TRUNCATED, "stop": Sample.Status.COMPLETED}.get(finish, sample.status)
    return sample


async def reward_func(args, sample, **kwargs):
    """Exact match of the response's last <answer> against label["ground_truth"]["target"] (format score 0.2)."""
    if not isinstance(sample, Sample):
        raise TypeError(
            f"reward_func scores one Sample (do not combine it with --group-rm), got {type(sample).__name__}"
        )
    return compute_score_em(
        response=sample.response,
        ground_truth=sample.label["ground_truth"],
        format_score=SEARCH_R1_CONFIGS["format_score"],
    )
