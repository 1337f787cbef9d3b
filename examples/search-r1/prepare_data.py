"""Build slime prompt data for Search-R1: `{"prompt": [chat messages], "label": {"ground_truth": {"target": [...]}}}`.

    python examples/search-r1/prepare_data.py examples/search-r1/data/toy_qa.jsonl /tmp/search_r1_train.jsonl

Input lines carry `question` and `label` (or Search-R1's `golden_answers`). Use with `--input-key prompt
--label-key label --apply-chat-template`.
"""

import json
import sys

# Search-R1's instruction (its example `<answer>` tags are why the reward reads the response only).
TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get new "
    "information. After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. You can search as "
    "many times as your want. If you find no further external knowledge needed, you can directly provide the answer "
    "inside <answer> and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)


def make_prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": TEMPLATE.format(question=question.strip())}]


def convert(src: str, dst: str) -> int:
    n = 0
    with open(src) as fin, open(dst, "w") as fout:
        for line in fin:
            if not line.strip():
                continue
            row = json.loads(line)
            label = row.get("label") or {"ground_truth": {"target": row["golden_answers"]}}
            fout.write(json.dumps({"prompt": make_prompt(row["question"]), "label": label}) + "\n")
            n += 1
    return n


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python prepare_data.py INPUT.jsonl OUTPUT.jsonl")
    print(f"wrote {convert(sys.argv[1], sys.argv[2])} prompts to {sys.argv[2]}")
