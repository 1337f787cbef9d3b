"""After every weight push: does each engine serve exactly what the trainer pushed?

The trainer hashes every HF tensor it sends (`slime.utils.fingerprint`: tiles32 on a GPU, on the device; xxh3 on a
CPU; in the dtype it travels in); the source ranks' maps are merged into one per version. slime's CPU server hashes the HF
tensors it serves the same way (`/slime/weights_fingerprint`). The two must agree on every tensor the engine serves:
over the tensors both hold, a tensor whose bytes, layout or name differ stops the run in one line naming the engine,
the version, both fingerprints and the first differing tensor. Names only one side holds are left out: the trainer's
that the engine ignores by design (MTP layers), the engine's that no trainer sends (kept from the checkpoint); the
manager logs how many once.

SGLang engines report no HF-named hashes (their tensors are fused and sharded); for them the check is engine-vs-engine:
`/weights_checker checksum` per TP rank, sorted by rank, must be equal on every SGLang engine after the push.
"""

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
