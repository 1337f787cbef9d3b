"""The agent examples' generate functions against slime's CPU engine, through the real adapter and sandbox.

The policy is the tiny Qwen3 kit fine-tuned (tests/_agent_kit.py) until greedy decoding reproduces the
conversations below, so each example takes a known path: the multi-agent team answers and picks, the store agent
cancels an order, the coding agent fixes a file and waits on a command that hangs. The tests
check the samples -- tokens, loss masks and log-probs against what the engine returned (and a transformers
forward), rollout ids, rewards -- and the environment state the rewards come from.
"""

import asyncio
import json
import sys
from pathlib import Path

import pytest

from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.backends.sglang_utils.router import ROUTING_KEY_HEADER
from slime.utils.types import Sample
from tests._agent_kit import build_agent_model
from tests._args import make_args
from tests.test_agent_adapters import Recorder, check_against_engine
from tests.test_cpu_server import start_cpu_server, stop_cpu_server

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
for _name in ("multi_agent", "tau_retail", "coding_agent"):
    sys.path.insert(0, str(EXAMPLES / _name))
import coding_agent  # noqa: E402
import rollout_with_multi_agents as multi_agent  # noqa: E402
import tau_retail  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


PROBLEM = "What is 2+3?"
SOLUTION, REWRITE = "2+3=5. Answer: 5", "Answer: 5"
CODE_TASK = {
    "files": {"mathx.py": "def add(a, b):\n    return a - b\n"},
    "tests": {"test_mathx.py": "from mathx import add\nassert add(2, 3) == 5\n"},
    "test_cmd": "python3 test_mathx.py",
}
FIXED = "def add(a, b):\n    return a + b\n"
ISSUE = "add in mathx.py is wrong; test_mathx.py must pass."

CONVERSATIONS = [
    # multi_agent with num_parallel=2: two solvers, two rewriters, one selector
    (
        None,
        [
            {"role": "system", "content": multi_agent.SOLVER_PROMPT},
            {"role": "user", "content": PROBLEM},
            {"role": "assistant", "content": SOLUTION},
        ],
    ),
    (
        None,
        [
            {"role": "system", "content": multi_agent.REWRITER_PROMPT},
            {"role": "user", "content": multi_agent.listing(PROBLEM, [SOLUTION, SOLUTION])},
            {"role": "assistant", "content": REWRITE},
        ],
    ),
    (
        None,
        [
            {"role": "system", "content": multi_agent.SELECTOR_PROMPT},
            {"role": "user", "content": multi_agent.listing(PROBLEM, [REWRITE, REWRITE])},
            {"role": "assistant", "content": "Judgment: 2"},
        ],
    ),
    # tau_retail: the customer asks, the agent cancels, reports, the scripted customer stops
    (
        tau_retail.TOOLS,
        [
            {"role": "system", "content": tau_retail.SYSTEM_PROMPT},
            {"role": "user", "content": "Cancel my order A1."},
            {"role": "assistant", "content": "", "tool_calls": [_call("cancel_order", order_id="A1")]},
            {"role": "tool", "content": '{"order_id": "A1", "status": "cancelled"}'},
            {"role": "assistant", "content": "Order A1 is cancelled."},
        ],
    ),
    # coding_agent: fix the file, run a command that hangs (timed out at 1 s), finish (the tiny model's context
    # is 512 tokens, and this tokenizer spends about one per character)
    (
        coding_agent.TOOLS,
        [
            {"role": "system", "content": coding_agent.SYSTEM_PROMPT},
            {"role": "user", "content": ISSUE},
            {"role": "assistant", "content": "", "tool_calls": [_call("write_file", path="mathx.py", content=FIXED)]},
            {"role": "tool", "content": f"wrote {len(FIXED)} bytes to mathx.py"},
            {"role": "assistant", "content": "", "tool_calls": [_call("run", command="sleep 30")]},
            {"role": "tool", "content": "error: timed out after 1s"},
            {"role": "assistant", "content": "Fixed."},
        ],
    ),
]


@pytest.fixture(scope="module")
def kit(tiny_kit, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_dir = build_agent_model(
        tiny_kit[0], str(tmp_path_factory.mktemp("agent_examples") / "model"), conversations=CONVERSATIONS
    )
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def stack(kit):
    proc, engine_url = start_cpu_server(kit[0], "--random-seed", "1")
    recorder = Recorder(engine_url)
    rec = run_app_in_thread(recorder.app)
    host, port = rec.url.removeprefix("http://").split(":")  # the recorder stands where the router would
    # the context limit lets the adapter cap each turn's generation to what the tiny model's 512-token context
    # has left (511: SGLang, and the CPU engine, refuse a prompt + completion of exactly the context length)
    args = make_args(
        hf_checkpoint=kit[0], sglang_router_ip=host, sglang_router_port=int(port), rollout_max_context_len=511
    )
    yield {"args": args, "recorder": recorder, "engine": engine_url}
    for module in (multi_agent, tau_retail, coding_agent):
        if "handle" in module._state:
            module._state.pop("handle").stop()
        module._state.clear()
    rec.stop()
    stop_cpu_server(proc)


SP = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 160, "stop": None}


def _calls_of(calls, session_id):
    return [c for c in calls if c[0].get(ROUTING_KEY_HEADER) == session_id]


def test_multi_agent_fans_out_one_sample_per_agent_call(stack, kit, monkeypatch):
    monkeypatch.setitem(multi_agent.MULTI_AGENT_CONFIGS, "num_parallel", 2)
    stack["recorder"].take()
    samples = asyncio.run(
        multi_agent.generate_with_multi_agents(stack["args"], Sample(index=7, prompt=PROBLEM, label="5"), SP)
    )
    calls = stack["recorder"].take()
    assert len(calls) == 5
    roles = [s.metadata["agent_role"] for s in samples]
    assert roles == ["solver", "solver", "rewriter", "rewriter", "selector"]
    assert [s.metadata["agent_text"] for s in samples] == [SOLUTION, SOLUTION, REWRITE, REWRITE, "Judgment: 2"]
    # every answer is right and the selector picked a right rewrite: 1.0 each, scaled by the correct weight
    assert [s.reward for s in samples] == [1.2] * 5
    # siblings of one prompt: one rollout id, one session (and one engine call) each
    assert {s.rollout_id for s in samples} == {7}
    assert len({s.session_id for s in samples}) == 5
    for s in samples:
        [call] = _calls_of(calls, s.session_id)
        assert s.loss_mask == [1] * s.response_length  # one turn: everything after the prompt was sampled
        check_against_engine(s, [call], kit[1])
    # the rewriter saw both solutions, the selector both rewrites
    rewriter_call = _calls_of(calls, samples[2].session_id)[0][1]
    tok = multi_agent._state["adapter"].tokenizer
    assert multi_agent.listing(PROBLEM, [SOLUTION, SOLUTION]) in tok.decode(rewriter_call["input_ids"])


def test_tau_retail_episode_is_scored_by_the_final_database(stack, kit):
    task = {
        "user_turns": ["Cancel my order A1."],
        "instruction": "You want order A1 cancelled.",
        "actions": [["cancel_order", {"order_id": "A1"}]],
    }
    stack["recorder"].take()
    samples = asyncio.run(
        tau_retail.generate(stack["args"], Sample(index=2, prompt="Cancel my order A1.", metadata={"task": task}), SP)
    )
    calls = stack["recorder"].take()
    [sample] = samples
    md = sample.metadata
    assert md["tool_log"] == [
        {
            "name": "cancel_order",
            "arguments": '{"order_id": "A1"}',
            "result": '{"order_id": "A1", "status": "cancelled"}',
        }
    ]
    assert md["final_db"]["orders"]["A1"]["status"] == "cancelled" and md["final_db"] == tau_retail.expected_db(task)
    assert (sample.reward, md["user_stopped"], md["user_turns"], md["tool_errors"]) == (1.0, True, 0, 0)
    assert md["agent"]["num_tool_calls"] == 1 and md["agent"]["turns"] == [0, 1]
    assert len(calls) == 2 and sample.rollout_id == 2
    check_against_engine(sample, calls, kit[1])
    # the tool result sits in the sample as context: present in the tokens, never trained
    tok = tau_retail._state["adapter"].tokenizer
    second_prompt = calls[1][1]["input_ids"]
    first_end = len(calls[0][1]["input_ids"]) + len(calls[0][2]["meta_info"]["output_token_logprobs"])
    prompt_len = len(calls[0][1]["input_ids"])
    assert '"status": "cancelled"' in tok.decode(second_prompt[first_end:])
    assert not any(sample.loss_mask[first_end - prompt_len : len(second_prompt) - prompt_len])


def test_tau_retail_user_simulator_can_be_a_served_model(stack):
    """ModelUser talks to any OpenAI-compatible endpoint (here the CPU engine's) with the roles swapped."""
    user = tau_retail.ModelUser(stack["engine"] + "/v1", "sim", "You want order A1 cancelled.")

    async def go():
        try:
            return await user.reply(None)
        finally:
            await user.close()

    said = asyncio.run(go())
    assert isinstance(said, str) and said
    system, opening, own = user.messages
    assert system["role"] == "system" and "You want order A1 cancelled." in system["content"]
    assert opening == {"role": "user", "content": "Hi! How can I help you today?"}
    assert own["role"] == "assistant" and (said == tau_retail.STOP or own["content"].strip() == said)


def test_coding_agent_fixes_the_file_survives_a_hanging_tool_and_is_graded_clean(stack, kit, monkeypatch):
    monkeypatch.setattr(coding_agent, "TOOL_TIMEOUT_S", 1.0)
    stack["recorder"].take()
    roots = []  # every sandbox the agent and the grader open (other workers' sandboxes share the temp dir)

    class RecordedSandbox(coding_agent.LocalSandbox):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            roots.append(self.root)

    monkeypatch.setattr(coding_agent, "LocalSandbox", RecordedSandbox)
    sample = Sample(index=5, prompt=ISSUE, metadata={"task": CODE_TASK})
    [sample] = asyncio.run(coding_agent.generate(stack["args"], sample, SP))
    calls = stack["recorder"].take()
    md = sample.metadata
    log = md["tool_log"]
    assert [(e["name"], json.loads(e["arguments"]), e["timed_out"]) for e in log] == [
        ("write_file", {"path": "mathx.py", "content": FIXED}, False),
        ("run", {"command": "sleep 30"}, True),
    ]
    assert [e["result"] for e in log] == [f"wrote {len(FIXED)} bytes to mathx.py", "error: timed out after 1s"]
    assert (md["tool_timeouts"], md["tool_errors"]) == (1, 1)
    # graded in a clean sandbox: the fixed file passes the task's tests
    assert sample.reward == 1.0 and md["grade"]["returncode"] == 0 and not md["grade"]["timed_out"]
    assert len(calls) == 3 and md["agent"]["num_tool_calls"] == 2
    check_against_engine(sample, calls, kit[1])
    # the agent's and the grader's sandboxes are gone
    assert len(roots) == 2 and not any(root.exists() for root in roots)
