"""Weight versions: the label of the weights an engine serves, and per-token version spans (SGLang 0.5.23's format).

Every engine slime starts serves `INITIAL_WEIGHT_VERSION` until the first push (the weights of --hf-checkpoint);
every push labels the engines with the trainer's next integer version. SGLang reports, for every finished request,
`meta_info.weight_version` (the label at finish) and `meta_info.weight_versions`: spans
`[{"version": str, "start": int, "end": int}]` over the request's output tokens (end exclusive), one per label the
request's tokens were decoded under (`sglang/srt/utils/weight_versions.py`). slime's CPU server emits the same.
"""

INITIAL_WEIGHT_VERSION = "0"  # the --hf-checkpoint weights: version 0, as the trainer counts (its first push is 1)


def compute_spans(events, current_version: str, num_output_tokens: int) -> list[dict]:
    """SGLang's `compute_weight_version_spans`: `events` are (old_version, output tokens so far) recorded at each
    label change while the request had output; the tokens after the last change are `current_version`'s."""
    spans = []
    for version, end in [*events, (current_version, num_output_tokens)]:
        end = min(end, num_output_tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


def call_spans(meta_info: dict, num_new_tokens: int | None = None) -> list[dict]:
    """The version spans of one generate call's output tokens (offsets within the call's output), from SGLang's
    `meta_info.weight_versions`, else one span of `meta_info.weight_version` over all of them (an engine that reports
    no spans: older SGLang). Empty when the call reports no version or its token count is unknown."""
    n = num_new_tokens
    spans = meta_info.get("weight_versions")
    if isinstance(spans, list) and spans:
        out = []
        for s in spans:
            start, end = int(s["start"]), int(s["end"])
            if n is not None:
                start, end = min(start, n), min(end, n)
            if end > start:
                out.append({"version": str(s["version"]), "start": start, "end": end})
        return out
    version = meta_info.get("weight_version")
    if version is None:
        return []
    if n is None:
        n = meta_info.get("completion_tokens")
        if n is None and meta_info.get("output_token_logprobs") is not None:
            n = len(meta_info["output_token_logprobs"])
    return [{"version": str(version), "start": 0, "end": int(n)}] if n else []


def append_spans(spans: list[dict], new: list[dict], offset: int) -> list[dict]:
    """`spans` (over a sample's response) extended by one call's spans placed at response `offset`; a span that
    continues the previous one under the same version is merged into it."""
    for s in new:
        start, end = s["start"] + offset, s["end"] + offset
        if spans and spans[-1]["version"] == s["version"] and spans[-1]["end"] == start:
            spans[-1]["end"] = end
        else:
            spans.append({"version": s["version"], "start": start, "end": end})
    return spans
