"""Core attention for context parallelism without Transformer Engine (the local spec, e.g. on CPU).

megatron-core's own `DotProductAttention` refuses CP > 1 (only TE implements it). This one gathers keys and values
of the whole sequence over the CP group and runs megatron's attention math on the rank's zigzag query chunks. The
causal mask, in global positions, comes from the batch (`data._padded_layout`), so it stays correct for the zigzag
layout. It is TE's `cp_comm_type="all_gather"` in plain torch: no overlap, memory of the whole sequence's K/V.
"""

import copy

from megatron.core import parallel_state as mpu
from megatron.core.transformer.dot_product_attention import DotProductAttention

from slime.backends.megatron_utils.cp_utils import gather_sequence_across_cp, local_global_positions


class AllGatherKVDotProductAttention(DotProductAttention):
    def __init__(self, config, *args, **kwargs):
        # the parent refuses CP > 1 only because it cannot gather; the gather happens here, before it runs
        local_config = copy.copy(config)
        local_config.context_parallel_size = 1
        super().__init__(local_config, *args, **kwargs)
        self.cp_group = mpu.get_context_parallel_group()

    def _gather(self, local):
        """`[s_local, ...]` zigzag chunks of every CP rank -> `[s_global, ...]` in sequence order; the backward sums
        every rank's key/value gradients into the chunks that produced them (`gather_sequence_across_cp`)."""
        index, total = local_global_positions(local.size(0), self.cp_group.size(), self.cp_group.rank())
        return gather_sequence_across_cp(local, index, total, self.cp_group)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        assert attention_mask is not None and attention_mask.size(-1) == key.size(0) * self.cp_group.size(), (
            "context-parallel attention needs the batch's [b, 1, s_local, s_global] mask (data._padded_layout)"
        )
        return super().forward(
            query,
            self._gather(key),
            self._gather(value),
            attention_mask,
            attn_mask_type,
            attention_bias,
            packed_seq_params,
        )
