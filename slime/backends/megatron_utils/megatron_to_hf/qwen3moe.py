"""Qwen3-MoE: Qwen3 attention (q/k norm) + router `mlp.gate` and per-expert gate/up/down projections.

Expert indices in names are global (`named_parameters` adds the expert-parallel offset); both the local-spec
`mlp.experts.local_experts.<e>.linear_fc1.weight` and TE grouped `mlp.experts.linear_fc1.weight<e>` forms map to
HF `mlp.experts.<e>.{gate,up,down}_proj.weight`.
"""

from ._common import GPTFamily

FAMILY = GPTFamily("qwen3moe", features=("qk_norm", "moe"))


def convert_qwen3moe_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
