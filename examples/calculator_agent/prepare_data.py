"""Arithmetic a small model cannot do in its head: 3-4 digit products and sums, as slime prompt data.

python examples/calculator_agent/prepare_data.py /root/calculator_agent/train.jsonl --n 20000
"""

import argparse
import json
import random


def problems(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        a, b, c = rng.randint(100, 9999), rng.randint(100, 9999), rng.randint(10, 999)
        expr, value = rng.choice([(f"{a}*{b}", a * b), (f"{a}*{b}+{c}", a * b + c), (f"({a}+{b})*{c}", (a + b) * c)])
        yield {
            "prompt": [{"role": "user", "content": f"What is {expr}? Use the calculator, then give the number."}],
            "label": str(value),
        }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--n", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    with open(a.out, "w") as f:
        for row in problems(a.n, a.seed):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
