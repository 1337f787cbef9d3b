"""LLM-as-judge reward: a frozen judge model, served beside the policy by `--sglang-config` under the name `judge`,
scores each response (see README.md).

The judge is asked whether the response answers the question correctly, and the reward is its probability of
"Yes" against "No" for the next token: P(Yes) / (P(Yes) + P(No)), in [0, 1]. Both probabilities come from two
prefill-only requests to the judge's router (no token is generated), so the reward is deterministic and does not
depend on the judge's sampling settings.

Use: --custom-rm-path examples.llm_as_judge.judge_rm.reward_func
"""

import functools
import math

from transformers import AutoTokenizer

from slime.backends.sglang_utils.sglang_config import get_model_url
from slime.utils.http_utils import post
from slime.utils.types import Sample

JUDGE = "judge"  # the judge's name in --sglang-config

TEMPLATE = (
    "You are grading an answer.\nQuestion: {question}\nReference answer: {label}\nGiven answer: {response}\n"
    "Is the given answer correct? Reply Yes or No.\nVerdict:"
)


def judge_path(args) -> str:
    """The judge's model directory (its tokenizer), from --sglang-config."""
    for m in args.served_models or []:
        if m.name == JUDGE:
            return m.model_path
    raise KeyError(f"no model named {JUDGE!r} in --sglang-config; the judge reward needs one (update_weights: false)")


@functools.lru_cache(maxsize=4)
def _tokenizer(path):
    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


def judge_prompt(sample: Sample) -> str:
    question = sample.prompt if isinstance(sample.prompt, str) else sample.prompt[-1]["content"]
    return TEMPLATE.format(question=question, label=sample.label, response=sample.response.strip())


def verdict_ids(tokenizer) -> tuple[list, int, int]:
    """(shared prefix, Yes token, No token): the first tokens where " Yes" and " No" differ, and what precedes them
    (nothing for a real tokenizer, where each is one token; a byte-level toy tokenizer spells the space first)."""
    yes, no = (tokenizer.encode(w, add_special_tokens=False) for w in (" Yes", " No"))
    n = 0
    while yes[n] == no[n]:
        n += 1
    return yes[:n], yes[n], no[n]


async def _log_prob(url: str, prompt_ids: list, token: int) -> float:
    """The judge's log-probability of `token` right after `prompt_ids` (prefill only)."""
    answer = await post(
        url,
        {
            "input_ids": prompt_ids + [token],
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt_ids) - 1,
        },
    )
    return answer["meta_info"]["input_token_logprobs"][-1][0]


async def reward_func(args, sample: Sample, **kwargs) -> float:
    tokenizer = _tokenizer(judge_path(args))
    url = get_model_url(args, JUDGE, "/generate")
    prefix, yes, no = verdict_ids(tokenizer)
    prompt_ids = tokenizer.encode(judge_prompt(sample), add_special_tokens=False) + prefix
    lp_yes, lp_no = await _log_prob(url, prompt_ids, yes), await _log_prob(url, prompt_ids, no)
    return 1.0 / (1.0 + math.exp(lp_no - lp_yes))
