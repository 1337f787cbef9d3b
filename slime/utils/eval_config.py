"""Per-dataset evaluation settings: `--eval-config PATH`, resolved once at start-up into `args.eval_datasets`.

The file is YAML or JSON. Its root is an `eval:` mapping or the mapping itself, holding `defaults: {field: value}`
and `datasets:`, a list of entries with `name` or a mapping keyed by name. Each dataset has a `path` and any field
of `EvalDatasetConfig`. A field resolves as: the dataset's entry, else `defaults`, else the command line through
`ARG_CHAINS` (e.g. `temperature`: --eval-temperature, else --rollout-temperature). Without a file, the
`--eval-prompt-data` name/path pairs resolve the same way, so the default eval always reads `args.eval_datasets`.
"""

import contextlib
import copy
import dataclasses
import json
import numbers
import os

import yaml

# field -> the args that supply it when neither the dataset nor `defaults` sets it (the first one set wins)
ARG_CHAINS = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt", "n_samples_per_prompt"),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "min_new_tokens": ("eval_min_new_tokens",),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "tool_key": ("eval_tool_key", "tool_key"),
    "metadata_key": ("metadata_key",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "custom_rm_path": ("eval_custom_rm_path", "custom_rm_path"),
    "multimodal_keys": ("multimodal_keys",),
}


@dataclasses.dataclass
class EvalDatasetConfig:
    """One eval dataset, every field resolved. None means "not set": the default eval then keeps the rollout's own
    behaviour (e.g. `skip_special_tokens`, `--custom-generate-function-path`)."""

    name: str
    path: str
    rm_type: str | None = None  # put into each sample's metadata["rm_type"]
    custom_rm_path: str | None = None  # each sample's custom_rm_path
    custom_generate_function_path: str | None = None  # each sample's generate_function_path
    input_key: str | None = None
    label_key: str | None = None
    tool_key: str | None = None
    metadata_key: str | None = None
    apply_chat_template: bool | None = None
    apply_chat_template_kwargs: dict | None = None  # the chat template's extra arguments, e.g. enable_thinking
    n_samples_per_eval_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_response_len: int | None = None
    min_new_tokens: int | None = None
    stop: list | None = None
    stop_token_ids: list | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    metadata_overrides: dict = dataclasses.field(default_factory=dict)  # merged into each sample's metadata
    # media type -> column (as --multimodal-keys; `{}`: a text-only dataset in a run on images)
    multimodal_keys: dict | None = None

    @property
    def cache_key(self):
        """What the loaded prompts depend on (datasets that share it share one load)."""
        media = tuple(sorted((self.multimodal_keys or {}).items()))
        return (
            self.path,
            self.input_key,
            self.label_key,
            self.tool_key,
            self.metadata_key,
            self.apply_chat_template,
            json.dumps(self.apply_chat_template_kwargs or {}, sort_keys=True),
            media,
        )

    def inject_metadata(self, metadata) -> dict:
        """A sample's metadata with this dataset's `rm_type` and `metadata_overrides` applied."""
        out = dict(metadata) if isinstance(metadata, dict) else {}
        if self.rm_type is not None:
            out["rm_type"] = self.rm_type
        out.update(self.metadata_overrides)
        return out

    def sampling_params(self, base: dict) -> dict:
        """`base` (the rollout's sampling params) with this dataset's set values."""
        params = dict(base)
        params.update(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, max_new_tokens=self.max_response_len
        )
        for key in (
            "min_new_tokens",
            "stop",
            "stop_token_ids",
            "repetition_penalty",
            "skip_special_tokens",
            "no_stop_trim",
        ):
            if getattr(self, key) is not None:
                params[key] = getattr(self, key)
        return params


FIELDS = {f.name for f in dataclasses.fields(EvalDatasetConfig)}
# expected types of the fields users write (bool is rejected where a number is expected)
_TYPES = {
    **dict.fromkeys(
        (
            "name",
            "path",
            "rm_type",
            "custom_rm_path",
            "custom_generate_function_path",
            "input_key",
            "label_key",
            "tool_key",
            "metadata_key",
        ),
        ((str,), "a string"),
    ),
    **dict.fromkeys(("apply_chat_template", "skip_special_tokens", "no_stop_trim"), ((bool,), "true or false")),
    **dict.fromkeys(
        ("n_samples_per_eval_prompt", "top_k", "max_response_len", "min_new_tokens"), ((int,), "an integer")
    ),
    **dict.fromkeys(("temperature", "top_p", "repetition_penalty"), ((numbers.Real,), "a number")),
    "stop": ((list, str), "a string or a list of strings"),
    "stop_token_ids": ((list,), "a list of token ids"),
    "metadata_overrides": ((dict,), "a mapping"),
    "apply_chat_template_kwargs": ((dict,), "a mapping, e.g. {enable_thinking: false}"),
    "multimodal_keys": ((dict, str), 'a mapping of media type to column, e.g. {"image": "images"}'),
}
# value bounds, as the command-line flags they stand for
_BOUNDS = {
    "n_samples_per_eval_prompt": (lambda v: v >= 1, ">= 1"),
    "max_response_len": (lambda v: v >= 1, ">= 1"),
    "min_new_tokens": (lambda v: v >= 0, ">= 0"),
    "temperature": (lambda v: v >= 0, ">= 0"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"),
}


def _read(path, error):
    try:
        with open(path) as f:
            text = f.read()
        return json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as e:
        kind = "JSON" if path.endswith(".json") else "YAML"
        error(f"--eval-config {path}: cannot read it as {kind} ({type(e).__name__}: {' '.join(str(e).split())})")


def _check_value(where, key, value, error):
    if key not in FIELDS:
        error(f"{where}: unknown key {key!r}; known keys: {', '.join(sorted(FIELDS - {'name'}))}")
    if value is None:
        return
    types, what = _TYPES[key]
    bad_bool = isinstance(value, bool) and bool not in types
    if bad_bool or not isinstance(value, types):
        error(f"{where}.{key}: expected {what}, got {value!r}")
    if isinstance(value, str) and "${" in value:
        error(f"{where}.{key}: {value!r}: interpolations (${{...}}) are not resolved; write the value itself")
    if key == "stop" and isinstance(value, list) and not all(isinstance(s, str) for s in value):
        error(f"{where}.stop: expected a string or a list of strings, got {value!r}")
    if key == "stop_token_ids" and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        error(f"{where}.stop_token_ids: expected a list of token ids, got {value!r}")
    if key in _BOUNDS and not _BOUNDS[key][0](value):
        error(f"{where}.{key}: {value} must be {_BOUNDS[key][1]}")
    if key == "multimodal_keys" and value != {}:
        from slime.utils.processing_utils import parse_multimodal_keys

        try:
            parse_multimodal_keys(value, f"{where}.multimodal_keys")
        except ValueError as e:
            error(str(e))


def _dataset_entries(path, datasets, error):
    """[(where, entry)] from a list of entries with `name` or a mapping keyed by name; `where` names the entry in
    error lines."""
    where = f"--eval-config {path}"
    if isinstance(datasets, dict):
        entries = []
        for name, entry in datasets.items():
            entry = {} if entry is None else entry
            if not isinstance(entry, dict):
                error(f"{where}: datasets.{name} is {type(entry).__name__}, not a mapping of its fields")
            if "name" in entry and entry["name"] != name:
                error(f"{where}: datasets.{name} has name {entry['name']!r}; the key is its name")
            entries.append((f"{where}: datasets.{name}", {**entry, "name": str(name)}))
        return entries
    if isinstance(datasets, list):
        entries = []
        for i, entry in enumerate(datasets):
            if not isinstance(entry, dict):
                error(f"{where}: datasets[{i}] is {type(entry).__name__}, not a mapping with name and path")
            if not entry.get("name"):
                error(f"{where}: datasets[{i}] has no `name`")
            entries.append((f"{where}: datasets.{entry['name']}", entry))
        return entries
    error(f"{where}: `datasets` must be a list of entries with `name`, or a mapping keyed by name")


def resolve(args, entries, defaults):
    """EvalDatasetConfigs of the dataset `entries` (mappings): dataset entry > `defaults` > the args of ARG_CHAINS."""
    datasets = []
    for entry in entries:
        values = copy.deepcopy({**defaults, **entry})
        for key, chain in ARG_CHAINS.items():
            if key == "custom_rm_path" and values.get("rm_type"):
                continue  # the dataset's own rm_type, not the command line's reward function
            if values.get(key) is None:
                values[key] = next((getattr(args, a) for a in chain if getattr(args, a) is not None), None)
        values["metadata_overrides"] = values.get("metadata_overrides") or {}
        if isinstance(values.get("multimodal_keys"), str):  # --multimodal-keys's JSON (its own check refuses bad JSON)
            with contextlib.suppress(json.JSONDecodeError):
                values["multimodal_keys"] = json.loads(values["multimodal_keys"])
        datasets.append(EvalDatasetConfig(**values))
    return datasets


def load_eval_config(path, args, error):
    """The datasets of the eval config file at `path`, resolved against `args`; every mistake is one `error` line
    naming the file and the key."""
    where = f"--eval-config {path}"
    if not os.path.isfile(path):
        error(f"{where}: no such file.")
    config = _read(path, error)
    if isinstance(config, dict) and set(config) == {"eval"}:
        config = config["eval"]
    if not isinstance(config, dict):
        error(f"{where}: expected a mapping with `datasets` (and optional `defaults`), at the root or under `eval:`")
    unknown = sorted(set(config) - {"defaults", "datasets"})
    if unknown:
        error(
            f"{where}: unknown top-level key {unknown[0]!r}; expected `defaults` and `datasets` (optionally under `eval:`)"
        )
    defaults = config.get("defaults") or {}
    if not isinstance(defaults, dict):
        error(f"{where}: `defaults` must be a mapping of dataset fields, got {type(defaults).__name__}")
    for key, value in defaults.items():
        if key in ("name", "path"):
            error(f"{where}: defaults.{key}: each dataset sets its own {key}")
        _check_value(f"{where}: defaults", key, value, error)
    entries = _dataset_entries(path, config.get("datasets"), error)
    if not entries:
        error(f"{where}: no datasets; `datasets` must define at least one")
    names = [e["name"] for _, e in entries]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        error(f"{where}: dataset {duplicate!r} is defined twice")
    for dataset_where, entry in entries:
        if not entry.get("path"):
            error(f"{dataset_where}: no `path` (the prompt file)")
        for key, value in entry.items():
            _check_value(dataset_where, key, value, error)
    for place, rm_type in [(f"{where}: defaults", defaults.get("rm_type"))] + [
        (w, e.get("rm_type")) for w, e in entries
    ]:
        if rm_type:
            from slime.rollout.rm_hub import RM_TYPES  # lazy: the reward hub's imports cost ~1 s

            if rm_type.removeprefix("boxed_") not in RM_TYPES:
                error(f"{place}.rm_type: {rm_type!r} is unknown; expected one of {', '.join(RM_TYPES)}")
    return resolve(args, [entry for _, entry in entries], defaults)


def from_prompt_data(args):
    """EvalDatasetConfigs of the `--eval-prompt-data` name/path pairs (no file: every field from the args)."""
    pairs = args.eval_prompt_data or []
    return resolve(args, [{"name": pairs[i], "path": pairs[i + 1]} for i in range(0, len(pairs), 2)], {})


def eval_datasets(args):
    """The datasets the default eval runs: `args.eval_datasets` as parse_args resolved them, else (args built
    without it) the `--eval-prompt-data` pairs resolved now."""
    return args.eval_datasets if args.eval_datasets is not None else from_prompt_data(args)
