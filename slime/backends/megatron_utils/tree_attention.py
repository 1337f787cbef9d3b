"""`--tree-training` with `--tree-attention-backend flex`: the prefix tree's ancestor mask as a FlexAttention block
mask, so the attention kernel skips every block of (query, key) pairs no query sees instead of computing the dense
`[L, L]` scores and masking them (what the local spec's `DotProductAttention` does with the dense mask).

In the tree row (DFS order) key k is visible from query q iff k <= q <= subtree_end[k], so the mask is a function of
one length-L vector. Same values as the dense path: the tests compare the two forwards on CPU (eager FlexAttention);
FlexAttention has no CPU backward, so training with it is for GPUs, where both are compiled (`device.compile_kernels`).
"""

import functools

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from slime.utils import device

from .local_layers import MLADotProductAttention


def tree_block_mask(subtree_end: torch.Tensor) -> BlockMask:
    """The ancestor mask of a tree row whose token j's subtree ends at layout index `subtree_end[j]`."""

    def ancestor(b, h, q, k):
        return (k <= q) & (q <= subtree_end[k])

    n = subtree_end.numel()
    return _kernel(create_block_mask)(ancestor, None, None, n, n, device=subtree_end.device)


def _flex():
    return _kernel(flex_attention)


@functools.cache
def _kernel(fn):
    """`fn` compiled for any length where the device compiles kernels (a GPU: fused), else `fn` itself (eager)."""
    return torch.compile(fn, dynamic=True) if device.compile_kernels() else fn


class TreeFlexAttention(DotProductAttention):
    """Megatron's local core attention, which takes a tree row's `BlockMask` through FlexAttention; any other mask
    (the dense one) goes through `DotProductAttention` as without the flag."""

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if not isinstance(attention_mask, BlockMask):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, heads, d] -> [b, heads, s, d]
        # DotProductAttention divides the scale by the layer number under query-key layer scaling and multiplies the
        # scores back inside its softmax: the scores' scale is the same either way
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        out = _flex()(q, k, v, block_mask=attention_mask, scale=scale, enable_gqa=q.size(1) != k.size(1))
        return out.permute(2, 0, 1, 3).flatten(2)  # [s, b, heads * d], as DotProductAttention returns


class TreeFlexMLAAttention(TreeFlexAttention, MLADotProductAttention):
    """TreeFlexAttention for multi-latent attention's local core attention (v heads narrower than q/k heads)."""


# the local core attention a layer spec has -> the one that takes a tree's BlockMask
TREE_FLEX = {DotProductAttention: TreeFlexAttention, MLADotProductAttention: TreeFlexMLAAttention}
