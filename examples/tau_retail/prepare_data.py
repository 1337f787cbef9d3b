"""Write tau_retail tasks as slime prompt data: `prompt` (the customer's opening line) and `metadata.task`.

    python examples/tau_retail/prepare_data.py /root/tau_retail/train.jsonl [--num 2000] [--seed 0]

Each task gets its own small database (random orders), the customer's scripted lines, the instruction a model
user simulator is given, and the reference actions the reward replays. A request the store must refuse (cancelling
a delivered order) has no reference action: the right outcome is an unchanged database.
"""

import argparse
import json
import os
import random

ITEMS = ["lamp", "desk", "chair", "mug", "rug", "shelf"]
STREETS = ["Oak St", "Elm St", "Pine Rd", "Lake Ave"]


def make_task(rng: random.Random) -> dict:
    orders = {}
    for k in range(rng.randint(2, 4)):
        orders[f"{rng.choice('ABCD')}{k + 1}"] = {
            "user": rng.choice(["ann", "bob", "cy"]),
            "item": rng.choice(ITEMS),
            "status": rng.choice(["pending", "pending", "delivered"]),
            "address": f"{rng.randint(1, 99)} {rng.choice(STREETS)}",
        }
    oid = rng.choice(sorted(orders))
    order = orders[oid]
    if rng.random() < 0.5:
        line = f"Cancel my order {oid}."
        instruction = f"You want order {oid} (your {order['item']}) cancelled."
        actions = [["cancel_order", {"order_id": oid}]] if order["status"] == "pending" else []
    else:
        address = f"{rng.randint(1, 99)} {rng.choice(STREETS)}"
        line = f"Please ship order {oid} to {address}."
        instruction = f"You want order {oid} (your {order['item']}) shipped to {address} instead."
        actions = [["change_address", {"order_id": oid, "address": address}]] if order["status"] == "pending" else []
    task = {"db": {"orders": orders}, "user_turns": [line], "instruction": instruction, "actions": actions}
    return {"prompt": line, "metadata": {"task": task}}


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
