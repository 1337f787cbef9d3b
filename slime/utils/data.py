"""Prompt datasets: `read_file` (jsonl/json/parquet as row dicts) and `Dataset`."""

import contextlib
import json
import os
import random

from slime.utils.types import Sample


def iter_jsonl(path):
    """The JSON objects of a .jsonl file, one per non-blank line; fails on the first line that is not one, naming
    file and line (datasets' own error does not)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line, got {type(record).__name__}")
            yield record


def _line_of_row(path, index):
    """' (line N)' of the `index`-th record of a .jsonl file (blank lines skipped), '' for other formats."""
    if not path.endswith(".jsonl"):
        return ""
    with open(path, encoding="utf-8") as f:
        records = (lineno for lineno, line in enumerate(f, 1) if line.strip())
        for i, lineno in enumerate(records):
            if i == index:
                return f" (line {lineno})"
    return ""


class Rows(list):
    """A file's rows as dicts, each with every column (None where a row lacks it), and `column_names` in first-seen
    order: what iterating an HF `datasets.Dataset` gives, without importing that library in every rollout process."""

    def __init__(self, records):
        super().__init__(records)
        self.column_names = list(dict.fromkeys(key for record in self for key in record))
        for record in self:
            for key in self.column_names:
                record.setdefault(key, None)


def _read_json(path):
    with open(path, encoding="utf-8") as f:
        records = json.load(f)
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError("expected a JSON array of objects")
    return records


def _read_parquet(path):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


_READERS = {".jsonl": iter_jsonl, ".json": _read_json, ".parquet": _read_parquet}


DEFAULT_TOOL_KEY = "tools"  # --tool-key's default: used where the data has that column, as in current slime


def _tools_of(row, tool_key, path, index):
    """A row's tool list for the chat template (None: no tools), from a list or a JSON string of one."""
    tools = row.get(tool_key) if tool_key is not None else None
    if isinstance(tools, str):  # tools are often stored as a JSON string column
        with contextlib.suppress(json.JSONDecodeError):  # else refused below, as a string
            tools = json.loads(tools)
    if tools is not None and not isinstance(tools, list):
        raise ValueError(
            f"{path}: row {index + 1}{_line_of_row(path, index)}: {tool_key!r} (--tool-key) must be a list of tools "
            f"(or its JSON), got {type(tools).__name__}"
        )
    return tools


def read_file(path):
    """Load a .jsonl / .json / .parquet file as `Rows` (iterate it for row dicts)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in _READERS:
        raise ValueError(f"{path}: unsupported data file type {ext or '(none)'!r}; use .jsonl, .json or .parquet")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path} does not exist")
    if ext == ".jsonl":
        return Rows(iter_jsonl(path))  # names file and line of a bad record
    try:
        return Rows(_READERS[ext](path))
    except Exception as e:
        raise ValueError(f"{path}: cannot read as {ext[1:]} ({type(e).__name__}: {e})") from e


class Dataset:
    """Prompts of one file as `Sample`s, optionally chat-templated, long ones dropped, shufflable per epoch."""

    def __init__(
        self,
        path,
        tokenizer,
        max_length,
        *,
        prompt_key="text",
        label_key=None,
        tool_key=None,
        metadata_key="metadata",
        seed=42,
        apply_chat_template=False,
        apply_chat_template_kwargs=None,
        multimodal_keys=None,
        processor=None,
    ):
        data = read_file(path)
        multimodal_keys = multimodal_keys or {}
        for media, column in multimodal_keys.items():
            if column not in data.column_names:
                raise ValueError(
                    f"{path}: no column {column!r} (--multimodal-keys {media!r}); its columns are {data.column_names}"
                )
        required = [(prompt_key, "--input-key"), (label_key, "--label-key")]
        if tool_key != DEFAULT_TOOL_KEY:  # the default column is optional, as in current slime
            required.append((tool_key, "--tool-key"))
        for key, flag in required:
            if key is not None and key not in data.column_names:
                raise ValueError(f"{path}: no column {key!r} ({flag}); its columns are {data.column_names}")
        if tool_key not in data.column_names:
            tool_key = None

        self.column_names = data.column_names
        prompts, rows, media, metadata = [], [], [], []
        for i, row in enumerate(data):
            prompt = row[prompt_key]
            if prompt is None:
                raise ValueError(f"{path}: row {i + 1}{_line_of_row(path, i)} has no {prompt_key!r} (--input-key)")
            tools = _tools_of(row, tool_key, path, i)
            # a row's tools also reach plugins (and the SFT loss mask) as metadata["tools"], as in current slime
            meta = row.get(metadata_key) or {}
            metadata.append({**meta, "tools": tools} if tools is not None else meta)
            if multimodal_keys:
                from slime.utils.processing_utils import fill_placeholders, process_vision_info

                where = f"{path}: row {i + 1}{_line_of_row(path, i)}"
                prompt = fill_placeholders(prompt, {m: row[c] for m, c in multimodal_keys.items()}, where)
                media.append(process_vision_info(prompt, processor, where))
            else:
                media.append(None)
            if apply_chat_template:
                if isinstance(prompt, str):  # a text prompt is one user message, as in current slime
                    prompt = [{"role": "user", "content": prompt}]
                prompt = tokenizer.apply_chat_template(
                    prompt, tools, tokenize=False, add_generation_prompt=True, **(apply_chat_template_kwargs or {})
                )
            prompts.append(prompt)
            rows.append(row)

        keep = self._within_length(prompts, tokenizer, max_length, media, processor)
        self.origin_samples = [
            Sample(
                prompt=prompt,
                label=row[label_key] if label_key is not None else None,
                metadata=meta,
                multimodal_inputs=mm,
            )
            for prompt, row, meta, mm, ok in zip(prompts, rows, metadata, media, keep)
            if ok
        ]
        self.origin_rows = [i for i, ok in enumerate(keep) if ok]  # file row of each sample, for messages
        self.seed = seed
        self.epoch_id = -1
        self.samples = self.origin_samples

    @staticmethod
    def _within_length(prompts, tokenizer, max_length, media=None, processor=None):
        """Which prompts are at most `max_length` tokens; message-list prompts (no template applied) are kept. A
        prompt with images is measured through the processor, after its placeholders expand to the image tokens."""
        keep = [True] * len(prompts)
        if max_length is None:
            return keep
        media = media or [None] * len(prompts)
        if processor is not None:
            from slime.utils.processing_utils import process_prompt

            for i, (p, mm) in enumerate(zip(prompts, media)):
                if isinstance(p, str) and mm:
                    keep[i] = len(process_prompt(processor, p, mm.get("images"), mm.get("videos"))[0]) <= max_length
        text_idx = [
            i for i, p in enumerate(prompts) if isinstance(p, str) and not (processor is not None and media[i])
        ]
        if text_idx:
            ids = tokenizer([prompts[i] for i in text_idx], add_special_tokens=False)["input_ids"]
            for i, toks in zip(text_idx, ids):
                keep[i] = len(toks) <= max_length
        return keep

    def shuffle(self, new_epoch_id):
        """Deterministic permutation of the original order for `new_epoch_id` (a no-op for the current epoch)."""
        if self.epoch_id == new_epoch_id:
            return
        permutation = list(range(len(self.origin_samples)))
        random.Random(self.seed + new_epoch_id).shuffle(permutation)  # == random.seed(seed+epoch); random.shuffle
        self.samples = [self.origin_samples[i] for i in permutation]
        self.epoch_id = new_epoch_id

    def __getitem__(self, idx):
        return self.samples[idx]

    def __len__(self):
        return len(self.samples)
