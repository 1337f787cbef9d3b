"""Context parallelism (`--context-parallel-size c`): slime's per-sample ("zigzag", load-balanced) split of every
sequence across the CP ranks, the map from a rank's local logits back to a sample's response, and the gather that
gives every CP rank the whole response's log-probs / entropy.

A sample of length T is right-padded to `2c * chunk` (`chunk = ceil(T / 2c)`) and cut into 2c chunks; CP rank r
keeps chunks r and 2c-1-r, so each rank gets one cheap (early) and one expensive (late) chunk of causal attention.
"""

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from slime.utils.ppo_utils import get_sum_of_sample_mean  # noqa: F401  (v0.1.0's name here, see the end)


def cp_size_and_rank():
    """(CP size, CP rank); (1, 0) without torch.distributed (megatron then reports size 0)."""
    return max(mpu.get_context_parallel_world_size(), 1), mpu.get_context_parallel_rank()


def zigzag_chunk_size(length, cp_size):
    """Chunk length for a sequence of `length` tokens split into 2*cp_size chunks."""
    return -(-length // (2 * cp_size))


def zigzag_ranges(chunk, cp_size, cp_rank):
    """The two global `[start, end)` ranges CP rank `cp_rank` holds, in local order."""
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return [(first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)]


def slice_with_cp(tokens, pad_value, chunk=None):
    """This CP rank's part of a 1-D sequence (or of dim 0 of a tensor): chunks r and 2c-1-r of the sequence padded
    to 2c chunks of `chunk` (default `zigzag_chunk_size(len)`); the whole sequence when c == 1."""
    cp_size, cp_rank = cp_size_and_rank()
    if cp_size == 1:
        return tokens
    chunk = chunk or zigzag_chunk_size(tokens.size(0), cp_size)
    pad = 2 * cp_size * chunk - tokens.size(0)
    assert pad >= 0, f"chunk {chunk} x {2 * cp_size} is shorter than the sequence ({tokens.size(0)})"
    if pad:
        tokens = torch.cat([tokens, tokens.new_full((pad, *tokens.shape[1:]), pad_value)])
    return torch.cat([tokens[s:e] for s, e in zigzag_ranges(chunk, cp_size, cp_rank)])


def response_pieces(total_length, response_length, chunk, cp_size, cp_rank):
    """Where this CP rank's local logits score a sample's response: `[(local_start, response_start, n)]`.

    Logit t predicts token t+1, so the response (the last R of T tokens) is scored by global logit positions
    [T-R-1, T-1). `local_start` counts from the sample's first local position (its chunk r starts at 0, its chunk
    2c-1-r at `chunk`); pieces with n == 0 are dropped.
    """
    first = total_length - response_length - 1
    pieces = []
    for k, (start, end) in enumerate(zigzag_ranges(chunk, cp_size, cp_rank)):
        lo, hi = max(start, first), min(end, total_length - 1)
        if hi > lo:
            pieces.append((k * chunk + lo - start, lo - first, hi - lo))
    return pieces


def local_global_positions(local_len, cp_size, cp_rank, cu_seqlens=None):
    """Global position of each of this CP rank's `local_len` tokens, and the global length: one row of the padded
    layout (its zigzag pair of chunks) or, given the packed layout's global `cu_seqlens`, every packed segment's
    pair in turn (`data._packed_layout`)."""
    if cu_seqlens is None:
        chunk = local_len // 2
        bounds = [(0, 2 * cp_size * chunk)]
    else:
        cu = cu_seqlens.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))
    index = [
        torch.arange(start + lo, start + hi)
        for start, end in bounds
        for lo, hi in zigzag_ranges((end - start) // (2 * cp_size), cp_size, cp_rank)
    ]
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    assert index.numel() == local_len, f"{local_len} local tokens, but the CP layout gives {index.numel()}"
    return index, bounds[-1][1] if bounds else 0


def gather_sequence_across_cp(local, index, total, group):
    """`[local_len, ...]` of every CP rank -> `[total, ...]` in global order (`index`: this rank's global positions).
    A zero buffer summed over the group, differentiable: the backward of the all-reduce sums every rank's gradient,
    and each rank keeps its own positions' rows (gloo has no reduce-scatter, the usual backward of an all-gather)."""
    import torch.distributed.nn  # heavy, and only needed under CP

    index = index.to(local.device)
    full = local.new_zeros((total, *local.shape[1:])).index_copy(0, index, local)
    return torch.distributed.nn.all_reduce(full, op=dist.ReduceOp.SUM, group=group)


class _GatherAcrossCP(torch.autograd.Function):
    """Sum over the CP group of per-rank zero-padded tensors. The backward hands each rank the incoming gradient
    unchanged (no all-reduce): every CP rank computes the same loss from the gathered tensor, so each rank's own
    positions already receive the whole gradient, and summing over ranks would count it cp_size times."""

    @staticmethod
    def forward(ctx, tensor, group):
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def gather_response_across_cp(pieces, values, response_length):
    """The whole response (`[R]`) on every CP rank from this rank's `values` (concatenated, in `pieces` order).

    Differentiable; see `_GatherAcrossCP` for why its backward is not an all-reduce.
    """
    index = [torch.arange(resp_start, resp_start + n, device=values.device) for _, resp_start, n in pieces]
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long, device=values.device)
    # index_add even when this rank scores none of the response: the (empty) values keep the loss connected to
    # the model, so this rank still runs the backward, whose key/value all-reduces the other CP ranks wait for
    full = values.new_zeros(response_length).index_add(0, index, values)
    return _GatherAcrossCP.apply(full, mpu.get_context_parallel_group())


# ---------------------------------------------------------------------------------------------------------------
# slime v0.1.0's names for the same split, for user code that imports them from here (custom losses, TIS functions);
# its sum-of-sample-mean reducer, also defined here in v0.1.0, is imported from slime.utils.ppo_utils above
# ---------------------------------------------------------------------------------------------------------------


def get_logits_and_tokens_offset_with_cp(total_length, response_length):
    """`(chunk_size, chunks, logits_offsets, tokens_offsets)` of this CP rank for one sample, offsets counted from the
    sample's first token: its two chunks, the logit ranges in them that score response tokens (clipped to
    `[prompt_length - 1, total_length - 1)`, `(0, 0)` when empty) and the matching token ranges (+1)."""
    cp_size, cp_rank = cp_size_and_rank()
    chunk = zigzag_chunk_size(total_length, cp_size)
    chunks = zigzag_ranges(chunk, cp_size, cp_rank)
    first = total_length - response_length - 1
    logits, tokens = [], []
    for start, end in chunks:
        lo, hi = max(start, first), min(end, total_length - 1)
        logits.append((lo, hi) if hi > lo else (0, 0))
        tokens.append((lo + 1, hi + 1) if hi > lo else (0, 0))
    return chunk, tuple(chunks), tuple(logits), tuple(tokens)


def slice_log_prob_with_cp(log_prob, total_length, response_length):
    """This CP rank's part of a whole-response sequence (list or tensor), in the order of its local logits."""
    assert len(log_prob) == response_length, f"{len(log_prob)} values for a response of {response_length}"
    cp_size, _ = cp_size_and_rank()
    if cp_size == 1:
        return log_prob
    first = total_length - response_length - 1
    _, _, logits, _ = get_logits_and_tokens_offset_with_cp(total_length, response_length)
    parts = [log_prob[lo - first : hi - first] for lo, hi in logits if hi > lo]
    if isinstance(log_prob, torch.Tensor):
        return torch.cat(parts) if parts else log_prob[:0]
    return [x for part in parts for x in part]


def all_gather_with_cp(tensor, total_length, response_length):
    """The whole response on every CP rank from this rank's local values (`slice_log_prob_with_cp`'s layout)."""
    cp_size, cp_rank = cp_size_and_rank()
    if cp_size == 1:
        return tensor
    chunk = zigzag_chunk_size(total_length, cp_size)
    return gather_response_across_cp(
        response_pieces(total_length, response_length, chunk, cp_size, cp_rank), tensor, response_length
    )
