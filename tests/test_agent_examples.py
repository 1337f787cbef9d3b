"""examples/calculator_agent's tool and reward (the engine-driven run is in test_agent_adapters.py)."""

import os
import sys

import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "calculator_agent")
)
import calculator_agent  # noqa: E402


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


def test_launch_script_dry_run_validates(tmp_path):
    """run_qwen3_4b.sh's arguments parse and validate (SLIME_DRY_RUN: no Ray, no GPU)."""
    import json
    import subprocess
    from pathlib import Path

    from tests.test_scripts import _fake_base_dir

    base = tmp_path / "root"
    _fake_base_dir(base)
    (base / "calculator_agent").mkdir()
    row = {"prompt": [{"role": "user", "content": "What is 2*3?"}], "label": "6"}
    (base / "calculator_agent" / "train.jsonl").write_text(json.dumps(row) + "\n")
    env = dict(
        os.environ, SLIME_DRY_RUN="1", BASE_DIR=str(base), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    script = Path(calculator_agent.__file__).with_name("run_qwen3_4b.sh")
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok"
