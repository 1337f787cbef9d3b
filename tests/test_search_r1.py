"""examples/search-r1: reward, retriever, and the multi-turn generate function's tokens and loss masks.

The tiny model cannot be made to emit <search> tags, so the search/answer branch is driven by scripted engine replies;
the invalid-action branch runs against slime's real CPU inference server.
"""

import asyncio
import itertools
import json
import os

import pytest

from slime.utils.types import Sample
from tests._args import make_args
from tests.test_cpu_server import start_cpu_server, stop_cpu_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "search-r1")


@pytest.fixture()
def gws(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLE)
    import generate_with_search

    generate_with_search._cache.clear()
    yield generate_with_search
    generate_with_search._cache.clear()


def test_exact_match_reward(gws):
    from prepare_data import TEMPLATE

    prompt = TEMPLATE.format(question="What is the capital of France?")
    gt = {"ground_truth": {"target": ["Paris", "City of Paris"]}}

    def score(response):
        return asyncio.run(gws.reward_func(None, Sample(prompt=prompt, response=response, label=gt)))

    assert score("<think>easy</think><answer> The paris! </answer>") == 1.0  # articles, case, punctuation ignored
    assert score("<answer>Lyon</answer>") == 0.2  # well-formed but wrong: format score
    assert score("Paris") == 0.0  # no answer tag of its own (the instruction's example tags do not count)
    assert score("<answer>Lyon</answer> <answer>city of Paris</answer>") == 1.0  # the last answer counts


def test_postprocessing(gws):
    assert (
        gws.postprocess_responses("<think>a</think><search> q </search> junk <answer>x</answer>")
        == "<think>a</think><search> q </search>"
    )
    assert gws.postprocess_responses("<answer>x</answer> trailing") == "<answer>x</answer>"
    assert gws.postprocess_responses("no tags") == "no tags"
    assert gws.postprocess_predictions("<search> capital of France </search>") == ("search", "capital of France")
    assert gws.postprocess_predictions("<answer>\nParis\n</answer>") == ("answer", "Paris")
    assert gws.postprocess_predictions("<search>unclosed") == (None, "")


def test_bm25_retriever(gws):
    from local_retriever import BM25Retriever

    r = BM25Retriever(os.path.join(EXAMPLE, "data", "toy_corpus.jsonl"))
    hits = r.search("capital of France", topk=3)
    assert hits[0]["document"]["contents"].startswith('"Paris"')
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    assert r.search("the of is", topk=3) == []  # only stopwords: nothing matches
    text = asyncio.run(gws.search("Who painted the Mona Lisa?"))
    assert text.startswith('Doc 1(Title: "Leonardo da Vinci") Leonardo da Vinci was an Italian polymath')


def test_retriever_url_posts_search_r1_requests(gws, monkeypatch):
    """SEARCH_R1_RETRIEVER_URL set: each search is one POST of Search-R1's retrieval-server request, its passages
    formatted as the BM25 ones are, and the bundled retriever is never built."""
    from tests.test_upstream_examples import _Retriever

    retriever = _Retriever()
    try:
        monkeypatch.setitem(gws.SEARCH_R1_CONFIGS, "retriever_url", retriever.url)
        text = asyncio.run(gws.search("capital of France"))
    finally:
        retriever.close()
    assert retriever.bodies == [{"queries": ["capital of France"], "topk": 3, "return_scores": True}]
    assert text == "".join(f"Doc {i + 1}(Title: Doc {i}) The answer is 5.\n" for i in range(3))
    assert "retriever" not in gws._cache


def _runs(mask):
    """[(mask value, run length), ...]"""
    return [(k, len(list(g))) for k, g in itertools.groupby(mask)]


def test_search_turns_and_loss_masks(gws, tiny_kit, monkeypatch):
    model_dir, _ = tiny_kit
    replies = iter(
        [
            {
                "text": "<think>I need facts</think><search> capital of France </search> ignored tail",
                "meta_info": {"finish_reason": {"type": "stop"}},
            },
            {
                "text": "<think>found it</think><answer> Paris </answer>",
                "meta_info": {"finish_reason": {"type": "stop"}},
            },
        ]
    )
    sent = []

    async def scripted_engine(url, payload, **kw):
        sent.append((url, payload))
        return next(replies)

    monkeypatch.setattr(gws, "post", scripted_engine)
    args = make_args(hf_checkpoint=model_dir, sglang_router_ip="127.0.0.1", sglang_router_port=1)
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    label = {"ground_truth": {"target": ["Paris"]}}
    sample = asyncio.run(gws.generate(args, Sample(prompt=prompt, label=label), {"max_new_tokens": 64}))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    turn1 = "<think>I need facts</think><search> capital of France </search>"
    info = asyncio.run(gws.search("capital of France"))
    obs = f"\n\n<information>{info.strip()}</information>\n\n"
    turn2 = "<think>found it</think><answer> Paris </answer>"
    assert sample.response == turn1 + obs + turn2
    assert sample.status == Sample.Status.COMPLETED
    # the second request continues the first: prompt + model turn + retrieved information
    assert sent[0][1]["text"] == prompt and sent[1][1]["text"] == prompt + turn1 + obs
    assert sent[0][0] == "http://127.0.0.1:1/generate"
    n1, n_obs, n2 = (len(tok(t, add_special_tokens=False)["input_ids"]) for t in (turn1, obs, turn2))
    assert _runs(sample.loss_mask) == [(1, n1), (0, n_obs), (1, n2)]
    assert sample.response_length == n1 + n_obs + n2 == len(sample.loss_mask)
    prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
    assert len(sample.tokens) == prompt_len + sample.response_length
    masked_out = [t for t, m in zip(sample.tokens[prompt_len:], sample.loss_mask) if m == 0]
    assert tok.decode(masked_out) == obs  # the retrieved passages are exactly the tokens excluded from the loss
    assert "Paris is the capital and largest city of France" in obs
    assert asyncio.run(gws.reward_func(args, sample)) == 1.0
    # each model turn records what it was sampled with and the adapter it named (none: the base model)
    recs = sample.metadata["sampling_params"]
    assert [r["response_span"] for r in recs] == [[0, n1], [n1 + n_obs, n1 + n_obs + n2]]
    assert [r["lora_path"] for r in recs] == [None, None]

    with pytest.raises(ValueError, match="partial-rollout"):
        asyncio.run(gws.generate(make_args(hf_checkpoint=model_dir, partial_rollout=True), Sample(), {}))


@pytest.fixture()
def cpu_server(tiny_kit):
    proc, url = start_cpu_server(tiny_kit[0], "--random-seed", "3")
    try:
        yield int(url.rsplit(":", 1)[1])
    finally:
        stop_cpu_server(proc)


@pytest.mark.timeout(240)
def test_invalid_actions_against_cpu_server(gws, tiny_kit, cpu_server):
    model_dir, data_dir = tiny_kit
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    args = make_args(hf_checkpoint=model_dir, sglang_router_ip="127.0.0.1", sglang_router_port=cpu_server)
    with open(os.path.join(data_dir, "train.jsonl")) as f:
        messages = json.loads(f.readline())["prompt"]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # stop on most token ids after 2 tokens: short turns that end with "stop", so several turns happen
    params = {"max_new_tokens": 8, "min_new_tokens": 2, "temperature": 1.0, "stop_token_ids": list(range(3, 300))}
    hint_ids = tok(gws.INVALID_ACTION_HINT, add_special_tokens=False)["input_ids"]

    async def run_all():
        return await asyncio.gather(*(gws.generate(args, Sample(prompt=prompt), dict(params)) for _ in range(4)))

    from slime.utils.async_utils import run  # slime's persistent rollout loop (keeps one HTTP session)

    for s in run(run_all()):
        prompt_len = len(tok(prompt, add_special_tokens=False)["input_ids"])
        assert len(s.tokens) == prompt_len + s.response_length and len(s.loss_mask) == s.response_length
        # The random tiny model never writes a valid action, so every observation is the correction hint: rebuild
        # the expected mask from the response text, turn by turn (a turn may even be empty).
        turns = s.response.split(gws.INVALID_ACTION_HINT)
        expected = []
        for i, turn in enumerate(turns):
            expected += [1] * len(tok(turn, add_special_tokens=False)["input_ids"])
            expected += [0] * len(hint_ids) if i < len(turns) - 1 else []
        assert s.loss_mask == expected
        n_hints = len(turns) - 1
        if s.status == Sample.Status.TRUNCATED:
            assert n_hints < gws.SEARCH_R1_CONFIGS["max_turns"]  # a turn cut by max_new_tokens ends the episode
        else:
            assert s.status == Sample.Status.COMPLETED and n_hints == gws.SEARCH_R1_CONFIGS["max_turns"]
