"""Multi-token prediction (MTP) in the trainer: megatron-core's `MultiTokenPredictionBlock` on the model's own layer
spec (local or Transformer Engine), trained with the RL loss under `--enable-mtp-training`, frozen otherwise.

`--mtp-num-layers N` builds the block (on the last pipeline stage), so its weights are loaded from the HF checkpoint,
exported and sent to the inference engines with the rest of the model. The block runs only in training forwards
that carry an MTP loss mask (`--enable-mtp-training`): log-prob forwards never run it, and the main head's logits come
from the decoder output alone. Depth k at position i reads the hidden state of depth k-1 at i and the embedding of
token i+k and predicts token i+k+1; its cross-entropy counts where that token is a loss-masked response token of the
same sample (padded rows and packed `cu_seqlens` segments are rolled separately, so nothing is predicted across a
sample boundary; under context parallelism megatron's rolls pass chunk boundaries between CP ranks, and the mean is
over the whole samples). The mean over those tokens, times `--mtp-loss-scaling-factor / N`, is added to the backward pass
through megatron's `MTPLossAutoScaler` (scaled by the schedule like the main loss).
"""

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.multi_token_prediction import (
    MTPLossAutoScaler,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec,
    roll_tensor,
)
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from .cp_utils import cp_size_and_rank, slice_with_cp, zigzag_ranges
from .local_layers import with_zero_centered_norms
from .log_probs import _mask_padded_vocab
from .param_utils import unwrap_model


def mtp_block_spec(args, layer_spec, use_te, post_process):
    """The MTP block spec for `--mtp-num-layers` (None without it, or on a stage other than the last): each MTP layer
    wraps the decoder's last layer spec (an MoE layer for DeepSeek-V3 / GLM-4.5, as their MTP layers are)."""
    if not args.mtp_num_layers or not post_process:
        return None
    last = layer_spec.layer_specs[-1] if isinstance(layer_spec, TransformerBlockSubmodules) else layer_spec
    last = getattr(layer_spec, "mtp_layer_spec", None) or last  # a hybrid's: full attention (qwen3_next.py)
    spec = get_mtp_layer_spec(last, use_te)
    if args.apply_layernorm_1p and not use_te:  # enorm, hnorm and the final norm too (TE's norms take it from config)
        spec = with_zero_centered_norms(spec)
    return MultiTokenPredictionBlockSubmodules(layer_specs=[spec] * args.mtp_num_layers)


class MTPGPTModel(GPTModel):
    """GPTModel whose MTP block runs only when the forward gets `loss_mask` (the MTP loss mask, aligned with
    `input_ids`: 1 where position i predicts a loss-masked token i+1) in training; it always returns logits."""

    real_vocab_size = None  # the real vocab (set by the provider): padded rows are excluded from the MTP softmax

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, attention_mask=None,
                     packed_seq_params=None, sequence_len_offset=None, runtime_gather_output=None,
                     extra_block_kwargs=None, **unused):  # fmt: skip
        self.last_mtp_losses = None
        run_mtp = self.mtp_process and loss_mask is not None and self.training
        if run_mtp:
            n = self.config.mtp_num_layers
            stacked = self.mtp(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=self.embedding,
                **(extra_block_kwargs or {}),
            )
            hidden = torch.chunk(stacked, 1 + n, dim=0)
            hidden_states = self._attach_mtp_loss(hidden[0], hidden[1:], input_ids, loss_mask, packed_seq_params)
        if not self.post_process:
            return hidden_states
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
        return logits.transpose(0, 1).contiguous()

    def _roll(self, tensor, packed_seq_params):
        return roll_tensor(tensor, shifts=-1, dims=-1, cp_group=self.cp_group, packed_seq_params=packed_seq_params)[0]

    def _attach_mtp_loss(self, main_hidden, mtp_hidden, input_ids, loss_mask, packed_seq_params):
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        labels = self._roll(input_ids, packed_seq_params)  # the main head's targets: token i+1
        mask = loss_mask.float()
        scale = self.config.mtp_loss_scaling_factor / len(mtp_hidden)
        cp = self.cp_group is not None and self.cp_group.size() > 1
        losses = []
        for hidden in mtp_hidden:
            labels = self._roll(labels, packed_seq_params)
            mask = self._roll(mask, packed_seq_params)
            logits, _ = self.output_layer(hidden, weight=weight)
            logits = _mask_padded_vocab(logits.float(), self.real_vocab_size)
            ce = tensor_parallel.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
            total = (ce.transpose(0, 1) * mask).sum()
            count = mask.sum()
            if cp:  # this rank holds part of each sample: the mean is over the whole samples' tokens
                torch.distributed.all_reduce(count, group=self.cp_group)
            mean = total / count.clamp_min(1)
            logged = mean.detach().clone()
            if cp:
                torch.distributed.all_reduce(logged, group=self.cp_group)
            losses.append(logged)
            contribution = total if self.config.calculate_per_token_loss else mean
            if cp:  # Megatron averages gradients over DP x CP, yet the CP ranks' shares add up to one sample set
                contribution = contribution * self.cp_group.size()
            main_hidden = MTPLossAutoScaler.apply(main_hidden, scale * contribution)
        self.last_mtp_losses = torch.stack(losses)
        return main_hidden


def mtp_loss_mask(batch):
    """The MTP loss mask in the layout of `batch["tokens"]`: per sample, position i is 1 where token i+1 is a
    response token with loss mask 1 (`[b, s]` right-padded rows, or the `[1, T]` packed row with padding zeros)."""
    rows = []
    for total, response, mask in zip(batch["total_lengths"], batch["response_lengths"], batch["loss_masks"]):
        prompt = total - response
        rows.append(F.pad(mask.float(), (prompt - 1, 1)))
    layout = batch["tokens"]
    cp_size, cp_rank = cp_size_and_rank()
    if batch["packed_seq_params"] is not None:
        flat = torch.cat([slice_with_cp(r, 0.0) for r in rows])  # each sample's zigzag pair, as its tokens
        return F.pad(flat, (0, layout.size(1) - flat.numel())).unsqueeze(0).to(layout.device)
    s = layout.size(1) * cp_size  # under CP a padded row holds this rank's zigzag pair of chunks of s
    padded = torch.stack([F.pad(r, (0, s - r.numel())) for r in rows])
    if cp_size > 1:
        ranges = zigzag_ranges(s // (2 * cp_size), cp_size, cp_rank)
        padded = padded[:, torch.cat([torch.arange(lo, hi) for lo, hi in ranges])]
    return padded.to(layout.device)


def last_mtp_losses(chunk):
    """Per-depth MTP losses of `chunk`'s last training forward (detached), or None where none ran."""
    return getattr(unwrap_model(chunk), "last_mtp_losses", None)


def freeze_mtp_params(chunks, args):
    """Without `--enable-mtp-training` the MTP layers are kept (loaded, exported, synced) but never updated."""
    if args.enable_mtp_training:
        return
    for chunk in chunks:
        mtp = getattr(unwrap_model(chunk), "mtp", None)
        if mtp is not None:
            for param in mtp.parameters():
                param.requires_grad = False
