"""Multi-agent RL: solver / rewriter / selector agents share one policy, and every agent's turn trains it.

`generate_with_multi_agents(args, sample, sampling_params)` is a slime custom generate function. For one problem:

1. `num_parallel` solver agents answer it independently.
2. `num_parallel` rewriter agents each read every solution and write an improved one.
3. One selector agent reads the rewritten solutions and picks one (`Judgment: <k>`).

Each agent call is an OpenAI Chat Completions request to `slime.agent.adapters.OpenAIAdapter` in its own session,
so each becomes one loss-masked `Sample` with the engine's sampled ids and log-probs. The function returns them
all (a fan-out `list[Sample]`); they share the prompt's `rollout_id`, so the trainer treats them as one rollout.

Rewards: a solver or rewriter sample scores 1 when its `Answer:` equals the label; the selector scores what the
solution it picked scores (0 when it names none). Then every reward of the episode is scaled by
`correct_reward_weight` when the selector's pick is right, else by `incorrect_reward_weight`, so the whole team
shares the outcome. An episode whose solvers all fail stops there (solver samples only, scaled as incorrect).
"""

import asyncio
import dataclasses
import logging
import re
import uuid

import openai
from transformers import AutoTokenizer

from slime.agent.adapters import OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.backends.sglang_utils.router import router_url
from slime.utils.lora_utils import generate_fields
from slime.utils.top_p_replay import sampling_is_truncated
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

MULTI_AGENT_CONFIGS = {
    "num_parallel": 3,  # solver calls, and rewriter calls
    "incorrect_reward_weight": 0.8,
    "correct_reward_weight": 1.2,
}

# Short on purpose: the CPU test's tiny policy has a 512-token context. Any instructions work.
SOLVER_PROMPT = "Solve the problem. End with: Answer: <number>"
REWRITER_PROMPT = "Rewrite the solutions into one better solution. End with: Answer: <number>"
SELECTOR_PROMPT = "Pick the best solution. Reply: Judgment: <solution number>"

_ANSWER = re.compile(r"Answer:\s*(\S+)")
_JUDGMENT = re.compile(r"Judgment:\s*(\d+)")


def answer_of(text: str) -> str | None:
    found = _ANSWER.findall(text or "")
    return found[-1].rstrip(".") if found else None


def is_correct(text: str, label) -> float:
    return 1.0 if answer_of(text) == str(label).strip() else 0.0


def selected_index(text: str, num_candidates: int) -> int | None:
    """The 0-based solution the selector picked, or None when it named none (or one that does not exist)."""
    found = _JUDGMENT.findall(text or "")
    if not found:
        return None
    k = int(found[0]) - 1
    return k if 0 <= k < num_candidates else None


def listing(problem: str, solutions: list[str]) -> str:
    return "\n".join([f"Problem: {problem}", *(f"Solution {i + 1}: {s}" for i, s in enumerate(solutions))])


@dataclasses.dataclass
class AgentCall:
    role: str  # "solver" | "rewriter" | "selector"
    session_id: str
    text: str = ""  # the reply's visible text ("" when the call failed)
    error: str | None = None
    aborted: bool = False  # the engine aborted it: the rollout is stopping
    reward: float = 0.0


def assign_rewards(calls: list[AgentCall], label, config: dict) -> list[AgentCall]:
    """Score every call of the episode in place (see the module docstring); returns the calls that train."""
    solvers = [c for c in calls if c.role == "solver"]
    rewriters = [c for c in calls if c.role == "rewriter"]
    selectors = [c for c in calls if c.role == "selector"]
    for c in solvers + rewriters:
        c.reward = is_correct(c.text, label)
    candidates = [c for c in rewriters if c.text]
    picked_right = False
    for c in selectors:
        k = selected_index(c.text, len(candidates))
        c.reward = candidates[k].reward if k is not None else 0.0
        picked_right = c.reward == 1.0
    weight = config["correct_reward_weight"] if picked_right else config["incorrect_reward_weight"]
    for c in calls:
        c.reward *= weight
    return calls


_state = {}


def _adapter(args):
    """One adapter per rollout process, serving on a background thread, over the router."""
    if "adapter" not in _state:
        adapter = OpenAIAdapter(
            tokenizer=AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True),
            sglang_url=router_url(args),  # the adapter records each turn itself: no hop through the proxy
            reasoning_parser="qwen3",  # the Qwen3 family's <think> format; the agents use no tools
            generate_fields=generate_fields(args),
            # top-p replay: each turn's kept token sets, asked of a worker directly (the router drops the field)
            return_kept_sets=sampling_is_truncated(args),
            worker_api_key=args.sglang_api_key,
        )
        _state["adapter"], _state["handle"] = adapter, run_app_in_thread(adapter.app)
    return _state["adapter"], _state["handle"].url


async def _ask(adapter, url, call: AgentCall, system: str, user: str, defaults: dict, max_context: int) -> AgentCall:
    adapter.open_session(call.session_id, sampling_defaults=defaults, max_context_tokens=max_context)
    client = openai.AsyncOpenAI(api_key=call.session_id, base_url=url + "/v1", max_retries=0)
    try:
        r = await client.chat.completions.create(
            model="policy", messages=[{"role": "system", "content": system}, {"role": "user", "content": user}]
        )
        call.text = r.choices[0].message.content or ""
    except openai.APIStatusError as e:  # e.g. the listing outgrew the context: this agent failed, the rest go on
        call.error, call.aborted = e.message, e.status_code == 503
        logger.warning("multi-agent %s call %s failed: %s", call.role, call.session_id, e.message)
    finally:
        await client.close()
    return call


async def generate_with_multi_agents(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    config = MULTI_AGENT_CONFIGS
    adapter, url = _adapter(args)
    defaults = {k: v for k, v in sampling_params.items() if v is not None}
    max_context = (args.eval_max_context_len if evaluation else args.rollout_max_context_len) or 0
    prompt = sample.prompt
    problem = (
        prompt if isinstance(prompt, str) else next(m["content"] for m in reversed(prompt) if m["role"] == "user")
    )
    tag = f"ma-{sample.index}-{uuid.uuid4().hex[:8]}"
    calls: list[AgentCall] = []

    async def stage(role, n, system, user):
        batch = [AgentCall(role, f"{tag}-{role}{k}") for k in range(n)]
        calls.extend(batch)
        return await asyncio.gather(*(_ask(adapter, url, c, system, user, defaults, max_context) for c in batch))

    solutions = [c.text for c in await stage("solver", config["num_parallel"], SOLVER_PROMPT, problem) if c.text]
    if solutions and not any(c.aborted for c in calls):
        rewrites = await stage("rewriter", config["num_parallel"], REWRITER_PROMPT, listing(problem, solutions))
        candidates = [c.text for c in rewrites if c.text]
        if candidates and not any(c.aborted for c in calls):
            await stage("selector", 1, SELECTOR_PROMPT, listing(problem, candidates))

    if any(c.aborted for c in calls):  # an unfinished episode is not scored; the rollout treats it as aborted
        for c in calls:
            adapter.drop_session(c.session_id, "the engine aborted the episode")
        sample.status = Sample.Status.ABORTED
        return [sample]
    samples = []
    for c in assign_rewards(calls, sample.label, config):
        samples += await adapter.finish_session(
            c.session_id,
            base_sample=sample,
            reward=c.reward,
            extra_metadata={"agent_role": c.role, "agent_text": c.text, "agent_error": c.error},
        )
    if not samples:
        raise RuntimeError(f"multi-agent episode {tag} produced no turn: {[c.error for c in calls]}")
    return samples
