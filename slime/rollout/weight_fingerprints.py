"""After every weight push: does each engine serve exactly what the trainer pushed?

The trainer hashes every HF tensor it sends (`slime.utils.fingerprint`: tiles32 on a GPU, on the device; xxh3 on a
CPU; in the dtype it travels in); the source ranks' maps are merged into one per version. slime's CPU server hashes the HF
tensors it serves the same way (`/slime/weights_fingerprint`). The two must agree on every tensor the engine serves:
over the tensors both hold, a tensor whose bytes, layout or name differ stops the run in one line naming the engine,
the version, both fingerprints and the first differing tensor. Names only one side holds are left out: the trainer's
that the engine ignores by design (MTP layers), the engine's that no trainer sends (kept from the checkpoint); the
manager logs how many once.

SGLang engines report no HF-named hashes (their tensors are fused and sharded); for them two checks run on
`/weights_checker checksum` (SGLang's per-parameter hash, per TP rank): every SGLang engine reports the same checksums
(`sglang_disagreement`), and each engine's change since the previous push is the trainer's (`sglang_change_set_violation`).
"""

import re

from slime.utils.fingerprint import combine, first_difference


class WeightFingerprintError(RuntimeError):
    pass


def merge_rank_hashes(parts, version) -> dict:
    """One `{name: hash}` from the source ranks' maps; a name two ranks sent with different bytes is an error."""
    merged = {}
    for part in parts:
        for name, h in (part or {}).items():
            if merged.setdefault(name, h) != h:
                raise WeightFingerprintError(
                    f"weight version {version}: two trainer ranks sent {name!r} with different bytes "
                    f"({merged[name]} and {h}): the engines got one of them"
                )
    return merged


def engine_mismatch(trainer: dict, info: dict, version, engine: str) -> str | None:
    """Why `engine`'s report `info` (`/slime/weights_fingerprint`) does not match the trainer's map, or None."""
    if str(info.get("weight_version")) != str(version):
        return f"{engine} reports weight version {info.get('weight_version')!r} after the push of version {version}"
    served = info.get("tensor_hashes") or {}
    both = [n for n in served if n in trainer]
    if not both:
        return f"{engine} reports no hash of any tensor the trainer pushed for version {version} (weights released?)"
    # over the tensors both hold: a tensor the engine serves that no trainer sends (e.g. a vision tower the trainer
    # does not hold) keeps the checkpoint's bytes, and a name the engine ignores (MTP layers) is not served
    expected, got_hashes = {n: trainer[n] for n in both}, {n: served[n] for n in both}
    want, got = combine(expected), combine(got_hashes)
    if want == got:
        return None
    diff = first_difference(expected, got_hashes) or "none per tensor (the combined values differ)"
    return (
        f"{engine} serves weight version {version} with fingerprint {got}, the trainer pushed {want}; "
        f"first differing tensor: {diff}"
    )


def adapter_mismatch(trainer: dict, info: dict, version, adapter: str, engine: str) -> str | None:
    """`--lora-sync adapter`: why `engine`'s report `info` (`/slime/weights_fingerprint?adapter=NAME`: the hashes of
    the adapter it loaded under that name, its tensors as they arrived) does not match the trainer's map of the
    adapter it pushed (PEFT names, the dtype they travel in), or None. Every tensor counts: the adapter is pushed
    whole, so a tensor on one side only is a difference."""
    if str(info.get("weight_version")) != str(version):
        return f"{engine} reports weight version {info.get('weight_version')!r} after the push of version {version}"
    served = info.get("adapter_tensor_hashes")
    if served is None:
        return f"{engine} serves no LoRA adapter {adapter!r} after the push of weight version {version}"
    diff = first_difference(trainer, served)
    if diff is None:
        return None
    return (
        f"{engine} serves LoRA adapter {adapter!r} of weight version {version} with fingerprint {combine(served)}, "
        f"the trainer pushed {combine(trainer)}; first differing tensor: {diff}"
    )


def sglang_disagreement(payloads: dict) -> str | None:
    """`{engine: /weights_checker checksum response}` of SGLang engines: None when every engine reports the same
    per-rank checksums (ranks sorted by their global rank), else which engine differs from the first and where."""

    def ranks(body):
        out = []
        for r in body.get("ranks") or []:
            info = (r.get("parallelism_info") or [{}])[0]
            out.append((info.get("rank", 0), r.get("checksums") or {}))
        return [c for _, c in sorted(out, key=lambda x: x[0])]

    items = list(payloads.items())
    if len(items) < 2:
        return None
    ref_engine, ref = items[0][0], ranks(items[0][1])
    for engine, body in items[1:]:
        got = ranks(body)
        if len(got) != len(ref):
            return f"{engine} reports {len(got)} ranks, {ref_engine} {len(ref)}"
        for k, (a, b) in enumerate(zip(ref, got)):
            if a != b:
                name = next(n for n in sorted(set(a) | set(b)) if a.get(n) != b.get(n))
                return (
                    f"{engine} and {ref_engine} differ on rank {k} parameter {name!r} ({b.get(name)} vs {a.get(name)})"
                )
    return None


# ------------------------------------------------------------------ SGLang's change-set rule
# Families whose HF tensors SGLang 0.5.23 loads by `sglang_param_names`' rules (sglang/srt/models/{llama,qwen2,
# qwen2_moe,qwen3,qwen3_moe,mimo,glm4,glm4_moe,qwen3_next,qwen3_5,qwen2_5_vl,qwen3_vl_moe,minimax_m2}.py `load_weights`:
# `stacked_params_mapping`, `FusedMoE.make_expert_params_mapping`; DeepSeek's in
# models/deepseek_common/deepseek_weight_loader.py).
SGLANG_MAPPED_FAMILIES = (
    "llama", "qwen2", "qwen3", "qwen3moe", "mimo", "glm4", "glm4moe", "qwen3next", "qwen35", "qwen25vl", "deepseek",
    "minimaxm2",
)  # fmt: skip
_STACKED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    # Qwen3.5's Gated DeltaNet projections (Qwen3-Next's checkpoints hold them fused already)
    "in_proj_qkv": "in_proj_qkvz",
    "in_proj_z": "in_proj_qkvz",
    "in_proj_b": "in_proj_ba",
    "in_proj_a": "in_proj_ba",
    # DeepSeek's MLA with a q LoRA rank: both down-projections load into one parameter (once both arrived in the
    # same load: SGLang caches the first)
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
}
_PROJ = re.compile(r"\.(" + "|".join(_STACKED) + r")\.")
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.")  # w*: Mixtral's names
_SHARED_EXPERTS = re.compile(r"\.shared_experts?\.(gate_proj|up_proj|down_proj)\.")


def sglang_names_known(model_name) -> bool:
    """Whether `sglang_param_names` holds for this `--model-name` (matched as the converters are: lowercased, without
    "_" and "-")."""
    key = (model_name or "").lower().replace("_", "").replace("-", "")
    return any(s in key for s in SGLANG_MAPPED_FAMILIES)


def _sglang_spellings(hf_name: str) -> tuple:
    """`hf_name` as SGLang's loaders may rename it before mapping: itself; without a vision-language checkpoint's
    `model.language_model.` prefix (Qwen3-VL, Qwen3.5); and without `.self_attn` too (Qwen3-Next, Qwen3.5, whose
    attention layers hold the projections directly). A vision tower's `attn.qkv` is SGLang's `attn.qkv_proj`."""
    if "visual." in hf_name:
        return (hf_name.replace("model.visual.", "visual.", 1).replace(".attn.qkv.", ".attn.qkv_proj.", 1),)
    bare = hf_name.replace("model.language_model.", "model.", 1)
    return tuple(dict.fromkeys((hf_name, bare, bare.replace(".self_attn.", ".", 1))))


def sglang_param_names(hf_name: str) -> tuple:
    """The SGLang parameter HF tensor `hf_name` loads into, by name only, as candidates in order (the first one the
    engine reports is it): q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj, Qwen3.5's in_proj_qkv/z ->
    in_proj_qkvz and in_proj_b/a -> in_proj_ba, DeepSeek's q_a_proj/kv_a_proj_with_mqa ->
    fused_qkv_a_proj_with_mqa, routed expert e's gate/up_proj (Mixtral-style w1/w3) -> experts.w13_<suffix>, its
    down_proj (w2) -> experts.w2_<suffix>, shared experts (GLM-4.5's and DeepSeek's shared_experts.*, Qwen3-Next's
    shared_expert.*) -> fused as above or, with SGLang's shared-expert fusion, as one more routed expert; then, but
    for a routed expert (always fused), the name itself (e.g. DeepSeek-V2-Lite's q_proj and unfused
    kv_a_proj_with_mqa), which is also where any other name loads (a tied lm_head is not sent: the engine's lm_head is
    embed_tokens). Each in every spelling of `_sglang_spellings`."""
    spellings = _sglang_spellings(hf_name)
    if _ROUTED_EXPERT.search(hf_name):  # before q/k/v/gate/up: SGLang skips the stacked mapping for "mlp.experts"
        return tuple(_fused_expert(name, _ROUTED_EXPERT.search(name)) for name in spellings)
    out = []
    for name in spellings:
        out.append(_PROJ.sub(lambda m: f".{_STACKED[m.group(1)]}.", name, count=1))
        shared = _SHARED_EXPERTS.search(name)
        if shared:
            out.append(_fused_expert(name, shared))
    return tuple(dict.fromkeys(out + list(spellings)))


def _fused_expert(name, m):
    return (
        name[: m.start()]
        + (".experts.w2_" if m.group(1) in ("down_proj", "w2") else ".experts.w13_")
        + name[m.end() :]
    )


def _per_rank(body) -> dict:
    """{(rank, SGLang parameter): checksum} of one `/weights_checker checksum` response."""
    out = {}
    for r in (body or {}).get("ranks") or []:
        rank = (r.get("parallelism_info") or [{}])[0].get("rank", 0)
        out.update({(rank, name): c for name, c in (r.get("checksums") or {}).items()})
    return out


def sglang_change_set_violation(prev: dict, cur: dict, before, after, engine: str, version, names_known=True):
    """Why SGLang engine `engine`'s change from checksum response `before` (the previous push's check) to `after` is
    not the trainer's change from `prev` to `cur` ({HF name: hash} of the two versions), or None. A parameter counts
    as changed if its checksum changed on any rank.

    (a) the trainer changed a tensor the engine loads (any, for a family whose names are unknown) => some parameter of
        the engine changed ("nobody received the update");
    (b) a changed parameter must be one some changed HF tensor loads into; a parameter no HF tensor maps onto may
        change only while a changed HF tensor has no parameter of the engine's (it may load there, by another name);
    (c) every changed HF tensor that maps onto a parameter of the engine changes it.
    With `names_known` False only (a) is checked."""
    b, a = _per_rank(before), _per_rank(after)
    changed = {key[1] for key in set(a) | set(b) if a.get(key) != b.get(key)}
    served = {name for _, name in a}
    target = {h: next((p for p in sglang_param_names(h) if p in served), None) if names_known else None for h in cur}
    changed_hf = sorted(h for h in cur if prev.get(h) != cur[h])
    if changed_hf and not changed and (not names_known or any(target[h] for h in changed_hf)):
        return (
            f"{engine}: the trainer changed {len(changed_hf)} tensor(s) for weight version {version} (e.g. "
            f"{changed_hf[0]!r}) but none of the engine's parameter checksums changed: the update did not reach it"
        )
    if not names_known:
        return None
    for h in changed_hf:  # (c)
        if target[h] is not None and target[h] not in changed:
            return (
                f"{engine}: HF tensor {h!r} changed in weight version {version} but {target[h]!r}, the SGLang "
                "parameter it loads into, did not"
            )
    sources = {target[h] for h in changed_hf}
    mapped = set(target.values())
    unmapped_changed = None in sources
    for p in sorted(changed - sources):  # (b)
        if p not in mapped and unmapped_changed:
            continue
        return (
            f"{engine}: SGLang parameter {p!r} changed in weight version {version} but no HF tensor the trainer "
            "changed loads into it"
        )
    return None
