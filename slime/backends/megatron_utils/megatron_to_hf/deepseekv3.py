"""DeepSeek-V3 / R1: multi-latent attention (q/kv low-rank projections and their latent norms), first-k dense
layers, sigmoid router with `e_score_correction_bias`, routed experts and plural `shared_experts`; MTP layers at
`model.layers.{num_hidden_layers + i}` (`--mtp-num-layers`)."""

from ._common import GPTFamily

FAMILY = GPTFamily("deepseekv3", features=("mla", "moe", "expert_bias", "shared_experts"), mtp="layers")


def convert_deepseekv3_to_hf(args, name, param):
    return FAMILY.to_hf(args, name, param)
