"""--log-probs-chunk-size: log-probs and entropy computed a few tokens at a time equal the unchunked ones (values and
gradients) and an independent log_softmax of the whole vocabulary, with the vocabulary whole (TP=1) and split over
two tensor-parallel ranks (the vocab-parallel softmax reduces every chunk over the TP group)."""

import pytest
import torch

from tests._args import make_args
from tests._megatron_helpers import spawn

V = 16
LENGTHS, RESPONSES = [7, 12, 4], [3, 5, 2]  # packed back to back: one [1, 23, V] row
TEMPERATURE = 0.8


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, sum(LENGTHS), V, generator=g) * 3
    tokens = [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]
    return logits, tokens


def _expected(logits, tokens):
    """Per sample: log p(response token) and entropy from log_softmax over the whole vocabulary (by hand)."""
    lp_all, ent_all, start = [], [], 0
    for t, n, r in zip(tokens, LENGTHS, RESPONSES):
        z = logits[0, start + n - r - 1 : start + n - 1] / TEMPERATURE  # position p scores token p + 1
        lp = torch.log_softmax(z, -1)
        lp_all.append(lp.gather(-1, t[n - r :, None])[:, 0])
        ent_all.append(-(lp.exp() * lp).sum(-1))
        start += n
    return lp_all, ent_all


def _ranks(rank, tp, chunk_sizes):
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils.log_probs import get_log_probs_and_entropy

    mpu.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        logits, tokens = _inputs()
        want_lp, want_ent = _expected(logits, tokens)
        part = V // tp
        got = {}
        for chunk in [-1, *chunk_sizes]:
            args = make_args("--rollout-temperature", str(TEMPERATURE), "--log-probs-chunk-size", str(chunk))
            shard = logits[..., rank * part : (rank + 1) * part].clone().requires_grad_()
            out = get_log_probs_and_entropy(
                shard,
                args=args,
                unconcat_tokens=tokens,
                total_lengths=LENGTHS,
                response_lengths=RESPONSES,
                with_entropy=True,
            )
            (sum(x.sum() for x in out["log_probs"]) + 0.5 * sum(x.sum() for x in out["entropy"])).backward()
            got[chunk] = (out["log_probs"], out["entropy"], shard.grad)
        ref_lp, ref_ent, ref_grad = got[-1]
        for lp, ent in zip((ref_lp, ref_ent), (want_lp, want_ent)):
            for a, b in zip(lp, ent):
                assert a.shape == b.shape and torch.allclose(a.detach(), b, atol=1e-5), (a, b)
        for chunk in chunk_sizes:
            lp, ent, grad = got[chunk]
            for a, b in zip(lp + ent, ref_lp + ref_ent):
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6), (chunk, a, b)
            assert torch.allclose(grad, ref_grad, atol=1e-6), chunk
    finally:
        mpu.destroy_model_parallel()


@pytest.mark.parametrize("tp", [1, 2])
def test_chunked_log_probs_equal_unchunked(tp):
    spawn(_ranks, tp, tp, [1, 2, 3, 64])


def test_chunk_size_parses_as_upstream():
    assert make_args().log_probs_chunk_size == -1
    assert make_args("--log-probs-chunk-size", "512").log_probs_chunk_size == 512


def _batches(rank):
    from megatron.core import parallel_state as mpu

    from slime.backends.megatron_utils import log_probs

    mpu.initialize_model_parallel()
    rows = []
    score = log_probs.compute_log_probs
    log_probs.compute_log_probs = lambda logits, tokens, group: (
        rows.append(len(tokens)) or score(logits, tokens, group)
    )
    try:
        logits, tokens = _inputs()
        for chunk, want in [(-1, [10]), (64, [10]), (4, [3, 4, 1, 2]), (7, [3, 7]), (8, [8, 2])]:
            rows.clear()
            args = make_args("--log-probs-chunk-size", str(chunk))
            kw = dict(args=args, unconcat_tokens=tokens, total_lengths=LENGTHS, response_lengths=RESPONSES)
            out = log_probs.get_log_probs_and_entropy(logits, **kw)
            assert rows == want, (chunk, rows)
            assert [lp.numel() for lp in out["log_probs"]] == RESPONSES
    finally:
        log_probs.compute_log_probs = score
        mpu.destroy_model_parallel()


def test_responses_are_scored_together_up_to_the_chunk_size():
    """A micro-batch's responses (3, 5 and 2 tokens) go through the vocabulary softmax together, in batches of whole
    responses up to --log-probs-chunk-size tokens (a longer one alone, in chunks), not one sample at a time."""
    spawn(_batches, 1)
