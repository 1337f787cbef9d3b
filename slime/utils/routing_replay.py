"""MoE routing replay data on the rollout side (R3, `--use-rollout-routing-replay`).

SGLang (`--enable-return-routed-experts`, request field `return_routed_experts`) returns in `meta_info["routed_experts"]`
the base64 bytes of an int32 array `[seqlen - 1, num_hidden_layers, top_k]`: for every token of prompt + response
but the last (which the engine never computed), per decoder layer, the experts its router chose (dense layers hold
zeros). `Sample.rollout_routed_experts` keeps that array; the trainer replays it (`megatron_utils.routing_replay`).
"""

import base64

import numpy as np


def decode_routed_experts(meta_info: dict, num_tokens: int, num_layers: int, top_k: int, where: str) -> np.ndarray:
    """`meta_info["routed_experts"]` as an int32 `[num_tokens - 1, num_layers, top_k]` array; a missing or misshapen
    answer is an error naming `where` (never a silent fallback to the trainer's own routing)."""
    raw = meta_info.get("routed_experts")
    if raw is None:
        raise RuntimeError(
            f"{where}: the engine returned no routed_experts, which --use-rollout-routing-replay needs (SGLang must run "
            "with --enable-return-routed-experts, which slime sets for its engines)"
        )
    arr = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
    rows = num_tokens - 1
    if arr.size != rows * num_layers * top_k:
        raise RuntimeError(
            f"{where}: routed_experts holds {arr.size} expert ids, expected {rows} tokens x {num_layers} layers x "
            f"top-{top_k} = {rows * num_layers * top_k}"
        )
    return arr.reshape(rows, num_layers, top_k).copy()


def routed_experts_error(sample, num_layers: int, top_k: int) -> str | None:
    """Why a sample's `rollout_routed_experts` cannot be replayed (None when it can)."""
    routed = sample.rollout_routed_experts
    if routed is None:
        return "has no rollout_routed_experts"
    shape = tuple(np.shape(routed))
    want = (len(sample.tokens) - 1, num_layers, top_k)
    if shape != want:
        return f"has rollout_routed_experts of shape {shape}, expected {want} (tokens - 1, layers, top-k)"
    return None
