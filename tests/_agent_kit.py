"""A tiny tool-calling policy for the agent tests: the tiny Qwen3 kit fine-tuned to answer a few fixed conversations.

The chat template is a compact one in Qwen3's format (reasoning in ``<think>``, tool calls as ``<tool_call>`` JSON,
tool results as ``<tool_response>`` in a user turn) with a one-line tool list, so conversations fit the tiny
model's 512-token context. The model is trained, teacher-forced, until greedy decoding reproduces every assistant
turn below token for token; the agent tests then drive it through real clients and know what it will say.
"""

import functools
import json
import os
import shutil

from tests._build_cache import cached_build

AGENT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n' }}{%- endif %}"
    "{{- 'Tools:' }}{%- for t in tools %}{{- ' ' + t.function.name }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- m.content or '' }}"
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

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def _call(expr):
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expr}}}


# (tools, messages): every assistant message is a turn the model learns to produce, unless marked "train": False.
CONVERSATIONS = [
    (
        [CALCULATOR],
        [
            {"role": "user", "content": "What is 3+4?"},
            {"role": "assistant", "reasoning_content": "add them", "content": "", "tool_calls": [_call("3+4")]},
            {"role": "tool", "content": "7"},
            {"role": "assistant", "content": "The answer is 7."},
            {"role": "user", "content": "And times 2?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("7*2")]},
            {"role": "tool", "content": "14"},
            {"role": "assistant", "content": "14"},
        ],
    ),
    (
        [CALCULATOR],
        [
            {"role": "user", "content": "What is 12*5?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("12*5")]},
            {"role": "tool", "content": "60"},
            {"role": "assistant", "content": "60"},
        ],
    ),
    # the same episode as a client that drops reasoning from the history sends it (the OpenAI Agents SDK does)
    (
        [CALCULATOR],
        [
            {"role": "user", "content": "What is 3+4?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("3+4")], "train": False},
            {"role": "tool", "content": "7"},
            {"role": "assistant", "content": "The answer is 7."},
        ],
    ),
    # a sub-agent: its own system prompt, no tools
    (
        None,
        [
            {"role": "system", "content": "You check sums."},
            {"role": "user", "content": "Is 3+4=7?"},
            {"role": "assistant", "content": "yes"},
        ],
    ),
    # the main agent's history compacted into a summary
    (
        [CALCULATOR],
        [
            {"role": "user", "content": "Summary: 3+4=7, checked. Finish."},
            {"role": "assistant", "content": "Done: 7."},
        ],
    ),
]


def turn_examples(tokenizer, conversations=None):
    """[(prompt_ids, target_ids)] for every assistant turn; target ends with <|im_end|>."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for tools, marked in CONVERSATIONS if conversations is None else conversations:
        messages = [{k: v for k, v in m.items() if k != "train"} for m in marked]
        for k, m in enumerate(marked):
            if m["role"] != "assistant" or not m.get("train", True):
                continue
            prompt = tokenizer.encode(
                tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            full = tokenizer.encode(
                tokenizer.apply_chat_template(messages[: k + 1], tools=tools, tokenize=False), add_special_tokens=False
            )
            assert full[: len(prompt)] == prompt, "the template must extend the prompt with the assistant turn"
            target = full[len(prompt) :]
            target = target[: target.index(end) + 1]
            out.append((prompt, target))
    return out


def build_agent_model(base_model_dir, out_dir, max_steps=600, seed=0, conversations=None):
    """Copy the tiny kit, install AGENT_TEMPLATE, fine-tune until greedy decoding reproduces every turn (about 40 s
    of CPU, so kept across test sessions by `tests._build_cache`, keyed by this file, the kit and the arguments).

    conversations: [(tools, messages)] to memorise, in CONVERSATIONS' shape (default: CONVERSATIONS).
    """
    build = functools.partial(
        _build_agent_model, base_model_dir, max_steps=max_steps, seed=seed, conversations=conversations
    )
    return cached_build("agent-model", out_dir, build, __file__, base_model_dir, max_steps, seed, conversations)


def _build_agent_model(base_model_dir, out_dir, max_steps, seed, conversations):
    import torch  # heavy
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy

    shutil.copytree(base_model_dir, out_dir, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(out_dir)
    tok.chat_template = AGENT_TEMPLATE
    examples = turn_examples(tok, conversations)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    attn = torch.zeros(len(examples), width, dtype=torch.long)
    for i, (p, t) in enumerate(examples):
        seq = p + t
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(t)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(max_steps):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        tgt = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 20 == 19:
            mask = tgt != -100
            # a margin, not just argmax: the server's forward pass differs from this one in the last bits
            top2 = logits.detach().topk(2, dim=-1)
            right = top2.indices[..., 0] == tgt
            margin = (top2.values[..., 0] - top2.values[..., 1])[mask]
            if bool(right[mask].all()) and float(margin.min()) > 2.0:
                break
    else:
        raise RuntimeError(f"the agent kit did not memorise its turns in {max_steps} steps (loss {loss.item():.4f})")
    model.eval()
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    cfg_path = os.path.join(out_dir, "tokenizer_config.json")  # as build_tiny_kit: loadable by transformers 4 too
    with open(cfg_path) as f:
        tcfg = json.load(f)
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(cfg_path, "w") as f:
        json.dump(tcfg, f, indent=2, sort_keys=True)
    return out_dir
