"""slime.utils.data: read_file (jsonl/json/parquet) and the prompt Dataset."""

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slime.utils.data import Dataset, read_file


@pytest.fixture(scope="module")
def tokenizer(tiny_kit):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_kit[0])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [
    {"prompt": [{"role": "user", "content": "What is 3+4?"}], "label": "7", "metadata": {"src": "a"}},
    {"prompt": [{"role": "user", "content": "What is 1+1?"}], "label": "2", "metadata": {"src": "b"}},
    {"prompt": [{"role": "user", "content": "What is 2+5?"}], "label": "7", "metadata": {"src": "c"}},
]


# ---------------------------------------------------------------- read_file


def test_read_jsonl_json_and_parquet(tmp_path):
    rows = [{"text": "hello", "label": "1"}, {"text": "world", "label": "2"}]
    jl = write_jsonl(tmp_path / "d.jsonl", rows)
    assert [dict(r) for r in read_file(jl)] == rows
    js = tmp_path / "d.json"
    js.write_text(json.dumps(rows))
    assert [dict(r) for r in read_file(str(js))] == rows
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "d.parquet"))
    assert [dict(r) for r in read_file(str(tmp_path / "d.parquet"))] == rows
    # a row without a column reads it as None, as an HF dataset gives it; columns in first-seen order
    ragged = read_file(write_jsonl(tmp_path / "r.jsonl", [{"text": "a"}, {"text": "b", "label": "2"}]))
    assert ragged.column_names == ["text", "label"] and ragged == [
        {"text": "a", "label": None},
        {"text": "b", "label": "2"},
    ]


def test_read_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_file(str(tmp_path / "missing.jsonl"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"d\.csv: unsupported data file type '\.csv'"):
        read_file(str(tmp_path / "d.csv"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "broken"\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        read_file(str(bad))
    arr = tmp_path / "arr.jsonl"
    arr.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"arr\.jsonl:2: expected a JSON object per line, got list"):
        read_file(str(arr))
    (tmp_path / "obj.json").write_text('{"text": "ok"}')
    with pytest.raises(ValueError, match=r"obj\.json: cannot read as json .*expected a JSON array of objects"):
        read_file(str(tmp_path / "obj.json"))


# ---------------------------------------------------------------- Dataset


def test_dataset_applies_chat_template_and_keeps_labels(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = Dataset(path, tokenizer, max_length=None, prompt_key="prompt", label_key="label", apply_chat_template=True)
    assert len(ds) == 3
    # the tiny kit's Qwen-style template, add_generation_prompt=True, no default system prompt
    assert ds[0].prompt == "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
    assert [s.label for s in ds.samples] == ["7", "2", "7"]
    assert [s.metadata for s in ds.samples] == [{"src": "a"}, {"src": "b"}, {"src": "c"}]


def test_dataset_template_takes_a_text_prompt_as_one_user_message(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What is 1+1?"}, {"prompt": ROWS[2]["prompt"]}])
    ds = Dataset(path, tokenizer, None, prompt_key="prompt", apply_chat_template=True)
    turn = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    assert [s.prompt for s in ds.samples] == [turn.format("What is 1+1?"), turn.format("What is 2+5?")]


def test_dataset_without_template_keeps_message_lists(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    ds = Dataset(path, tokenizer, max_length=4, prompt_key="prompt")  # message lists are never length-filtered
    assert ds[1].prompt == [{"role": "user", "content": "What is 1+1?"}]
    assert ds[1].label is None and ds[1].metadata == {}


def test_dataset_drops_prompts_longer_than_max_length(tmp_path, tokenizer):
    short, long = "hi", " ".join(["word"] * 200)  # >= 200 tokens: one per word at least
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": short}, {"text": long}, {"text": short + "!"}])
    ds = Dataset(path, tokenizer, max_length=20)
    assert [s.prompt for s in ds.samples] == ["hi", "hi!"]
    assert len(Dataset(path, tokenizer, max_length=None)) == 3


SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
CALC = {"type": "function", "function": {"name": "calc", "description": "arithmetic"}}


@pytest.fixture
def tool_tokenizer(tokenizer):
    """The tiny kit's tokenizer with a template that lists the tools' names in a system turn."""
    import copy

    from tests._agent_kit import AGENT_TEMPLATE

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = AGENT_TEMPLATE
    return tok


def test_dataset_tools_reach_the_template_and_metadata(tmp_path, tool_tokenizer):
    """--tool-key's default column, as in current slime: a row's tools (a list, or its JSON) go into the chat template
    and into metadata["tools"] (plugins and the SFT loss mask read them there); a row without has none."""
    rows = [
        {"prompt": ROWS[0]["prompt"], "metadata": {"src": "a"}, "tools": [SEARCH, CALC]},
        {"prompt": ROWS[1]["prompt"], "metadata": {"src": "b"}},
        {"prompt": ROWS[2]["prompt"], "tools": json.dumps([CALC])},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    ds = Dataset(path, tool_tokenizer, None, prompt_key="prompt", tool_key="tools", apply_chat_template=True)
    user = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    assert [s.prompt for s in ds.samples] == [
        "<|im_start|>system\nTools: search calc<|im_end|>\n" + user.format("What is 3+4?"),
        user.format("What is 1+1?"),
        "<|im_start|>system\nTools: calc<|im_end|>\n" + user.format("What is 2+5?"),
    ]
    assert [s.metadata for s in ds.samples] == [{"src": "a", "tools": [SEARCH, CALC]}, {"src": "b"}, {"tools": [CALC]}]
    # without the template (a custom generate renders the chat itself) the tools are still in the metadata
    plain = Dataset(path, tool_tokenizer, None, prompt_key="prompt", tool_key="tools")
    assert plain[0].prompt == ROWS[0]["prompt"] and plain[0].metadata["tools"] == [SEARCH, CALC]


def test_dataset_tool_key_errors_name_the_row_or_column(tmp_path, tool_tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = Dataset(path, tool_tokenizer, None, prompt_key="prompt", tool_key="tools", apply_chat_template=True)
    assert all("system" not in s.prompt for s in ds.samples)  # the default column is optional
    with pytest.raises(ValueError, match=r"p\.jsonl: no column 'functions' \(--tool-key\)"):
        Dataset(path, tool_tokenizer, None, prompt_key="prompt", tool_key="functions")
    bad = write_jsonl(tmp_path / "b.jsonl", [ROWS[0], {**ROWS[1], "tools": "search, calc"}])
    with pytest.raises(ValueError, match=r"b\.jsonl: row 2 \(line 2\): 'tools' \(--tool-key\) must be a list"):
        Dataset(bad, tool_tokenizer, None, prompt_key="prompt", tool_key="tools")


def test_dataset_missing_columns_are_named(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"p\.jsonl: no column 'question' \(--input-key\)"):
        Dataset(path, tokenizer, None, prompt_key="question")
    with pytest.raises(ValueError, match=r"no column 'answer' \(--label-key\)"):
        Dataset(path, tokenizer, None, prompt_key="prompt", label_key="answer")


def test_shuffle_is_a_seeded_permutation_of_the_original_order(tmp_path, tokenizer):
    rows = [{"text": f"p{i}"} for i in range(20)]
    ds = Dataset(write_jsonl(tmp_path / "s.jsonl", rows), tokenizer, None, seed=7)
    original = [s.prompt for s in ds.samples]
    assert original == [f"p{i}" for i in range(20)]

    def expected(epoch):  # the spec's recipe: random.seed(seed + epoch); random.shuffle(range(n))
        state = random.getstate()
        random.seed(7 + epoch)
        perm = list(range(20))
        random.shuffle(perm)
        random.setstate(state)
        return [original[i] for i in perm]

    ds.shuffle(1)
    epoch1 = [s.prompt for s in ds.samples]
    assert epoch1 == expected(1) and epoch1 != original
    ds.shuffle(1)  # same epoch: no-op
    assert [s.prompt for s in ds.samples] == epoch1
    ds.shuffle(2)
    assert [s.prompt for s in ds.samples] == expected(2)
    ds.shuffle(1)  # permutes the original order, not the previous epoch's
    assert [s.prompt for s in ds.samples] == epoch1
    assert sorted(s.prompt for s in ds.samples) == sorted(original)


def test_tiny_kit_train_file_loads(tiny_kit, tokenizer):
    _, data_dir = tiny_kit
    ds = Dataset(
        f"{data_dir}/train.jsonl", tokenizer, 64, prompt_key="prompt", label_key="label", apply_chat_template=True
    )
    assert len(ds) > 0
    for s in ds.samples[:5]:
        assert s.prompt.startswith("<|im_start|>user\nWhat is ") and s.prompt.endswith("<|im_start|>assistant\n")
        a, b = s.prompt.split("What is ")[1].split("?")[0].split("+")
        assert s.label == str(int(a) + int(b))
