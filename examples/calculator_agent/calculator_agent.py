"""A tool-calling math agent: the policy answers with the help of a calculator tool, through the OpenAI SDK.

`generate(args, sample, sampling_params)` is a slime custom generate function. It serves the policy to a plain
OpenAI-client agent loop through `slime.agent.adapters.OpenAIAdapter` (one per rollout process, on its own thread),
runs the loop -- the model calls `calculator`, the tool result goes back, until it answers -- and returns the
session's loss-masked samples (one per branch; they share a rollout_id). Reward: 1.0 when the final answer
contains the label's number, else 0; every sample of the episode gets it.

`generate_rollout` (for `--rollout-function-path`) is slime's default rollout plus the agent's own per-rollout
metrics -- `agent/tool_call_rate` (the share of episodes that called the calculator) and the reward with and
without the tool -- logged beside `rollout/raw_reward` (and to `--metrics-path`).

Every branch of an episode trains: an episode whose history the chat template re-renders differently from what was
sampled (say the model wrote text after its tool call) comes back as several samples sharing its rollout_id, and a
turn shared by two branches is trained in the first one only (often the tool-call turn), so keeping only one branch
would drop turns. The trainer counts an episode's samples as one rollout (fan-out training: one optimizer step, one
data-parallel rank, the episode's tokens averaged together).
"""

import ast
import json
import logging
import operator
import re
import uuid

import openai
from transformers import AutoTokenizer

from slime.agent.adapters import OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.backends.sglang_utils.router import router_url
from slime.rollout import RolloutSamples
from slime.rollout.base_types import accepts_data_buffer
from slime.rollout.sglang_rollout import generate_rollout as default_generate_rollout
from slime.utils.lora_utils import generate_fields
from slime.utils.top_p_replay import sampling_is_truncated
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

MAX_TURNS = 4
TOOL_PARSER, REASONING_PARSER = "qwen25", "qwen3"  # the Qwen3 family's formats
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """+ - * / // % and parentheses on numbers; anything else is an error message for the model, not an exception."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        value = ev(ast.parse(str(expression)[:200], mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def reward(answer: str, label) -> float:
    numbers = re.findall(r"-?\d+(?:\.\d+)?", answer or "")
    return 1.0 if numbers and numbers[-1] == str(label).strip() else 0.0


_state = {}


def _adapter(args):
    """One adapter per rollout process, serving on a background thread, over the router."""
    if "adapter" not in _state:
        tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
        adapter = OpenAIAdapter(
            tokenizer=tokenizer,
            sglang_url=router_url(args),  # the adapter records each turn itself: no hop through the proxy
            tool_parser=TOOL_PARSER,
            reasoning_parser=REASONING_PARSER,
            generate_fields=generate_fields(args),
            # top-p replay: each turn's kept token sets, asked of a worker directly (the router drops the field)
            return_kept_sets=sampling_is_truncated(args),
            worker_api_key=args.sglang_api_key,
        )
        _state["adapter"], _state["handle"] = adapter, run_app_in_thread(adapter.app)
    return _state["adapter"], _state["handle"].url


async def generate(args, sample: Sample, sampling_params) -> list[Sample]:
    adapter, url = _adapter(args)
    session_id = f"calc-{sample.index}-{uuid.uuid4().hex[:8]}"
    # the rollout's sampling settings; the adapter sets the token-output ones itself
    defaults = {k: v for k, v in sampling_params.items() if v is not None}
    adapter.open_session(session_id, sampling_defaults=defaults)
    client = openai.AsyncOpenAI(api_key=session_id, base_url=url + "/v1", max_retries=0)
    prompt = sample.prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    answer, tool_calls, tool_errors, error, aborted = "", 0, 0, None, False
    try:
        for _ in range(MAX_TURNS):
            r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                answer = msg.content or ""
                break
            for call in msg.tool_calls:
                tool_calls += 1
                try:
                    expression = json.loads(call.function.arguments).get("expression", "")
                except (json.JSONDecodeError, AttributeError):
                    expression = ""
                result = calculate(expression)
                tool_errors += result.startswith("error:")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.APIStatusError as e:  # e.g. the history outgrew the context: the episode ends, its turns train
        error, aborted = e.message, e.status_code == 503  # 503: the engine aborted (the rollout is stopping)
        logger.warning("calculator agent session %s ended early: %s", session_id, error)
    finally:
        await client.close()
    if aborted:  # an unfinished episode is not scored; the rollout treats the prompt as aborted
        adapter.drop_session(session_id, "the engine aborted the episode")
        sample.status = Sample.Status.ABORTED
        return [sample]
    samples = await adapter.finish_session(
        session_id,
        base_sample=sample,
        reward=reward(answer, sample.label),
        extra_metadata={"tool_calls": tool_calls, "tool_errors": tool_errors, "answer": answer, "error": error},
    )
    if not samples:
        raise RuntimeError(f"calculator agent session {session_id} produced no turn: {error}")
    return samples


def tool_metrics(samples: list[Sample]) -> dict:
    """Per-rollout agent metrics over the rollout's episodes (the samples `generate` made carry `tool_calls`; an
    episode's branches share its rollout_id, tool count and reward)."""
    scored = list({s.rollout_id: s for s in samples if "tool_calls" in s.metadata}.values())
    if not scored:
        return {}
    with_tool = [s.reward for s in scored if s.metadata["tool_calls"] > 0]
    without = [s.reward for s in scored if s.metadata["tool_calls"] == 0]
    metrics = {"agent/tool_call_rate": len(with_tool) / len(scored)}
    if with_tool:
        metrics["agent/reward_with_tool"] = sum(with_tool) / len(with_tool)
    if without:
        metrics["agent/reward_without_tool"] = sum(without) / len(without)
    return metrics


@accepts_data_buffer
def generate_rollout(args, rollout_id, data_source, evaluation=False):
    out = default_generate_rollout(args, rollout_id, data_source, evaluation)
    if evaluation:
        return out
    # every branch of every episode is kept (they share the episode's rollout_id: fan-out training)
    return RolloutSamples(list(out), metrics={**out.metrics, **tool_metrics(list(_leaves(out)))})


def _leaves(groups):
    """The samples of a rollout's groups; `generate` returns a list per prompt (one sample per branch)."""
    for g in groups:
        if isinstance(g, Sample):
            yield g
        else:
            yield from _leaves(g)
