"""Forward matmul FLOPs of one packed sample, from the model's Megatron arguments: the workload `--balance-by-flops`
balances. Linear layers cost ~L per sample of L tokens, causal attention scores ~L²/2, so two samples of L tokens
cost less than one of 2L; token counts alone miss that."""


def forward_flops(args, seqlen: int) -> float:
    """2 * multiply-adds of the forward: per layer the QKV, output and MLP projections (an MoE layer counts its
    `--moe-router-topk` routed experts) and QKᵀ / AV over the causal half; then the output layer."""
    h, heads = args.hidden_size, args.num_attention_heads
    groups = args.num_query_groups if args.group_query_attention else heads
    d = args.kv_channels or h // heads
    ffn = args.moe_ffn_hidden_size * args.moe_router_topk if args.num_experts else args.ffn_hidden_size
    weights_per_token = h * (heads + 2 * groups) * d + heads * d * h + h * ffn * (3 if args.swiglu else 2)
    linear = 2 * seqlen * weights_per_token
    attention = 2 * 2 * heads * d * seqlen * seqlen / 2
    return args.num_layers * (linear + attention) + 2 * seqlen * h * (args.vocab_size or 0)
