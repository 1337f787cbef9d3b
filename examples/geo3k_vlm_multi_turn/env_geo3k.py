"""Geometry3k with a scoring tool: the model may call `calc_score` with its answer and hear whether it is right.

A turn that calls no tool ends the episode. A turn whose call names another tool or gives no answer gets a hint; a
scored call gets its score and what to do next. The episode also ends after `max_turns` turns (--custom-config-path).
Calls are `<tool_call>{"name": "calc_score", "arguments": {"answer": "..."}}</tool_call>`; the last one in a turn
counts. The answer is graded as the math reward grades a response (`grade_answer_verl`), as given or boxed.
"""

from __future__ import annotations

import json
import logging
import re

from examples.geo3k_vlm_multi_turn.base_env import BaseInteractionEnv
from slime.rollout.rm_hub import grade_answer_verl

logger = logging.getLogger(__name__)

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
TOOL_NAMES = {"calc_score", "calc_geo3k_reward"}  # verl's name for the same tool is accepted too
HOW_TO_CALL = (
    'Call it as <tool_call>{"name": "calc_score", "arguments": {"answer": "<your answer>"}}</tool_call> '
    "to check your solution."
)


class Geo3kEnv(BaseInteractionEnv):
    def __init__(self, *, ground_truth: str | None = None, max_turns: int | None = None):
        self.ground_truth = None if ground_truth is None else str(ground_truth)
        self.max_turns = max_turns
        self.turn = 0
        self.tool_calls: list[dict] = []

    def reset(self):
        self.turn = 0
        self.tool_calls.clear()
        return {}, {"ground_truth_available": self.ground_truth is not None}

    def step(self, response_text: str):
        self.turn += 1
        last_turn = self.max_turns is not None and self.turn >= self.max_turns
        call = parse_tool_call(response_text)
        info = {"tool_call": call, "tool_executed": False}
        if call is None:
            return {"obs_str": "No tool call detected; ending the episode.", "role": "tool"}, True, info
        if call["name"] not in TOOL_NAMES:
            return {"obs_str": f"Tool `{call['name']}` does not exist. {HOW_TO_CALL}", "role": "tool"}, last_turn, info
        answer = str(call["arguments"].get("answer") or "").strip()
        if not answer:
            info["answer_missing"] = True
            return {"obs_str": f"The call gave no `answer`. {HOW_TO_CALL}", "role": "tool"}, last_turn, info
        score = self.score(answer)
        self.tool_calls.append({"name": call["name"], "answer": answer, "score": score})
        info.update(self.tool_calls[-1], tool_executed=True)
        return {"obs_str": self.feedback(score, answer), "role": "tool", "tool_score": score}, last_turn, info

    def score(self, answer: str) -> float:
        """1.0 when `answer`, as given or boxed, grades equal to the ground truth."""
        if not self.ground_truth:
            return 0.0
        candidates = [answer] if "\\boxed" in answer else [answer, f"\\boxed{{{answer}}}"]
        return float(any(grade_answer_verl(c, self.ground_truth) for c in candidates))

    def feedback(self, score: float, answer: str) -> str:
        if score == 1.0:
            return (
                f"calc_score result: 1.0. The answer '{answer}' is correct. Stop here and give the final solution "
                "in \\boxed{}."
            )
        # the warning comes one turn before the last, so the model still has a turn to act on it
        warn_from = None if self.max_turns is None else max(self.max_turns - 2, 0)
        text = f"calc_score result: 0.0. The answer '{answer}' is wrong; try another way rather than repeating it."
        if warn_from is not None and self.turn - 1 >= warn_from:
            text += " This is your last chance: do not call the tool again; end with Answer: \\boxed{your answer}."
        return text


def parse_tool_call(text: str) -> dict | None:
    """{"name", "arguments"} of the last well-formed tool call in `text` (arguments may be a JSON string), else None."""
    matches = TOOL_CALL.findall(text)
    if not matches:
        return None
    try:
        payload = json.loads(matches[-1])
        function = payload.get("function") or {}
        name = payload.get("name") or function.get("name")
        arguments = payload.get("arguments") or function.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
    except (json.JSONDecodeError, AttributeError) as e:
        logger.warning(f"malformed tool call {matches[-1][:200]!r}: {e}")
        return None
    if not name or not isinstance(arguments, dict):
        return None
    return {"name": name, "arguments": arguments}


def build_env(sample=None, args=None, **_):
    """The environment of one sample: its label is the ground truth (without one every score is 0)."""
    label = None if sample is None else sample.label
    if label is None:
        logger.warning("sample has no label: calc_score will always return 0")
    return Geo3kEnv(ground_truth=label, max_turns=args.max_turns)
