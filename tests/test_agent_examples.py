"""The agent examples' tools, environments, rewards and launch scripts, for given model outputs.

The engine-driven runs (the real adapter, slime's CPU engine, a policy that makes the calls) are in
test_agent_adapters.py (calculator_agent) and test_agent_examples_engine.py (the others).
"""

import asyncio
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from slime.agent.sandbox import LocalSandbox
from slime.utils.types import Sample
from tests.test_scripts import _fake_base_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
for _name in ("calculator_agent", "multi_agent", "tau_retail", "coding_agent"):
    sys.path.insert(0, str(EXAMPLES / _name))
import calculator_agent  # noqa: E402
import coding_agent  # noqa: E402
import prepare_tiny_data  # noqa: E402
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


def test_prepare_data_writes_problems_the_calculator_solves(tmp_path):
    """examples/calculator_agent/prepare_data.py: slime prompt rows (a user message, a label) whose label is what
    the agent's own calculator gives for the question's expression; the same seed writes the same file."""
    script = EXAMPLES / "calculator_agent" / "prepare_data.py"
    for name, seed in (("a", "1"), ("b", "1"), ("c", "2")):
        subprocess.run([sys.executable, str(script), str(tmp_path / name), "--n", "40", "--seed", seed], check=True)
    rows = [json.loads(line) for line in (tmp_path / "a").read_text().splitlines()]
    assert len(rows) == 40 and {"*" in r["prompt"][0]["content"] for r in rows} == {True}
    for r in rows:
        (msg,) = r["prompt"]
        assert msg["role"] == "user" and msg["content"].startswith("What is ")
        expr = msg["content"].removeprefix("What is ").split("?")[0]
        assert calculator_agent.calculate(expr) == r["label"]
        assert calculator_agent.reward(f"so it is {r['label']}", r["label"]) == 1.0
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text() != (tmp_path / "c").read_text()


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
def test_launch_script_dry_run_validates(script, data, rows, tmp_path, preimported_python):
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
    env = dict(os.environ, SLIME_DRY_RUN="1", BASE_DIR=str(base), **preimported_python.env)
    served = preimported_python.served()
    out = subprocess.run(["bash", str(EXAMPLES / script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"
    assert preimported_python.wait_served(served + 1) == served + 1  # its validator ran in the pre-imported server


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
    async def run_hanging(sb):
        # a short limit for the command that hangs only: on a loaded machine python3 alone can take seconds
        monkeypatch.setattr(coding_agent, "TOOL_TIMEOUT_S", 2.0)
        return await coding_agent.run_tool(sb, "run", '{"command": "sleep 30"}')

    async def go():
        async with LocalSandbox() as sb:
            for path, text in {**TASK["files"], **TASK["tests"]}.items():
                await sb.write_file(path, text)
            events = [
                await coding_agent.run_tool(sb, "run", '{"command": "python3 test_mathx.py"}'),
                await coding_agent.run_tool(sb, "read_file", '{"path": "mathx.py"}'),
                await coding_agent.run_tool(sb, "write_file", json.dumps({"path": "mathx.py", "content": FIXED})),
                await coding_agent.run_tool(sb, "run", '{"command": "python3 test_mathx.py && echo passed"}'),
                await run_hanging(sb),
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
    assert hung["timed_out"] and hung["result"] == "error: timed out after 2s"
    assert not any(e["timed_out"] for e in events if e is not hung)
    assert "outside the sandbox" in escape["result"]
    assert missing["result"].startswith("error:")
    assert no_content["result"] == "error: missing argument 'content'"
    assert unknown["result"] == "error: unknown tool 'delete'"
    assert candidate == {"mathx.py": FIXED}


def test_coding_agent_is_graded_by_the_tasks_tests_in_a_clean_sandbox(monkeypatch):
    assert asyncio.run(coding_agent.grade(TASK, {"mathx.py": FIXED}))[0] == 1.0
    reward, graded = asyncio.run(coding_agent.grade(TASK, {}))  # the untouched bug
    assert reward == 0.0 and graded["returncode"] == 1 and "AssertionError" in graded["output"]
    # the agent's own copy of the tests is not what grades it
    assert asyncio.run(coding_agent.grade(TASK, {"test_mathx.py": "pass\n"}))[0] == 0.0
    monkeypatch.setattr(coding_agent, "GRADE_TIMEOUT_S", 2.0)  # for the one that never ends only
    reward, graded = asyncio.run(coding_agent.grade(TASK, {"mathx.py": "while True:\n    pass\n"}))
    assert reward == 0.0 and graded["timed_out"]


# ---------------------------------------------------------------- calculator_agent: the watchable tiny CPU run


def _prepare_tiny(tiny_kit, tmp_path, *flags):
    model, data = tmp_path / "model", tmp_path / "data"
    prepare_tiny_data.main(["--base-model", tiny_kit[0], "--model-dir", str(model), "--data-dir", str(data), *flags])
    return model, data


def test_tiny_run_data_calls_the_tool_in_half_the_transcripts(tiny_kit, tmp_path):
    """Half the SFT transcripts call the tool (40 of 80) with the question's expression and answer with its result;
    problems are 2-digit additions with a 3-digit sum, each digit one token; and the system turn the transcripts carry
    renders to the same tokens as the agent's prompt with tools=[calculator], so SFT teaches exactly what the agent
    then samples."""
    from transformers import AutoTokenizer

    model, data = _prepare_tiny(tiny_kit, tmp_path, "--num-sft", "80", "--num-train", "10", "--num-eval", "6")
    sft = [json.loads(line) for line in (data / "sft.jsonl").read_text().splitlines()]
    train = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    evaluation = [json.loads(line) for line in (data / "eval.jsonl").read_text().splitlines()]
    tool = [r for r in sft if any(m.get("tool_calls") for m in r["messages"])]
    assert (len(sft), len(tool), len(train), len(evaluation)) == (80, 40, 10, 6)
    a, b = tool[0]["messages"][1]["content"][len("What is ") : -1].split("+")
    assert tool[0]["messages"][3] == {"role": "tool", "content": str(int(a) + int(b))}
    assert tool[0]["messages"][4] == {"role": "assistant", "content": str(int(a) + int(b))}
    direct = next(r for r in sft if not any(m.get("tool_calls") for m in r["messages"]))["messages"]
    p, q = direct[1]["content"][len("What is ") : -1].split("+")
    assert direct[2:] == [{"role": "assistant", "content": str(int(p) + int(q))}]
    for row in train + evaluation:
        x, y = row["prompt"][0]["content"][len("What is ") : -1].split("+")
        assert row["label"] == str(int(x) + int(y)) and 50 <= int(x) <= 99 and 50 <= int(y) <= 99
        assert 100 <= int(row["label"]) <= 198

    tok = AutoTokenizer.from_pretrained(str(model))
    msgs = tool[0]["messages"]
    full = tok.apply_chat_template(msgs, tokenize=False)
    agent_prompt = tok.apply_chat_template(
        msgs[1:2], tools=[calculator_agent.CALCULATOR], tokenize=False, add_generation_prompt=True
    )
    assert full.startswith(agent_prompt)
    call = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{a}+{b}"}}}}\n</tool_call>'
    assert full[len(agent_prompt) :].startswith(call + "<|im_end|>\n<|im_start|>user\n<tool_response>\n")
    # digits are single tokens, so copying a number is copying a fixed count of tokens
    assert tok.tokenize(f"{a}+{b}") == [a[0], a[1], "+", b[0], b[1]]


def test_tool_metrics_are_the_rate_and_the_reward_with_and_without_the_tool():
    def sample(episode, calls, reward):
        return Sample(rollout_id=episode, reward=reward, metadata={"tool_calls": calls})

    # episode 1 came back as two branches: it counts once
    samples = [sample(0, 1, 1.0), sample(1, 2, 0.0), sample(1, 2, 0.0), sample(2, 0, 0.0), sample(3, 0, 1.0)]
    samples += [sample(4, 0, 0.0), Sample(rollout_id=5, reward=1.0)]
    assert calculator_agent.tool_metrics(samples) == {
        "agent/tool_call_rate": 2 / 5,
        "agent/reward_with_tool": 0.5,
        "agent/reward_without_tool": 1 / 3,
    }
    assert calculator_agent.tool_metrics([Sample(reward=1.0)]) == {}


def test_every_branch_of_an_episode_is_trained(monkeypatch):
    """One group of three episodes: episode 2 came back as two branches (the model wrote text after its tool call,
    so the history re-rendered differently); its first branch holds the tool-call turn, trained there only. Both
    branches reach the trainer (fan-out: they share the episode's rollout_id), and the episode counts once in the
    agent metrics."""
    from slime.rollout import RolloutSamples

    meta = {"tool_calls": 1}
    plain, single = Sample(rollout_id=0, tokens=[1, 2]), Sample(rollout_id=1, tokens=[1, 2, 3])
    first = Sample(rollout_id=2, tokens=[1, 2, 9], reward=1.0, metadata=meta)
    longer = Sample(rollout_id=2, tokens=[1, 2, 8, 8, 7], reward=1.0, metadata=meta)
    groups = RolloutSamples([[plain, [single], [first, longer]]], metrics={"rollout/x": 1.0})
    monkeypatch.setattr(calculator_agent, "default_generate_rollout", lambda *a: groups)
    out = calculator_agent.generate_rollout(None, 0, None)
    assert out == [[plain, [single], [first, longer]]]
    assert out.metrics == {"rollout/x": 1.0, "agent/tool_call_rate": 1.0, "agent/reward_with_tool": 1.0}


@pytest.mark.slow  # development tier: a script's dry run (tests/test_scripts.py keeps them in the tier)
def test_tiny_run_script_dry_run_validates(tiny_kit, tmp_path, preimported_python):
    """SLIME_DRY_RUN=1: both stages' arguments validate (by the pre-imported interpreter, PYTHON); GRPO drives the
    calculator agent and logs its metrics."""
    from slime.config import parse_args

    _, data = _prepare_tiny(tiny_kit, tmp_path, "--num-sft", "4", "--num-train", "4")
    out = tmp_path / "out"
    env = dict(
        os.environ,
        SLIME_DRY_RUN="1",
        MODEL_DIR=tiny_kit[0],
        DATA_DIR=str(data),
        OUT=str(out),
        PYTHON="python3",
        **preimported_python.env,
    )
    served = preimported_python.served()
    res = subprocess.run(
        ["bash", str(EXAMPLES / "calculator_agent/run_tiny_cpu.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert res.returncode == 0, f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert [line for line in res.stdout.splitlines() if line == "ok"] == ["ok", "ok"]
    assert preimported_python.wait_served(served + 2) == served + 2
    assert not out.exists()
    stages = [shlex.split(line[2:]) for line in res.stdout.splitlines() if line.startswith("+ ")]
    (sft_driver, *sft_argv), (rl_driver, *rl_argv) = stages
    assert (sft_driver, rl_driver) == ("train_async.py", "train.py")
    sft = parse_args(argv=sft_argv, check_paths=False)
    assert sft.rollout_function_path == "slime.rollout.sft_rollout.generate_rollout" and sft.input_key == "messages"
    rl = parse_args(argv=rl_argv, check_paths=False)
    assert rl.custom_generate_function_path == "calculator_agent.generate"
    assert rl.rollout_function_path == "calculator_agent.generate_rollout"
    assert rl.ref_load == f"{out}/sft" and rl.metrics_path == f"{out}/metrics.jsonl"
    assert rl.eval_prompt_data == ["calc", f"{data}/eval.jsonl"] and rl.eval_temperature == 0
