"""Architectures beyond Megatron: a transformers module in the attention slot of a Megatron `TransformerLayer`.

`HuggingfaceAttention` takes Megatron's `[s, b, h]` hidden states and packed-sample boundaries and hands the wrapped
module `[1, T, h]` with `cu_seqlens`; subclasses implement `hf_forward(hidden_states, cu_seqlens)`. The default runs
the module once per packed sample (so positions and any recurrent state start afresh at every boundary); a module
that has a varlen kernel (Gated DeltaNet) overrides it to run all samples at once.

Parallelism: the wrapped module's weights are replicated over tensor-parallel ranks (each TP rank computes the same
output from the same full input, and gets the same gradients); under sequence parallelism the sequence is gathered
first and scattered after. Pipeline parallelism needs nothing (the layer number is global).

Context parallelism (`--context-parallel-size c`): every CP rank holds its zigzag pair of chunks of each sample
(`cp_utils`). The layer gathers the CP group's chunks into the whole sequences in their original order (one
differentiable all-reduce of a zero-filled buffer: its backward hands every rank the gradient of its own chunks
from all ranks), runs the wrapped module over the whole samples, and keeps this rank's chunks of the output. Why a
gather and not a recurrence that passes the state from rank to rank: under the zigzag split a sample's chunks
visit the ranks in the order 0, 1, .., c-1, c-1, .., 0, so a state hand-over would run the ranks one after
another, twice, forwards and backwards (a custom autograd of its own), for no saving: the gather is exact by
construction (the same kernel on the same tokens as without CP, any module, any kernel backend: `hf_call`,
`--qwen-gdn-backend`), and the recurrence is linear in the sequence length. Its cost: each CP rank computes the
wrapped layers over the whole sequence (c times the work of those layers over the group; the full-attention
layers stay split) and holds their activations for the whole sequence.

Parameter names keep the HF module's: a wrapper that holds the HF module as attribute `linear_attn` of layer N has
`decoder.layers.N.self_attention.linear_attn.<hf name>`, which the converter maps to
`model.layers.N.linear_attn.<hf name>` (`GPTFamily(hf_modules=("linear_attn",))`).
"""

import torch
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.transformer.module import MegatronModule

from slime.backends.megatron_utils.cp_utils import cp_size_and_rank, gather_sequence_across_cp, local_global_positions


def load_hf_text_config(hf_checkpoint):
    """The decoder's HF config (`text_config` of a vision-language config)."""
    from transformers import AutoConfig  # heavy

    cfg = AutoConfig.from_pretrained(hf_checkpoint, trust_remote_code=True)
    return getattr(cfg, "text_config", None) or cfg


def sample_bounds(packed_seq_params, batch, seq):
    """cu_seqlens of the `[1, batch*seq]` token stream: the packed samples', or one sample per padded row."""
    if packed_seq_params is not None:
        return packed_seq_params.cu_seqlens_q
    return torch.arange(batch + 1, dtype=torch.int32) * seq


class HuggingfaceAttention(MegatronModule):
    """Base wrapper. Built by megatron as `self_attention` with `params={"args": args}` in the layer spec."""

    def __init__(self, args, config, layer_number, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        self.args = args
        self.layer_number = layer_number  # global and 1-based: megatron adds the pipeline offset
        self.hf_layer_idx = layer_number - 1
        self.hf_config = load_hf_text_config(args.hf_checkpoint)

    def forward(self, hidden_states, attention_mask=None, *args, packed_seq_params=None, **kwargs):
        sp = self.config.sequence_parallel and mpu.get_tensor_model_parallel_world_size() > 1
        if sp:  # the replicated module needs the whole sequence; its gradient is the same on every TP rank
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        cp_size, cp_rank = cp_size_and_rank()
        if cp_size > 1:  # this rank's zigzag chunks -> the whole sequences (see the module docstring)
            global_cu = packed_seq_params.cu_seqlens_q if packed_seq_params is not None else None
            index, total = local_global_positions(hidden_states.size(0), cp_size, cp_rank, global_cu)
            hidden_states = gather_sequence_across_cp(hidden_states, index, total, mpu.get_context_parallel_group())
        s, b, h = hidden_states.shape
        cu_seqlens = sample_bounds(packed_seq_params, b, s).to(hidden_states.device)
        out = self.hf_forward(hidden_states.transpose(0, 1).reshape(1, b * s, h), cu_seqlens)
        out = out.reshape(b, s, h).transpose(0, 1)
        if cp_size > 1:
            out = out.index_select(0, index.to(out.device))
        out = out.contiguous()
        if sp:
            out = tensor_parallel.scatter_to_sequence_parallel_region(out)
        return out, None

    def hf_forward(self, hidden_states, cu_seqlens):
        """`[1, T, h]` -> `[1, T, h]`: `self.hf_call` on each packed sample."""
        bounds = cu_seqlens.tolist()
        return torch.cat([self.hf_call(hidden_states[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:])], dim=1)

    def hf_call(self, hidden_states):
        raise NotImplementedError(f"{type(self).__name__} must define hf_call or hf_forward")
