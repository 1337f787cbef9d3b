"""Per-sample log-probs / entropy and values from the model's output: the map from a rank's (packed or padded,
CP-split) logits to each sample's response tokens (`get_responses`), the padded-vocab mask, top-p replay's kept-set
restriction, scoring in batches of whole responses or in chunks (`--log-probs-chunk-size`) and the CP gather of the
whole response.
"""

import torch
from megatron.core import parallel_state as mpu

from slime.backends.megatron_utils.cp_utils import (
    cp_size_and_rank,
    gather_response_across_cp,
    response_pieces,
    zigzag_chunk_size,
)
from slime.utils.ppo_utils import compute_entropy_from_logits, compute_log_probs
from slime.utils.sampling_record import TEMPERATURES_KEY
from slime.utils.top_p_replay import sampling_is_truncated


def get_responses(logits, *, unconcat_tokens, total_lengths, response_lengths):
    """Yield `(logits [n, V/tp], tokens [n], pieces)` per sample: this rank's logit positions that score the sample's
    response tokens, the tokens they score, and where they sit in the response (`cp_utils.response_pieces`:
    `[(local_start, response_start, n)]`; one piece covering the whole response when there is no CP).

    `logits` is `[1, T, V/tp]` (samples packed back to back) or `[b, s, V/tp]` (sample i right-padded in row i).
    A sample's response is the last R tokens of its unpadded sequence, predicted by the logits one position earlier.
    Under CP a rank holds each sample's zigzag pair of chunks (`cp_utils`), so it scores up to two pieces of it.
    """
    packed = logits.size(0) == 1
    assert packed or logits.size(0) == len(unconcat_tokens), (
        f"logits batch {logits.size(0)} matches neither a packed row nor {len(unconcat_tokens)} padded rows"
    )
    cp_size, cp_rank = cp_size_and_rank()
    start = 0  # the sample's first local position in the packed row
    for i, (tokens, total_len, resp_len) in enumerate(zip(unconcat_tokens, total_lengths, response_lengths)):
        if resp_len > 0 and resp_len >= total_len:
            raise ValueError(
                f"sample {i}: response length {resp_len} leaves no prompt token before the response "
                f"(total length {total_len}); every sample needs at least one prompt token"
            )
        row = logits[0] if packed else logits[i]
        if cp_size == 1:
            chunk, local_len = total_len, total_len
            pieces = [(total_len - resp_len - 1, 0, resp_len)]
        else:
            chunk = zigzag_chunk_size(total_len, cp_size) if packed else logits.size(1) // 2
            local_len = 2 * chunk
            pieces = response_pieces(total_len, resp_len, chunk, cp_size, cp_rank)
        first = total_len - resp_len  # the response's first token; logit p scores token p + 1
        logits_parts = [row[start + lo : start + lo + n] for lo, _, n in pieces] or [row[:0]]
        token_parts = [tokens[first + r0 : first + r0 + n] for _, r0, n in pieces] or [tokens[:0]]
        yield torch.cat(logits_parts), torch.cat(token_parts), pieces
        if packed:
            start += local_len


_BATCH_LOGITS = 1 << 24  # logits scored in one batch of responses (64 MiB in fp32)
_MASKED_LOGIT = -1e30  # finite: p = 0 without the 0 * inf = nan of -inf in the entropy and its gradient


def _mask_padded_vocab(logits, vocab_size):
    """Hide the rows Megatron adds to make the vocab divisible by 128*TP: the inference engine's softmax runs over
    the real vocab only, so the trainer's must too (and the padded rows then get no gradient)."""
    part = logits.size(-1)
    start = mpu.get_tensor_model_parallel_rank() * part
    if not vocab_size or start + part <= vocab_size:
        return logits
    column = torch.arange(start, start + part, device=logits.device)
    return logits.masked_fill(column >= vocab_size, _MASKED_LOGIT)


def get_rollout_top_p_logprob_kwargs(args, batch):
    """`get_log_probs_and_entropy`'s top-p replay arguments for a micro-batch: the per-sample kept sets, which the
    batch must carry when training rollouts sample from a truncated distribution (`--rollout-top-p` < 1 or
    `--rollout-top-k` > 0) and may carry otherwise (samples whose own requests truncated); else `{}`."""
    ids, offsets = batch.get("rollout_top_p_token_ids"), batch.get("rollout_top_p_token_offsets")
    if not sampling_is_truncated(args) and (ids is None or offsets is None):
        return {}
    if ids is None or offsets is None:
        raise ValueError(
            f"--rollout-top-p {args.rollout_top_p} / --rollout-top-k {args.rollout_top_k}: the training batch has no "
            "rollout_top_p_token_ids / rollout_top_p_token_offsets to score the tokens over the sets the engine kept"
        )
    return {"top_p_token_ids": ids, "top_p_token_offsets": offsets}


def get_rollout_temperature_kwargs(batch):
    """`get_log_probs_and_entropy`'s per-token temperatures for a micro-batch: present when some trained token was
    sampled at a temperature other than `--rollout-temperature` (`sampling_provenance.rollout_temperatures`)."""
    temperatures = batch.get(TEMPERATURES_KEY)
    return {} if temperatures is None else {"temperatures": temperatures}


def _response_positions(pieces, device):
    """The response positions of a sample's rows, from `get_responses`' pieces."""
    positions = [torch.arange(r0, r0 + n, device=device) for _, r0, n in pieces]
    return torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long, device=device)


def _restrict_to_kept_sets(logits, pieces, kept_ids, offsets, tokens):
    """`logits` [n, V/tp] of one sample's response rows with every token outside that step's kept set masked out,
    so the (vocab-parallel) softmax renormalises over exactly the engine's sampling support. `pieces` map the rows
    to response positions (`get_responses`); a step with an empty set keeps the whole vocabulary. The row's own
    token `tokens` [n] always stays in (as current slime): one its set lacks (a token the engine did not sample)
    scores finitely, not at -1e30, whose ratio would make the loss NaN even under a loss mask of 0."""
    part = logits.size(-1)
    vocab_start = mpu.get_tensor_model_parallel_rank() * part
    device = logits.device
    positions = _response_positions(pieces, device)
    offsets = offsets.to(device=device, dtype=torch.long)
    kept_ids = kept_ids.to(device=device, dtype=torch.long)
    starts, lengths = offsets[positions], offsets[positions + 1] - offsets[positions]
    rows = torch.repeat_interleave(torch.arange(positions.numel(), device=device), lengths)
    within = torch.arange(rows.numel(), device=device) - torch.repeat_interleave(
        torch.cumsum(lengths, 0) - lengths, lengths
    )
    local = kept_ids[torch.repeat_interleave(starts, lengths) + within] - vocab_start
    here = (local >= 0) & (local < part)
    keep = torch.zeros(positions.numel(), part, dtype=torch.bool, device=device)
    keep[rows[here], local[here]] = True
    target = tokens.to(device) - vocab_start
    mine = (target >= 0) & (target < part)
    keep[torch.arange(target.numel(), device=device)[mine], target[mine]] = True
    keep[lengths == 0] = True
    return logits.masked_fill(~keep, _MASKED_LOGIT)


def _log_probs_in_chunks(logits, tokens, tp_group, with_entropy, chunk_size):
    """`[log_probs (, entropy)]` of the rows, `--log-probs-chunk-size` rows at a time when it is > 0, so
    that the forward's fp32 softmax temporaries are chunk x V/tp instead of rows x V/tp."""
    if chunk_size > 0 and logits.size(0) > chunk_size:
        parts = [
            _log_probs_in_chunks(lg, tk, tp_group, with_entropy, -1)
            for lg, tk in zip(logits.split(chunk_size), tokens.split(chunk_size))
        ]
        return [torch.cat(col) for col in zip(*parts)]
    values = [compute_log_probs(logits, tokens, tp_group)]
    if with_entropy:
        values.append(compute_entropy_from_logits(logits, tp_group))
    return values


def get_log_probs_and_entropy(
    logits,
    *,
    args,
    unconcat_tokens,
    total_lengths,
    response_lengths,
    with_entropy=False,
    top_p_token_ids=None,
    top_p_token_offsets=None,
    temperatures=None,
):
    """`{"log_probs": [per-sample 1-D], "entropy": [...] (with_entropy)}` of the response tokens.

    Logits are divided by `--rollout-temperature` first so the trainer's log-probs match the rollout engine's
    temperature-scaled ones; with `temperatures` (per sample, one per response token, see
    `get_rollout_temperature_kwargs`) each token's logits by the temperature it was sampled at instead. With
    `top_p_token_ids` / `top_p_token_offsets` (per sample, see `get_rollout_top_p_logprob_kwargs`) each token is
    scored over the set the engine kept at its step (top-p replay).
    """
    logits = logits.float()
    if temperatures is None and args.rollout_temperature != 1.0:
        logits = logits / args.rollout_temperature
    logits = _mask_padded_vocab(logits, args.vocab_size)
    tp_group = mpu.get_tensor_model_parallel_group()
    gather = mpu.get_context_parallel_world_size() > 1
    chunk_size = args.log_probs_chunk_size
    # Whole responses are scored together up to a budget of rows (--log-probs-chunk-size, else _BATCH_LOGITS
    # logits): one softmax per batch instead of per sample, each row's values the same (the reductions are per row).
    budget = chunk_size if chunk_size > 0 else max(1, _BATCH_LOGITS // logits.size(-1))
    batch, rows, scored, pieces_of = [], 0, [], []

    def score():
        lgs, tks = zip(*batch)  # a lone sample's rows as they are: no copy of a long response
        lg, tk = (lgs[0], tks[0]) if len(batch) == 1 else (torch.cat(lgs), torch.cat(tks))
        values = _log_probs_in_chunks(lg, tk, tp_group, with_entropy, chunk_size)
        scored.extend(zip(*[v.split([t.numel() for t in tks]) for v in values]))
        batch.clear()

    for i, (logits_chunk, tokens_chunk, pieces) in enumerate(
        get_responses(
            logits, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths, response_lengths=response_lengths
        )
    ):
        if temperatures is not None:
            t = temperatures[i].to(device=logits_chunk.device, dtype=logits_chunk.dtype)
            logits_chunk = logits_chunk / t[_response_positions(pieces, logits_chunk.device)].unsqueeze(-1)
        if top_p_token_offsets is not None:
            logits_chunk = _restrict_to_kept_sets(
                logits_chunk, pieces, top_p_token_ids[i], top_p_token_offsets[i], tokens_chunk
            )
        if batch and rows + tokens_chunk.numel() > budget:
            score()
            rows = 0
        batch.append((logits_chunk, tokens_chunk))
        rows += tokens_chunk.numel()
        pieces_of.append(pieces)
    if batch:
        score()
    log_probs, entropy = [], []
    for values, pieces, resp_len in zip(scored, pieces_of, response_lengths):
        if gather:  # every CP rank gets the whole response, so the loss below is the same as without CP
            values = [gather_response_across_cp(pieces, v, resp_len) for v in values]
        log_probs.append(values[0])
        if with_entropy:
            entropy.append(values[1])
    out = {"log_probs": log_probs}
    if with_entropy:
        out["entropy"] = entropy
    return out


def get_values(logits, *, args, unconcat_tokens, total_lengths, response_lengths, **kwargs):
    """`{"values": [per-sample 1-D]}`: the critic's value head output (`[..., 1]`) at the positions that score each
    response token, i.e. the value of the state before the token (no temperature: these are not logits)."""
    gather = mpu.get_context_parallel_world_size() > 1
    values = []
    for (chunk, _, pieces), resp_len in zip(
        get_responses(
            logits, unconcat_tokens=unconcat_tokens, total_lengths=total_lengths, response_lengths=response_lengths
        ),
        response_lengths,
    ):
        assert chunk.size(-1) == 1, f"the critic's output has {chunk.size(-1)} columns, expected 1 (the value head)"
        v = chunk.squeeze(-1).float()
        values.append(gather_response_across_cp(pieces, v, resp_len) if gather else v)
    return {"values": values}
