"""Write small bug-fix tasks as slime prompt data: `prompt` (the issue) and `metadata.task` (files, tests, command).

    python examples/coding_agent/prepare_data.py /root/coding_agent/train.jsonl [--num 2000] [--seed 0]

Each task is a one-function module with one injected bug and a test script of plain asserts; `python3 test_*.py`
exits 0 once the bug is fixed. Real tasks (a repository checkout, its test suite) fit the same shape.
"""

import argparse
import json
import os
import random

# (function name, the fixed body, the buggy body, calls with their expected results)
FUNCTIONS = [
    ("add", "a + b", "a - b", [((2, 3), 5), ((-1, 1), 0)]),
    ("mul", "a * b", "a + b", [((3, 4), 12), ((2, 2), 4), ((0, 5), 0)]),
    ("biggest", "max(a, b)", "min(a, b)", [((2, 9), 9), ((7, 1), 7)]),
    ("diff", "abs(a - b)", "a - b", [((2, 9), 7), ((9, 2), 7)]),
    ("avg", "(a + b) / 2", "a + b / 2", [((2, 4), 3), ((0, 0), 0)]),
]


def make_task(rng: random.Random) -> dict:
    name, _good, bad, cases = rng.choice(FUNCTIONS)
    module = rng.choice(["mathx", "util", "ops", "calc"])
    source = f"def {name}(a, b):\n    return {bad}\n"
    tests = f"from {module} import {name}\n" + "".join(f"assert {name}{args} == {want}\n" for args, want in cases)
    task = {
        "files": {f"{module}.py": source},
        "tests": {f"test_{module}.py": tests},
        "test_cmd": f"python3 test_{module}.py",
    }
    issue = f"{name} in {module}.py is wrong; test_{module}.py must pass."
    return {"prompt": issue, "metadata": {"task": task}}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--num", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        for _ in range(a.num):
            f.write(json.dumps(make_task(rng)) + "\n")


if __name__ == "__main__":
    main()
