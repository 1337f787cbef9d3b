"""The sampling parameters a generation was sampled with, normalised as SGLang applies them, and their record on a
`Sample`.

SGLang (0.5.23) normalises a request's `sampling_params` before sampling: a temperature below 1e-6 is greedy
(temperature 1, top_k 1), top_k -1 is the whole vocabulary, and the penalties default to 0 (frequency, presence) and
1 (repetition). `applied_sampling_params` computes that normalised form from a request's `sampling_params`; slime's
CPU server echoes the same form, from what it actually applied, as `meta_info["sampling_params"]`. Real SGLang echoes
no sampling parameter, so on GPU the record comes from the request slime sent.

A sample's record is `sample.metadata["sampling_params"]`: one dict per engine call (segment) whose sampled tokens
are in the sample, with the normalised parameters plus `response_span` ([start, end) in the response), `source` (the
code that sent the request: the default generate, an agent adapter), `origin` ("engine echo" or "request") and,
when the request body is passed, `lora_path` (the adapter the request named, None for the base model). SGLang's
response says nothing of the adapter that served it, so that one always comes from the request.
"""

import json
import os

import numpy as np

GREEDY_EPS = 1e-6  # SGLang's sampling_params.py: a temperature below this is greedy
META_KEY = "sampling_params"  # the CPU server's meta_info key and the Sample.metadata key of the record
TEMPERATURES_KEY = "rollout_temperatures"  # the train-data key of each response token's sampling temperature
ADAPTER_KEY = "lora_path"  # a segment record's adapter (SGLang's request field)
# logit processors whose effect on the behaviour distribution the trainer cannot replay (present or not)
PROCESSOR_KEYS = ("logit_bias", "regex", "json_schema", "ebnf", "structural_tag", "custom_logit_processor")


def _get(d, key, default):
    v = d.get(key)
    return default if v is None else v


# SGLang 0.5.23's OpenAI endpoints (entrypoints/openai/protocol.py): what a request that leaves one of these out gets.
# /v1/chat/completions first takes the model's generation_config.json (`ModelConfig.get_default_sampling_params`, under
# `--sampling-defaults model`, SGLang's default); /v1/completions never does.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_config_defaults(model_dir) -> dict:
    """The sampling defaults SGLang takes from `model_dir`'s generation_config.json for chat requests (the keys of
    `OPENAI_DEFAULTS` it sets); {} without one."""
    path = os.path.join(model_dir or "", "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        config = json.load(f)
    return {k: config[k] for k in OPENAI_DEFAULTS if config.get(k) is not None}


def openai_sampling_params(body: dict, model_defaults: dict) -> dict:
    """The `sampling_params` SGLang builds from an OpenAI request `body` (those that change the distribution): each
    of `OPENAI_DEFAULTS` from the request, else `model_defaults` (a chat request's generation-config defaults; {} for
    /v1/completions), else OpenAI's; the penalties and min_tokens as sent."""
    sp = {k: _get(body, k, model_defaults.get(k, v)) for k, v in OPENAI_DEFAULTS.items()}
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) is not None:
            sp[key] = body[key]
    if body.get("min_tokens") is not None:
        sp["min_new_tokens"] = body["min_tokens"]
    # the logit processors SGLang builds from the body (protocol.py's to_sampling_params): recorded, so a sample
    # they shaped is refused by the trainer, and asked of the engine (the CPU server refuses the grammars)
    for key in ("logit_bias", "regex", "ebnf"):
        if body.get(key):
            sp[key] = body[key]
    kind = (body.get("response_format") or {}).get("type") if isinstance(body.get("response_format"), dict) else None
    if kind in ("json_schema", "json_object"):
        sp["json_schema"] = json.dumps(body["response_format"].get("json_schema") or {"type": "object"})
    elif kind == "structural_tag":
        sp["structural_tag"] = json.dumps(body["response_format"])
    return sp


def applied_sampling_params(sampling_params: dict | None, *, custom_logit_processor=False) -> dict:
    """The normalised sampling parameters SGLang applies for a request's `sampling_params` (a request-level
    `custom_logit_processor` is passed separately: it is not a sampling parameter)."""
    sp = sampling_params or {}
    temperature, top_k = float(_get(sp, "temperature", 1.0)), int(_get(sp, "top_k", -1))
    if temperature < GREEDY_EPS:
        temperature, top_k = 1.0, 1
    return normalised(
        temperature=temperature,
        top_p=float(_get(sp, "top_p", 1.0)),
        top_k=top_k,
        min_p=float(_get(sp, "min_p", 0.0)),
        frequency_penalty=float(_get(sp, "frequency_penalty", 0.0)),
        presence_penalty=float(_get(sp, "presence_penalty", 0.0)),
        repetition_penalty=float(_get(sp, "repetition_penalty", 1.0)),
        min_new_tokens=int(_get(sp, "min_new_tokens", 0)),
        **{k: bool(sp.get(k)) for k in PROCESSOR_KEYS if k != "custom_logit_processor"},
        custom_logit_processor=bool(custom_logit_processor),
    )


def normalised(
    *,
    temperature,
    top_p,
    top_k,
    min_p,
    frequency_penalty,
    presence_penalty,
    repetition_penalty,
    min_new_tokens,
    logit_bias,
    regex=False,
    json_schema=False,
    ebnf=False,
    structural_tag=False,
    custom_logit_processor=False,
) -> dict:
    """The record's shape (shared by the CPU server's echo and slime's own normalisation)."""
    return {
        "temperature": float(temperature),
        "top_p": float(top_p),
        "top_k": int(top_k) if int(top_k) > 0 else -1,
        "min_p": float(min_p),
        "frequency_penalty": float(frequency_penalty),
        "presence_penalty": float(presence_penalty),
        "repetition_penalty": float(repetition_penalty),
        "min_new_tokens": int(min_new_tokens),
        "logit_bias": bool(logit_bias),
        "regex": bool(regex),
        "json_schema": bool(json_schema),
        "ebnf": bool(ebnf),
        "structural_tag": bool(structural_tag),
        "custom_logit_processor": bool(custom_logit_processor),
    }


def requested_adapter(body: dict):
    """The adapter a one-prompt `/generate` body names (SGLang's `lora_path`: a name, or a list of one), else None."""
    lora = body.get("lora_path")
    return lora[0] if isinstance(lora, list) and len(lora) == 1 else lora


def openai_requested_adapter(body: dict, served_model_name: str | None = None):
    """The adapter an OpenAI request names, as SGLang resolves it: `model: "<base>:<adapter>"` wins over
    `lora_path`. A `model` equal to the served name is no adapter, even with a colon in it; without the served name
    a colon splits."""
    model = body.get("model")
    if isinstance(model, str) and ":" in model and model != served_model_name:
        if served_model_name and model.startswith(f"{served_model_name}:"):
            adapter = model[len(served_model_name) + 1 :]
        else:
            adapter = model.split(":", 1)[1]
        if adapter.strip():
            return adapter.strip()
    return requested_adapter(body)


def segment_record(meta_info: dict | None, sent: dict | None, *, start: int, end: int, source: str, body=None):
    """One segment's record: the engine's echo (`meta_info["sampling_params"]`) when it has one, else the
    normalised form of the `sampling_params` slime sent (`body`: the whole request, for `custom_logit_processor` and
    the adapter it named)."""
    echo = (meta_info or {}).get(META_KEY)
    if isinstance(echo, dict):
        params, origin = dict(echo), "engine echo"
    else:
        params = applied_sampling_params(sent, custom_logit_processor=bool((body or {}).get("custom_logit_processor")))
        origin = "request"
    record = {**params, "response_span": [int(start), int(end)], "source": source, "origin": origin}
    if body is not None:
        record[ADAPTER_KEY] = requested_adapter(body)
    return record


def record_segment(sample, meta_info, sent, *, start: int, end: int, source: str, body=None) -> None:
    """Append one segment's record to `sample.metadata["sampling_params"]` (a fresh list: never a shared one)."""
    if sample.metadata is None:
        sample.metadata = {}
    records = list(sample.metadata.get(META_KEY) or [])
    records.append(segment_record(meta_info, sent, start=start, end=end, source=source, body=body))
    sample.metadata[META_KEY] = records


def response_temperatures(sample, default: float):
    """float32 [response_length]: the temperature each response token was sampled at, from the sample's record
    (`default`, the flag's, where no segment covers a token), or None when every token was sampled at `default`."""
    records = (sample.metadata or {}).get(META_KEY) if isinstance(sample.metadata, dict) else None
    temps = np.full(sample.response_length, default, dtype=np.float32)
    for rec in records or ():
        t = rec.get("temperature")
        if t is not None:
            start, end = rec.get("response_span") or (0, sample.response_length)
            temps[start:end] = t
    return None if np.all(temps == np.float32(default)) else temps
