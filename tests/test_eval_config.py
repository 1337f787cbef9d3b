"""--eval-config: per-dataset eval settings resolved at start-up (dataset > defaults > command line) into
args.eval_datasets, and every mistake in the file as one line naming the file and the key."""

import json
import textwrap

import pytest

from slime.config import parse_args
from tests._args import BASE, TINY_MODEL, TINY_PROMPTS

ARGV = [
    *BASE,
    *TINY_MODEL,
    "--eval-temperature",
    "0.3",
    "--rollout-max-response-len",
    "64",
    "--rollout-top-p",
    "0.9",
    "--rollout-top-k",
    "20",
]


def write(tmp_path, text, name="eval.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text) if isinstance(text, str) else json.dumps(text))
    return str(path)


def parse(*argv):
    return parse_args(argv=[*ARGV, *argv])


def error_line(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0].split("error: ", 1)[1]


def test_fields_resolve_dataset_then_defaults_then_flags(tmp_path):
    config = write(
        tmp_path,
        f"""
        eval:
          defaults:
            max_response_len: 16
            n_samples_per_eval_prompt: 4
            metadata_overrides: {{source: cfg}}
          datasets:
            - name: greedy
              path: {TINY_PROMPTS}
              temperature: 0.0
              max_response_len: 8
              rm_type: math
            - name: sampled
              path: {TINY_PROMPTS}
              custom_generate_function_path: slime.rollout.sglang_rollout.generate
              stop: ["\\n\\n"]
        """,
    )
    args = parse("--eval-config", config, "--eval-prompt-data", "ignored", "/no/such.jsonl")
    greedy, sampled = args.eval_datasets
    assert args.eval_prompt_data == ["greedy", TINY_PROMPTS, "sampled", TINY_PROMPTS]  # the file replaces the flag
    # dataset > defaults > --eval-temperature > --rollout-temperature
    assert (greedy.temperature, greedy.max_response_len, greedy.n_samples_per_eval_prompt) == (0.0, 8, 4)
    assert (sampled.temperature, sampled.max_response_len, sampled.n_samples_per_eval_prompt) == (0.3, 16, 4)
    assert greedy.top_p == sampled.top_p == 0.9 and greedy.top_k == 20  # --eval-top-p/-k unset: --rollout-top-p/-k
    assert sampled.stop == ["\n\n"] and greedy.stop is None
    assert greedy.inject_metadata({"a": 1}) == {"a": 1, "rm_type": "math", "source": "cfg"}
    assert sampled.custom_generate_function_path == "slime.rollout.sglang_rollout.generate"
    assert greedy.input_key == "input" and greedy.metadata_key == "metadata"  # --input-key, --metadata-key
    base = {"temperature": 1.0, "max_new_tokens": 64, "skip_special_tokens": False, "top_p": 1.0, "top_k": -1}
    assert greedy.sampling_params(base) == {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 20,
        "max_new_tokens": 8,
        "skip_special_tokens": False,
    }


def test_mapping_form_json_and_prompt_data_pairs(tmp_path):
    config = write(
        tmp_path,
        {"datasets": {"a": {"path": TINY_PROMPTS, "top_k": 5}, "b": {"path": TINY_PROMPTS}}},
        name="eval.json",
    )
    args = parse("--eval-config", config, "--eval-custom-rm-path", "slime.rollout.rm_hub.async_rm")
    assert [(d.name, d.top_k) for d in args.eval_datasets] == [("a", 5), ("b", 20)]
    assert all(d.custom_rm_path == "slime.rollout.rm_hub.async_rm" for d in args.eval_datasets)
    # without a file, --eval-prompt-data resolves the same way: the default eval reads args.eval_datasets
    (d,) = parse("--eval-prompt-data", "toy", TINY_PROMPTS, "--eval-top-k", "3").eval_datasets
    assert d.apply_chat_template_kwargs == {}  # --apply-chat-template-kwargs, unset
    # a dataset's chat-template arguments: its own, else the defaults', else --apply-chat-template-kwargs (whole)
    config = write(
        tmp_path,
        {
            "defaults": {"apply_chat_template_kwargs": {"enable_thinking": True}},
            "datasets": {
                "a": {"path": TINY_PROMPTS, "apply_chat_template_kwargs": {"x": 1}},
                "b": {"path": TINY_PROMPTS},
            },
        },
        name="kwargs.json",
    )
    a, b = parse("--eval-config", config, "--apply-chat-template-kwargs", '{"y": 2}').eval_datasets
    assert (a.apply_chat_template_kwargs, b.apply_chat_template_kwargs) == ({"x": 1}, {"enable_thinking": True})
    assert a.cache_key != b.cache_key  # loaded apart
    (c,) = parse("--eval-prompt-data", "c", TINY_PROMPTS, "--apply-chat-template-kwargs", '{"y": 2}').eval_datasets
    assert c.apply_chat_template_kwargs == {"y": 2}
    assert (d.name, d.path, d.top_k, d.temperature, d.max_response_len) == ("toy", TINY_PROMPTS, 3, 0.3, 64)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("datasets: []", "no datasets; `datasets` must define at least one"),
        ("other: 1\ndatasets: {a: {path: P}}", "unknown top-level key 'other'"),
        ("datasets: [{path: P}]", "datasets[0] has no `name`"),
        ("datasets: {a: {}}", "datasets.a: no `path` (the prompt file)"),
        ("datasets: {a: {path: P, temprature: 0}}", "datasets.a: unknown key 'temprature'; known keys: apply_chat"),
        ("datasets: {a: {path: P, temperature: hot}}", "datasets.a.temperature: expected a number, got 'hot'"),
        (
            "datasets: {a: {path: P, apply_chat_template_kwargs: off}}",
            "apply_chat_template_kwargs: expected a mapping",
        ),
        ("datasets: {a: {path: P, top_p: 0}}", "datasets.a.top_p: 0 must be in (0, 1]"),
        (
            "datasets: {a: {path: P, n_samples_per_eval_prompt: true}}",
            "n_samples_per_eval_prompt: expected an integer",
        ),
        ("datasets: [{name: a, path: P}, {name: a, path: P}]", "dataset 'a' is defined twice"),
        ("defaults: {path: P}\ndatasets: {a: {path: P}}", "defaults.path: each dataset sets its own path"),
        ("defaults: {max_len: 3}\ndatasets: {a: {path: P}}", "defaults: unknown key 'max_len'"),
        ("datasets: {a: {path: P, rm_type: nope}}", "datasets.a.rm_type: 'nope' is unknown; expected one of"),
        ("datasets: {a: {path: '${oc.env:DATA}'}}", "datasets.a.path: '${oc.env:DATA}': interpolations"),
        ("datasets: {a: [1, 2]}", "datasets.a is list, not a mapping of its fields"),
        ("eval: [1]", "expected a mapping with `datasets`"),
        ("datasets: {a: {path: P", "cannot read it as YAML (ParserError"),
    ],
)
def test_config_mistakes_are_one_line_naming_file_and_key(tmp_path, capsys, text, expected):
    config = write(tmp_path, text.replace("P", TINY_PROMPTS))
    err = error_line(capsys, "--eval-config", config)
    assert err.startswith(f"--eval-config {config}: ") and expected in err, err


def test_dataset_files_and_functions_are_checked_at_start_up(tmp_path, capsys):
    missing = str(tmp_path / "missing.jsonl")
    config = write(tmp_path, f"datasets: {{aime: {{path: {missing}}}}}")
    assert (
        error_line(capsys, "--eval-config", config) == f"--eval-config {config}: dataset aime {missing}: no such file."
    )
    # the dataset's own keys read its file: TINY_PROMPTS has no column `question`
    config = write(tmp_path, f"datasets: {{aime: {{path: {TINY_PROMPTS}, input_key: question}}}}")
    assert "question" in error_line(capsys, "--eval-config", config)
    config = write(tmp_path, f"datasets: {{aime: {{path: {TINY_PROMPTS}, custom_rm_path: no_such_mod.rm}}}}")
    assert error_line(capsys, "--eval-config", config).startswith(
        f"--eval-config {config}: dataset aime: custom_rm_path as --custom-rm-path no_such_mod.rm: cannot import it"
    )
    assert error_line(capsys, "--eval-config", str(tmp_path / "none.yaml")).endswith("none.yaml: no such file.")
