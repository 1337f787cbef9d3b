"""MiniMax-M2: attention with one q/k RMSNorm over all heads (`self_attn.q_norm` / `k_norm`), sigmoid routing with a
score-correction bias, and Mixtral's MoE names: `block_sparse_moe.gate`, `block_sparse_moe.e_score_correction_bias`,
experts' `w1` (gate), `w3` (up), `w2` (down), as its published checkpoints (and transformers' save) spell them."""

import re

from ._common import GPTFamily

_MOE_NAMES = (
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".block_sparse_moe.e_score_correction_bias"),
    (re.compile(r"\.mlp\.gate\.weight$"), ".block_sparse_moe.gate.weight"),
    (re.compile(r"\.mlp\.experts\.(\d+)\.gate_proj\."), r".block_sparse_moe.experts.\1.w1."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.up_proj\."), r".block_sparse_moe.experts.\1.w3."),
    (re.compile(r"\.mlp\.experts\.(\d+)\.down_proj\."), r".block_sparse_moe.experts.\1.w2."),
)


def _hf_name(name):
    for pattern, replacement in _MOE_NAMES:
        name, n = pattern.subn(replacement, name)
        if n:
            return name
    return name


class MiniMaxM2Family(GPTFamily):
    def _layer_to_hf(self, args, pre, rest, param):
        out = super()._layer_to_hf(args, pre, rest, param)
        return out and [(_hf_name(name), t) for name, t in out]


FAMILY = MiniMaxM2Family("minimaxm2", features=("full_qk_norm", "moe", "expert_bias"))


def convert_minimax_m2_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
