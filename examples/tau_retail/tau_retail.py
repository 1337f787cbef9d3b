"""A tau-bench-style environment: the policy serves a simulated customer with tools over a small store database.

`generate(args, sample, sampling_params)` is a slime custom generate function. An episode:

1. A user simulator opens with the customer's request. It is `ScriptedUser` (the task's fixed lines) or, when
   `TAU_USER_SIM_URL` is set, `ModelUser`: a model served beside the policy behind any OpenAI-compatible
   endpoint (an SGLang server, slime's CPU server), prompted with the task's instruction.
2. The policy answers through `slime.agent.adapters.OpenAIAdapter` with the store's tools. Each tool call runs
   on the episode's copy of the database and its result goes back; a reply without tool calls goes to the user,
   whose next line comes back, until the user says `###STOP###` or the step budget runs out.
3. Reward, as tau-bench scores it: 1.0 when the final database equals the one the task's reference actions
   produce from the same start, else 0. What the agent says is not scored, only what it did.

The session's turns become loss-masked samples (one per branch, sharing the prompt's rollout_id): the policy's
sampled spans train, the user's lines, tool results and templates do not.

Task (the sample's `metadata["task"]`): `user_turns` (the scripted customer's lines), `instruction` (the
simulated customer's goal, for `ModelUser`), `actions` (reference `[name, arguments]` calls), and optionally `db`
(the starting database; default `DEFAULT_DB`).
"""

import copy
import json
import logging
import os
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

MAX_STEPS = 8  # policy turns per episode
STOP = "###STOP###"
TOOL_PARSER, REASONING_PARSER = "qwen25", "qwen3"  # the Qwen3 family's formats
# Short on purpose: the CPU test's tiny policy has a 512-token context.
SYSTEM_PROMPT = "You are a store agent. Use the tools."
# The user simulator: a model served beside the policy (OpenAI-compatible base URL, e.g. http://host:port/v1),
# else the task's scripted lines.
USER_SIM = {
    "base_url": os.environ.get("TAU_USER_SIM_URL"),
    "model": os.environ.get("TAU_USER_SIM_MODEL", "user-sim"),
    "temperature": 0.0,
}

DEFAULT_DB = {
    "orders": {
        "A1": {"user": "ann", "item": "lamp", "status": "pending", "address": "1 Oak St"},
        "A2": {"user": "ann", "item": "desk", "status": "delivered", "address": "1 Oak St"},
        "B1": {"user": "bob", "item": "chair", "status": "pending", "address": "9 Elm St"},
    }
}


def _tool(name, description, **params):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": d} for k, d in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool("get_order", "Look up an order.", order_id="the order id"),
    _tool("cancel_order", "Cancel a pending order.", order_id="the order id"),
    _tool("change_address", "Change a pending order's address.", order_id="the order id", address="new address"),
]


class StoreEnv:
    """The episode's own copy of the database and the tools acting on it. A tool never raises: a bad call is
    an `error: ...` result for the model, and the episode goes on."""

    def __init__(self, db: dict | None = None):
        self.db = copy.deepcopy(DEFAULT_DB if db is None else db)

    def call(self, name: str, arguments) -> str:
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                return f"error: the arguments are not JSON ({e.msg})"
        if not isinstance(arguments, dict):
            return "error: the arguments must be an object"
        fn = {"get_order": self.get_order, "cancel_order": self.cancel_order, "change_address": self.change_address}
        if name not in fn:
            return f"error: unknown tool {name!r}"
        try:
            return fn[name](**arguments)
        except TypeError as e:  # missing or unexpected arguments
            return f"error: {e}"

    def _order(self, order_id):
        order = self.db["orders"].get(str(order_id))
        if order is None:
            raise LookupError(f"error: no order {order_id!r}")
        return order

    def get_order(self, order_id):
        try:
            return json.dumps({"order_id": order_id, **self._order(order_id)})
        except LookupError as e:
            return str(e)

    def cancel_order(self, order_id):
        try:
            order = self._order(order_id)
        except LookupError as e:
            return str(e)
        if order["status"] != "pending":
            return f"error: order {order_id} is {order['status']}; only pending orders can be cancelled"
        order["status"] = "cancelled"
        return json.dumps({"order_id": order_id, "status": "cancelled"})

    def change_address(self, order_id, address):
        try:
            order = self._order(order_id)
        except LookupError as e:
            return str(e)
        if order["status"] != "pending":
            return f"error: order {order_id} is {order['status']}; only pending orders can be changed"
        order["address"] = str(address)
        return json.dumps({"order_id": order_id, "address": order["address"]})


def expected_db(task: dict) -> dict:
    """The database the task's reference actions produce from the task's start."""
    env = StoreEnv(task.get("db"))
    for name, arguments in task["actions"]:
        env.call(name, arguments)
    return env.db


def reward(env: StoreEnv, task: dict) -> float:
    return 1.0 if env.db == expected_db(task) else 0.0


class ScriptedUser:
    """The customer's fixed lines, one per agent reply; STOP once they run out."""

    def __init__(self, turns: list[str]):
        self.turns = list(turns)
        self.said = 0

    async def reply(self, agent_text: str | None) -> str:
        if self.said >= len(self.turns):
            return STOP
        self.said += 1
        return self.turns[self.said - 1]

    async def close(self):
        pass


class ModelUser:
    """A customer played by a model behind an OpenAI-compatible endpoint, given the task's instruction.

    Its conversation is the agent's with the roles swapped: the agent's replies are its `user` turns, its own
    lines are `assistant` turns. It is not trained (it is not the policy's session); it ends the episode by
    saying STOP, or when it has spoken max_turns times.
    """

    def __init__(self, base_url: str, model: str, instruction: str, *, temperature=0.0, max_turns=MAX_STEPS):
        self.client = openai.AsyncOpenAI(api_key="user-sim", base_url=base_url, max_retries=1)
        self.model, self.temperature, self.max_turns = model, temperature, max_turns
        self.messages = [
            {
                "role": "system",
                "content": f"You are a customer talking to a store agent. Your goal: {instruction} "
                f"Say one short line at a time. When your goal is met, say {STOP}.",
            }
        ]
        self.said = 0

    async def reply(self, agent_text: str | None) -> str:
        if self.said >= self.max_turns:
            return STOP
        self.messages.append({"role": "user", "content": agent_text or "Hi! How can I help you today?"})
        r = await self.client.chat.completions.create(
            model=self.model, messages=self.messages, temperature=self.temperature, max_tokens=128
        )
        text = (r.choices[0].message.content or "").strip()
        self.messages.append({"role": "assistant", "content": text})
        self.said += 1
        return STOP if STOP in text or not text else text

    async def close(self):
        await self.client.close()


class UserSimError(Exception):
    """The user simulator's endpoint failed: the episode ends (it is not the policy's fault, nor an abort)."""


async def _user_says(user, agent_text: str | None) -> str:
    try:
        return await user.reply(agent_text)
    except openai.APIError as e:
        raise UserSimError(str(e)) from e


def make_user(task: dict):
    if USER_SIM["base_url"]:
        return ModelUser(
            USER_SIM["base_url"], USER_SIM["model"], task["instruction"], temperature=USER_SIM["temperature"]
        )
    return ScriptedUser(task["user_turns"])


_state = {}


def _adapter(args):
    """One adapter per rollout process, serving on a background thread, over the router."""
    if "adapter" not in _state:
        adapter = OpenAIAdapter(
            tokenizer=AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True),
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


async def generate(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    task = sample.metadata["task"]
    adapter, url = _adapter(args)
    session_id = f"tau-{sample.index}-{uuid.uuid4().hex[:8]}"
    defaults = {k: v for k, v in sampling_params.items() if v is not None}
    max_context = (args.eval_max_context_len if evaluation else args.rollout_max_context_len) or 0
    adapter.open_session(session_id, sampling_defaults=defaults, max_context_tokens=max_context)
    client = openai.AsyncOpenAI(api_key=session_id, base_url=url + "/v1", max_retries=0)
    env, user = StoreEnv(task.get("db")), make_user(task)
    tool_log, user_turns, error, aborted, stopped = [], 0, None, False, False
    try:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": await _user_says(user, None)},
        ]
        for _ in range(MAX_STEPS):
            r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if msg.tool_calls:
                for call in msg.tool_calls:
                    result = env.call(call.function.name, call.function.arguments)
                    tool_log.append(
                        {"name": call.function.name, "arguments": call.function.arguments, "result": result}
                    )
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
                continue
            said = await _user_says(user, msg.content or "")
            if said == STOP:
                stopped = True
                break
            user_turns += 1
            messages.append({"role": "user", "content": said})
    except UserSimError as e:
        error = f"the user simulator failed: {e}"
        logger.warning("tau_retail session %s ended early: %s", session_id, error)
    except openai.APIStatusError as e:  # e.g. the history outgrew the context: the episode ends, its turns train
        error, aborted = e.message, e.status_code == 503  # 503: the engine aborted (the rollout is stopping)
        logger.warning("tau_retail session %s ended early: %s", session_id, error)
    finally:
        await client.close()
        await user.close()
    if aborted:  # an unfinished episode is not scored; the rollout treats the prompt as aborted
        adapter.drop_session(session_id, "the engine aborted the episode")
        sample.status = Sample.Status.ABORTED
        return [sample]
    samples = await adapter.finish_session(
        session_id,
        base_sample=sample,
        reward=reward(env, task),
        extra_metadata={
            "tool_log": tool_log,
            "tool_errors": sum(t["result"].startswith("error:") for t in tool_log),
            "user_turns": user_turns,
            "user_stopped": stopped,
            "final_db": env.db,
            "error": error,
        },
    )
    if not samples:
        raise RuntimeError(f"tau_retail session {session_id} produced no turn: {error}")
    return samples
