"""Data and model for the watchable CPU run: 2-digit additions, a tiny policy that calls its calculator at times.

    python examples/calculator_agent/prepare_tiny_data.py --base-model models/qwen3-tiny \
        --model-dir models/qwen3-tiny-calc --data-dir data/calculator --tool-fraction 0.5

Writes
- <model-dir>: the tiny kit with a compact chat template in Qwen3's tool-call format (``<tool_call>`` JSON,
  tool results as ``<tool_response>`` in a user turn; tools listed as one ``Tools: calculator`` system line), so an
  episode fits the tiny model's 512-token context;
- <data-dir>/sft.jsonl: chat transcripts; a share (--tool-fraction) call the calculator with the question's
  expression and answer with its result, the rest answer directly -- so the warm-started policy knows how to use the
  tool (copying digits) but calls it only some of the time, and answers wrongly when it does not;
- <data-dir>/train.jsonl: fresh problems as prompts with their label, for GRPO;
- <data-dir>/eval.jsonl: more fresh problems in the same form, for the greedy eval.

The SFT transcripts carry the tool list as the system turn the template renders for ``tools=[calculator]``, so SFT
(which templates messages without tools) and the agent (which passes the tool) see the same tokens.
"""

import argparse
import json
import os
import random
import shutil

# The same rendering as Qwen3's template for what this run uses, minus its long tool preamble.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nTools:' }}{%- for t in tools %}{{- ' ' + t.function.name }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or m.role == 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for tc in m.tool_calls or [] %}{%- if m.content or not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{%- if tc.function.arguments is string %}{{- tc.function.arguments }}"
    "{%- else %}{{- tc.function.arguments | tojson }}{%- endif %}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TOOLS_TURN = {"role": "system", "content": "Tools: calculator"}  # what CHAT_TEMPLATE renders for the tool list


def problem(rng):
    # two 2-digit operands with a 3-digit sum: too hard for the tiny model in its head, and each number is a fixed
    # count of single-digit tokens, so copying them (into the call, then from the result) is a fixed-offset lookup
    a, b = rng.randint(50, 99), rng.randint(50, 99)
    return f"{a}+{b}", str(a + b)


def sft_row(expr, value, use_tool):
    user = {"role": "user", "content": f"What is {expr}?"}
    if not use_tool:
        return {"messages": [TOOLS_TURN, user, {"role": "assistant", "content": value}]}
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}
    return {
        "messages": [
            TOOLS_TURN,
            user,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": value},
            {"role": "assistant", "content": value},
        ]
    }


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-model", required=True, help="the tiny kit (tools/build_tiny_kit.py)")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--num-sft", type=int, default=4000)
    p.add_argument("--num-train", type=int, default=2000)
    p.add_argument("--num-eval", type=int, default=64)
    p.add_argument("--tool-fraction", type=float, default=0.5, help="share of SFT transcripts that call the tool")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.base_model, "config.json")):
        p.error(f"--base-model {a.base_model}: no config.json (build it with tools/build_tiny_kit.py)")
    if not 0.0 <= a.tool_fraction <= 1.0:
        p.error(f"--tool-fraction must be in [0, 1], got {a.tool_fraction}")

    shutil.copytree(a.base_model, a.model_dir, dirs_exist_ok=True)
    with open(os.path.join(a.model_dir, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)

    rng = random.Random(a.seed)
    n_tool = round(a.num_sft * a.tool_fraction)
    sft = [sft_row(*problem(rng), use_tool=i < n_tool) for i in range(a.num_sft)]
    rng.shuffle(sft)
    prompts = []
    for _ in range(a.num_train + a.num_eval):
        expr, value = problem(rng)
        prompts.append({"prompt": [{"role": "user", "content": f"What is {expr}?"}], "label": value})
    train, evaluation = prompts[: a.num_train], prompts[a.num_train :]
    os.makedirs(a.data_dir, exist_ok=True)
    write_jsonl(os.path.join(a.data_dir, "sft.jsonl"), sft)
    write_jsonl(os.path.join(a.data_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(a.data_dir, "eval.jsonl"), evaluation)
    print(
        f"wrote {a.model_dir} and {a.data_dir}/{{sft,train,eval}}.jsonl ({n_tool}/{a.num_sft} SFT transcripts call the tool)"
    )


if __name__ == "__main__":
    main()
