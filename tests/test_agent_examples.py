"""The agent examples' tools, environments, rewards and launch scripts, for given model outputs.

The engine-driven runs (the real adapter, slime's CPU engine, a policy that makes the calls) are in
test_agent_adapters.py (calculator_agent) and test_agent_examples_engine.py (the others).
"""

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slime.agent.sandbox import LocalSandbox
from tests.test_scripts import _fake_base_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
for _name in ("calculator_agent", "multi_agent", "tau_retail", "coding_agent"):
    sys.path.insert(0, str(EXAMPLES / _name))
import calculator_agent  # noqa: E402
import coding_agent  # noqa: E402
import rollout_with_multi_agents as multi_agent  # noqa: E402
import tau_retail  # noqa: E402


@pytest.mark.parametrize(
    "expr, out",
    [("3+4", "7"), ("12*5", "60"), ("(2+3)*-4", "-20"), ("7/2", "3.5"), ("1/3", "0.333333"), ("9//2", "4")],
)
def test_calculator_evaluates_arithmetic(expr, out):
    assert calculator_agent.calculate(expr) == out


@pytest.mark.parametrize("expr", ["__import__('os').system('x')", "1/0", "2**3", "x+1", "(", "True+1"])
def test_calculator_reports_errors_to_the_model(expr):
    assert calculator_agent.calculate(expr).startswith("error:")


def test_reward_is_the_last_number_against_the_label():
    assert calculator_agent.reward("3+4 is 7", "7") == 1.0
    assert calculator_agent.reward("7? no, 8", "7") == 0.0
    assert calculator_agent.reward("", "7") == 0.0


# (script, data file under BASE_DIR it reads, rows to write there; None: _fake_base_dir has it)
LAUNCH_SCRIPTS = [
    (
        "calculator_agent/run_qwen3_4b.sh",
        "calculator_agent/train.jsonl",
        [{"prompt": [{"role": "user", "content": "What is 2*3?"}], "label": "6"}],
    ),
    ("multi_agent/run_qwen3_4b.sh", "dapo-math-17k/dapo-math-17k.jsonl", None),
    ("tau_retail/run_qwen3_4b.sh", "tau_retail/train.jsonl", "tau_retail"),
    ("coding_agent/run_qwen3_4b.sh", "coding_agent/train.jsonl", "coding_agent"),
]


@pytest.mark.parametrize("script, data, rows", LAUNCH_SCRIPTS, ids=[s[0].split("/")[0] for s in LAUNCH_SCRIPTS])
def test_launch_script_dry_run_validates(script, data, rows, tmp_path):
    """The example's launch script's arguments parse and validate (SLIME_DRY_RUN: no Ray, no GPU)."""
    base = tmp_path / "root"
    _fake_base_dir(base)
    if isinstance(rows, str):  # the example's own prepare_data.py writes it
        subprocess.run(
            [sys.executable, str(EXAMPLES / rows / "prepare_data.py"), str(base / data), "--num", "3"], check=True
        )
    elif rows is not None:
        (base / data).parent.mkdir(parents=True)
        (base / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = dict(
        os.environ, SLIME_DRY_RUN="1", BASE_DIR=str(base), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    out = subprocess.run(["bash", str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"


# ---------------------------------------------------------------- multi_agent


def test_multi_agent_parses_answers_and_judgments():
    assert multi_agent.answer_of("2+3=5. Answer: 5.") == "5"
    assert multi_agent.answer_of("Answer: 4, no wait. Answer: 5") == "5"
    assert multi_agent.answer_of("5") is None
    assert multi_agent.selected_index("Judgment: 2", 3) == 1
    assert multi_agent.selected_index("Judgment: 4", 3) is None  # no such solution
    assert multi_agent.selected_index("the second", 3) is None


def _calls(*specs):
    return [multi_agent.AgentCall(role, f"s{i}", text) for i, (role, text) in enumerate(specs)]


def test_multi_agent_rewards_scale_the_team_by_the_selectors_pick():
    cfg = {"num_parallel": 2, "incorrect_reward_weight": 0.8, "correct_reward_weight": 1.2}
    # solver 1 right, solver 2 wrong; rewriter 1 wrong, rewriter 2 right; the selector picks rewrite 2 (right)
    calls = _calls(
        ("solver", "Answer: 5"),
        ("solver", "Answer: 6"),
        ("rewriter", "Answer: 4"),
        ("rewriter", "Answer: 5"),
        ("selector", "Judgment: 2"),
    )
    assert [c.reward for c in multi_agent.assign_rewards(calls, "5", cfg)] == [1.2, 0.0, 0.0, 1.2, 1.2]
    # the selector picks rewrite 1 (wrong): it scores 0, the team is scaled down
    calls = _calls(("solver", "Answer: 5"), ("rewriter", "Answer: 4"), ("rewriter", "Answer: 5"), ("selector", "1"))
    calls[-1].text = "Judgment: 1"
    assert [c.reward for c in multi_agent.assign_rewards(calls, "5", cfg)] == [0.8, 0.0, 0.8, 0.0]
    # a failed rewriter (no text) is not a candidate: "Judgment: 1" is the first rewrite that exists
    calls = _calls(("solver", "Answer: 5"), ("rewriter", ""), ("rewriter", "Answer: 5"), ("selector", "Judgment: 1"))
    assert [c.reward for c in multi_agent.assign_rewards(calls, "5", cfg)] == [1.2, 0.0, 1.2, 1.2]
    # no selector ran (the episode stopped after the solvers): scaled as incorrect
    calls = _calls(("solver", "Answer: 5"), ("solver", ""))
    assert [c.reward for c in multi_agent.assign_rewards(calls, "5", cfg)] == [0.8, 0.0]


# ---------------------------------------------------------------- tau_retail


def test_tau_retail_tools_act_on_the_episodes_database():
    env = tau_retail.StoreEnv()
    assert json.loads(env.call("get_order", '{"order_id": "A1"}'))["status"] == "pending"
    assert env.call("cancel_order", {"order_id": "A1"}) == '{"order_id": "A1", "status": "cancelled"}'
    assert env.db["orders"]["A1"]["status"] == "cancelled"
    assert tau_retail.DEFAULT_DB["orders"]["A1"]["status"] == "pending"  # the episode's copy, not the default
    assert env.call("change_address", '{"order_id": "B1", "address": "5 Ash Rd"}') == (
        '{"order_id": "B1", "address": "5 Ash Rd"}'
    )
    assert env.db["orders"]["B1"]["address"] == "5 Ash Rd"
    before = json.dumps(env.db, sort_keys=True)
    assert env.call("cancel_order", '{"order_id": "A2"}').startswith("error: order A2 is delivered")
    assert env.call("get_order", '{"order_id": "Z9"}') == "error: no order 'Z9'"
    assert env.call("cancel_order", "{not json").startswith("error: the arguments are not JSON")
    assert env.call("cancel_order", "{}").startswith("error:")  # missing order_id
    assert env.call("refund", "{}") == "error: unknown tool 'refund'"
    assert json.dumps(env.db, sort_keys=True) == before  # failed calls change nothing


def test_tau_retail_reward_is_the_final_database_against_the_reference_actions():
    task = {"actions": [["cancel_order", {"order_id": "A1"}]], "user_turns": ["Cancel my order A1."]}
    right, wrong, idle = tau_retail.StoreEnv(), tau_retail.StoreEnv(), tau_retail.StoreEnv()
    right.call("get_order", {"order_id": "A1"})  # reading changes nothing
    right.call("cancel_order", {"order_id": "A1"})
    wrong.call("cancel_order", {"order_id": "B1"})
    assert (tau_retail.reward(right, task), tau_retail.reward(wrong, task), tau_retail.reward(idle, task)) == (
        1.0,
        0.0,
        0.0,
    )
    # a request the store must refuse: the right outcome is an untouched database
    refuse = {"actions": [], "user_turns": ["Cancel A2."]}
    assert tau_retail.reward(tau_retail.StoreEnv(), refuse) == 1.0
    overreach = tau_retail.StoreEnv()
    overreach.call("cancel_order", {"order_id": "A1"})
    assert tau_retail.reward(overreach, refuse) == 0.0


def test_tau_retail_scripted_user_speaks_its_lines_then_stops():
    user = tau_retail.ScriptedUser(["Cancel A1.", "Thanks."])

    async def go():
        return [await user.reply(None), await user.reply("Done."), await user.reply("Anything else?")]

    assert asyncio.run(go()) == ["Cancel A1.", "Thanks.", tau_retail.STOP]
    assert isinstance(tau_retail.make_user({"user_turns": ["x"], "instruction": "y"}), tau_retail.ScriptedUser)


# ---------------------------------------------------------------- coding_agent

TASK = {
    "files": {"mathx.py": "def add(a, b):\n    return a - b\n"},
    "tests": {"test_mathx.py": "from mathx import add\nassert add(2, 3) == 5\n"},
    "test_cmd": "python3 test_mathx.py",
}
FIXED = "def add(a, b):\n    return a + b\n"


def test_coding_agent_tools_edit_and_run_in_the_sandbox(monkeypatch):
    monkeypatch.setattr(coding_agent, "TOOL_TIMEOUT_S", 1.0)

    async def go():
        async with LocalSandbox() as sb:
            for path, text in {**TASK["files"], **TASK["tests"]}.items():
                await sb.write_file(path, text)
            events = [
                await coding_agent.run_tool(sb, "run", '{"command": "python3 test_mathx.py"}'),
                await coding_agent.run_tool(sb, "read_file", '{"path": "mathx.py"}'),
                await coding_agent.run_tool(sb, "write_file", json.dumps({"path": "mathx.py", "content": FIXED})),
                await coding_agent.run_tool(sb, "run", '{"command": "python3 test_mathx.py && echo passed"}'),
                await coding_agent.run_tool(sb, "run", '{"command": "sleep 30"}'),
                await coding_agent.run_tool(sb, "read_file", '{"path": "../../etc/passwd"}'),
                await coding_agent.run_tool(sb, "read_file", '{"path": "nope.py"}'),
                await coding_agent.run_tool(sb, "write_file", '{"path": "x.py"}'),
                await coding_agent.run_tool(sb, "delete", "{}"),
            ]
            return events, await coding_agent.collect_candidate(sb, TASK)

    events, candidate = asyncio.run(go())
    failing, read, wrote, passing, hung, escape, missing, no_content, unknown = events
    assert failing["result"].startswith("exit 1\n") and "AssertionError" in failing["result"]
    assert read["result"] == TASK["files"]["mathx.py"]
    assert wrote["result"] == f"wrote {len(FIXED)} bytes to mathx.py"
    assert passing["result"] == "exit 0\npassed"
    assert hung["timed_out"] and hung["result"] == "error: timed out after 1s"
    assert not any(e["timed_out"] for e in events if e is not hung)
    assert "outside the sandbox" in escape["result"]
    assert missing["result"].startswith("error:")
    assert no_content["result"] == "error: missing argument 'content'"
    assert unknown["result"] == "error: unknown tool 'delete'"
    assert candidate == {"mathx.py": FIXED}


def test_coding_agent_is_graded_by_the_tasks_tests_in_a_clean_sandbox(monkeypatch):
    monkeypatch.setattr(coding_agent, "GRADE_TIMEOUT_S", 2.0)
    assert asyncio.run(coding_agent.grade(TASK, {"mathx.py": FIXED}))[0] == 1.0
    reward, graded = asyncio.run(coding_agent.grade(TASK, {}))  # the untouched bug
    assert reward == 0.0 and graded["returncode"] == 1 and "AssertionError" in graded["output"]
    # the agent's own copy of the tests is not what grades it
    assert asyncio.run(coding_agent.grade(TASK, {"test_mathx.py": "pass\n"}))[0] == 0.0
    reward, graded = asyncio.run(coding_agent.grade(TASK, {"mathx.py": "while True:\n    pass\n"}))
    assert reward == 0.0 and graded["timed_out"]
